"""SIGKILL at random moments of saving never loses the previous checkpoint.

A child process saves 8 MB checkpoints in a loop (and removes old ones, keeping two);
the test kills it with SIGKILL at a random time, then checks the root: `latest` names
a complete checkpoint at least as new as the last one the child saw committed, every
visible checkpoint passes its checksums, and a new save over the debris works.
Children fork from a forkserver that has imported torch once (a fresh interpreter per
kill would cost seconds).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from zeroshard.ckpt import (
    CheckpointMeta,
    GroupMeta,
    list_checkpoints,
    load,
    read_latest,
    remove_checkpoint,
    save,
)
from zeroshard.partition import FlatLayout

N = 1 << 20  # elements per shard: 4 MB, two shards per checkpoint


def _meta() -> CheckpointMeta:
    layout = FlatLayout.build([("w", (N,))], torch.float32, 1)
    kinds = {"master": torch.float32, "optim.exp_avg": torch.float32}
    return CheckpointMeta(1, (GroupMeta("g", layout, kinds),), buffers=("b",))


def _tensors(step: int) -> dict[str, torch.Tensor]:
    return {
        "g.master": torch.full((N,), float(step)),
        "g.optim.exp_avg": torch.full((N,), -float(step)),
        "buffer.b": torch.tensor([step]),
    }


def _save_forever(root: str, conn: Connection) -> None:
    torch.set_num_threads(1)
    meta = _meta()
    step = 1
    while True:
        save(root, step, meta=meta, tensors=_tensors(step))
        conn.send(step)
        if step > 2:
            remove_checkpoint(root, f"step-{step - 2}")
        step += 1


def _check_step(root: Path, step: int, name: str | None = None) -> None:
    got = load(root, rank=0, world_size=1, tag=name)  # verifies size and crc32
    want = _tensors(step)
    assert got.meta.step == step
    assert torch.equal(got.shard("g", "master"), want["g.master"])
    assert torch.equal(got.shard("g", "optim.exp_avg"), want["g.optim.exp_avg"])
    assert torch.equal(got.buffers["b"], want["buffer.b"])


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "zeroshard.ckpt", __name__])
    rng = random.Random(1234)
    for i in range(8):
        root = tmp_path / f"run{i}"
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_save_forever, args=(str(root), send), daemon=True)
        child.start()
        send.close()
        assert recv.poll(120), "the child never committed a checkpoint"
        committed = recv.recv()
        time.sleep(rng.uniform(0.0, 0.4))
        child.kill()
        child.join()
        try:
            while recv.poll():
                committed = recv.recv()
        except (EOFError, OSError):
            pass  # killed half way through a send: the earlier value stands
        latest = read_latest(root)
        assert latest is not None and latest.startswith("step-")
        newest = int(latest.removeprefix("step-"))
        assert newest >= committed, f"run {i}: lost step {committed} (latest {latest})"
        _check_step(root, newest)
        for name in list_checkpoints(root):
            _check_step(root, int(name.removeprefix("step-")), name)
        visible = {p.name for p in root.iterdir() if not p.name.startswith(".")}
        assert visible == {"latest", *list_checkpoints(root)}, visible
        # The next save cleans up what the killed one left and commits normally.
        save(root, 10_000, meta=_meta(), tensors=_tensors(10_000), overwrite=True)
        _check_step(root, 10_000)
        assert read_latest(root) == "step-10000"
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
