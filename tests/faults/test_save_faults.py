"""Faults during save: disk full on one rank, a read-only root, a save killed between
its commit rename and the `latest` update. Every rank gets the same error, `latest`
does not move, and the previous checkpoint still loads bit-identical."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.faults._engine import assert_same_bits, build, train_step
from zeroshard.ckpt import CheckpointError, OutputExistsError, list_checkpoints, read_latest

NOBODY = 65534


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder a rank can still reach as nobody (pytest's own tmp folder is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="zeroshard-faults-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _save_faults(root: str, device: str) -> None:
    rank = dist.get_rank()
    model, opt = build(2, device=device)
    train_step(model, opt, 0)
    zs.save_checkpoint(model, opt, root, step=1)
    good = zs.full_state_dict(model)
    train_step(model, opt, 1)

    def previous_intact() -> None:
        assert read_latest(Path(root)) == "step-1"
        assert zs.load_checkpoint(model, opt, root) == 1
        assert_same_bits(zs.full_state_dict(model), good)

    def disk_full() -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:  # files may not grow past 1 KiB: the shard write fails (EFBIG)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        try:
            with pytest.raises(CheckpointError) as info:
                zs.save_checkpoint(model, opt, root, step=2)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        msg = str(info.value)
        assert "writing the shards failed on rank(s) [1]" in msg and "rank00001" in msg, msg
        assert list_checkpoints(root) == ["step-1"]
        previous_intact()

    def read_only_root() -> None:
        # As root a read-only folder would still be writable: rank 0 (the one that
        # creates the save's folder) saves as nobody, regaining root after.
        as_nobody = rank == 0 and os.geteuid() == 0
        if rank == 0:
            Path(root).chmod(0o555)
        dist.barrier()
        try:
            if as_nobody:
                os.seteuid(NOBODY)
            with pytest.raises(CheckpointError) as info:
                zs.save_checkpoint(model, opt, root, step=2)
        finally:
            if as_nobody:
                os.seteuid(0)
            dist.barrier()
            if rank == 0:
                Path(root).chmod(0o755)
        msg = str(info.value)
        assert "before writing failed on rank(s) [0]" in msg and "Permission denied" in msg, msg
        previous_intact()

    def killed_before_latest() -> None:
        train_step(model, opt, 2)
        zs.save_checkpoint(model, opt, root, step=3)
        newer = zs.full_state_dict(model)
        dist.barrier()
        if rank == 0:  # the state a SIGKILL after the rename, before `latest`, leaves
            Path(root, "latest").write_text("step-1\n")
        dist.barrier()
        with pytest.raises(OutputExistsError, match=r"step-3 exists; pass overwrite=True"):
            zs.save_checkpoint(model, opt, root, step=3)
        zs.save_checkpoint(model, opt, root, step=3, overwrite=True)  # the argument exists
        assert read_latest(Path(root)) == "step-3"
        assert zs.load_checkpoint(model, opt, root) == 3
        assert_same_bits(zs.full_state_dict(model), newer)

    run_each([{}], disk_full)
    run_each([{}], read_only_root)
    run_each([{}], killed_before_latest)


@pytest.mark.gpu
def test_save_faults_agree_and_keep_the_previous_checkpoint(shared_dir: Path, device: str) -> None:
    world_fits(device, 2)
    run_ranks(_save_faults, 2, str(shared_dir / "ckpt"), device, device=device, timeout_s=240)
