"""Where the benchmarks' ranks run: GPUs over NCCL only with a GPU for every rank, else
CPU ranks over gloo that keep DeepSpeed off the GPUs, and the report says which.

The spawn test starts two real ranks through the helper every spawning benchmark uses.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks._common import (
    Placement,
    code_version,
    environment,
    place_ranks,
    place_torchrun_ranks,
    spawn_ranks,
)
from benchmarks._common import _report as common_report


@pytest.mark.parametrize(
    ("gpus", "smoke", "backend"),
    [
        (0, False, "gloo"),
        (1, False, "gloo"),
        (2, False, "nccl"),
        (8, False, "nccl"),
        (2, True, "gloo"),
    ],
)
def test_gpu_ranks_only_with_a_gpu_per_rank(gpus: int, smoke: bool, backend: str) -> None:
    p = Placement(world=2, gpus=gpus, cores=16, smoke=smoke)
    assert p.backend == backend
    assert p.device(1) == (torch.device("cuda", 1) if backend == "nccl" else torch.device("cpu"))


def test_cpu_ranks_share_the_cores_and_say_why() -> None:
    one_gpu = Placement(world=2, gpus=1, cores=16)
    assert one_gpu.threads == 8
    assert one_gpu.describe() == "2 ranks on the CPU over gloo, 8 threads each (1 GPU for 2 ranks)"
    assert Placement(world=4, gpus=0, cores=2).threads == 1
    assert Placement(world=2, gpus=0, cores=2).describe().endswith("(no GPU)")
    assert Placement(world=2, gpus=2, cores=2, smoke=True).describe().endswith("(--smoke)")
    assert (
        Placement(world=2, gpus=2, cores=2).describe() == "2 ranks on GPUs over NCCL, one GPU each"
    )


def test_this_host_without_cuda_places_ranks_on_gloo() -> None:
    p = place_ranks(2)
    assert p.gpus == torch.cuda.device_count()
    if torch.cuda.device_count() == 0:
        assert (p.backend, p.device(0)) == ("gloo", torch.device("cpu"))
    else:  # a GPU host: the same rule on its own count
        assert p.on_gpus == (torch.cuda.device_count() >= 2)


def test_torchrun_ranks_are_placed_by_the_ranks_of_this_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two nodes of 2 ranks: each host needs 2 GPUs, not 4.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert place_torchrun_ranks(smoke=False) == place_ranks(2)


def test_the_environment_line_names_the_host_and_the_ranks() -> None:
    ranks = Placement(world=2, gpus=0, cores=2).describe()
    line = environment(ranks)
    assert f"Ranks: {ranks}." in line
    assert "cores" in line and "GiB" in line  # the host, not only its device
    assert f"Code: {code_version()}. Command: " in line


def test_code_version_says_when_the_tree_is_not_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree whose tracked files differ from HEAD (a device copy whose git metadata lags
    the files it was given, say) is not reported as that commit's."""
    repo, plain = tmp_path / "repo", tmp_path / "plain"
    repo.mkdir()
    plain.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    monkeypatch.setattr(common_report, "ROOT", repo)
    (repo / "untracked.txt").write_text("ignored by the check\n")
    assert code_version() == f"zeroshard commit {head}"
    (repo / "a.py").write_text("x = 2\n")
    assert code_version() == f"zeroshard commit {head} with uncommitted changes"
    monkeypatch.setattr(common_report, "ROOT", plain)
    assert code_version() == "zeroshard commit unknown (not a git checkout)"


def _report_rank(rank: int, world: int, out: str) -> None:
    Path(out, f"{rank}.json").write_text(
        json.dumps(
            {
                "world": world,
                "backend": dist.get_backend(),
                "threads": torch.get_num_threads(),
                "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
            }
        )
    )


def test_spawned_cpu_ranks_join_gloo_with_their_share_of_cores(tmp_path: Path) -> None:
    placement = Placement(world=2, gpus=torch.cuda.device_count(), cores=4, smoke=True)
    seconds = spawn_ranks(_report_rank, placement, (str(tmp_path),))
    assert seconds > 0
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        # DS_ACCELERATOR=cpu: DeepSpeed would otherwise pick a GPU from torch.cuda.
        assert got == {"world": 2, "backend": "gloo", "threads": 2, "ds_accelerator": "cpu"}
