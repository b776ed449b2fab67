"""A snapshot's scalars held as tensors (fused AdamW's `step`, a learning rate given as a
tensor) are written into its header with no host-device synchronization ([Note: scalars
without a sync] in zeroshard/engine/recovery/_scalars.py): the header holds the values
`.item()` gives as of `take` (floats as floats), later in-place writes do not reach
them, and a restore from the snapshot and the journal entry after it is bit for bit. On
CUDA (`-m gpu --device cuda`) `take`, full and entry, runs under
`torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model
from zeroshard.engine.recovery import Snapshots, _file
from zeroshard.engine.recovery._host_copy import HostCopy
from zeroshard.engine.recovery._scalars import Scalars
from zeroshard.engine.recovery._store import ENTRY, OWN


def test_fetch_gives_item_values_as_of_the_call() -> None:
    """Each dtype's value and Python type as `.item()` gives it, taken at `fetch`: an
    in-place write after it (the next step's) is not what the header gets."""
    scalars = [
        torch.tensor(3.0),  # AdamW's step
        torch.tensor(1e-3, dtype=torch.float64),
        torch.tensor(0.1, dtype=torch.bfloat16),
        torch.tensor([7]),
        torch.tensor(True),
        torch.tensor(2.5),
    ]
    want = [t.item() for t in scalars]
    values = HostCopy().fetch(scalars)
    for t in scalars:
        t.copy_(~t if t.dtype == torch.bool else t + 1)
    got = values()
    assert got == want and [type(v) for v in got] == [type(v) for v in want]


def test_placeholders_leave_room_for_any_value() -> None:
    """A header planned with placeholders holds the longest values their JSON can have,
    at the planned length (the file's size and offsets as planned), and parses back to
    them."""
    extremes = [
        torch.tensor(-2.2250738585072014e-308, dtype=torch.float64),
        torch.tensor(-5e-324, dtype=torch.float64),  # -4.9406564584124654e-324
        torch.tensor(torch.iinfo(torch.int64).min),
        torch.tensor(float("-inf")),
        torch.tensor(float("nan")),
        torch.tensor(False),
        torch.tensor(1 / 3, dtype=torch.float32),
    ]
    scalars = Scalars()
    record = {"after": [{"lr": scalars.defer(t), "betas": [0.9, 0.95]} for t in extremes]}
    items = {"grad.group0": torch.arange(5.0)}
    planned = _file.plan(3, 0, 1, None, items, None, record, pad=1 << 16)
    values = [t.item() for t in extremes]
    real = scalars.resolve(record, values)
    final = _file.resolved(planned, None, real)
    assert len(final.header) == len(planned.header) and final.entries == planned.entries
    buf = torch.zeros(final.size, dtype=torch.uint8)
    _file.fill_header(buf, final)
    for key, place in _file.slots(buf, final).items():
        place.copy_(items[key])
    _file.seal(buf)
    _file.check(buf, "the test's snapshot")
    snap = _file.parse(buf, "the test's snapshot")
    assert snap.journal is not None
    assert json.dumps(snap.journal) == json.dumps(real)  # NaN too; ints stay ints
    assert torch.equal(snap.tensors["grad.group0"], items["grad.group0"])


@contextlib.contextmanager
def _no_sync(device: str) -> Iterator[None]:
    """On CUDA: any host-device synchronization inside is an error."""
    if device != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _state(model: torch.nn.Module, opt: zs.ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Masters, optimizer state (the step too) and learning rates (tensors: a restore
    fills them in place, so a scheduler goes on rounding as the uninterrupted run)."""
    out = {f"p.{k}": v.clone() for k, v in zs.full_state_dict(model).items()}
    for i, g in enumerate(opt.param_groups):
        for j, p in enumerate(g["params"]):
            for k, v in opt.state.get(p, {}).items():
                out[f"o.{i}.{j}.{k}"] = torch.as_tensor(v).detach().cpu().clone()
        assert isinstance(g["lr"], torch.Tensor), f"param group {i}'s lr is {g['lr']!r}"
        out[f"lr.{i}"] = g["lr"].detach().cpu().clone()
    return out


def _lrs(opt: zs.ZeroOptimizer) -> list[Any]:
    return [g["lr"].item() for g in opt.param_groups]


def _tensor_scalars(folder: str, device: str) -> None:
    """Fused AdamW (its step a tensor, on the device on CUDA) with a tensor learning rate
    per param group, changed in place by a scheduler at every step; a full snapshot at 1
    and 4, entries at 2, 3 and 5 (full_every=3). The headers hold the values of `take`
    time; the restore of step 5 (4's full snapshot, 5's entry replayed) is bit for bit."""
    # On CUDA the slots are pinned, which Linux allows for shared file mappings in tmpfs
    # only: /dev/shm, as Snapshots' default root (a pageable fallback would wait).
    shm = Path("/dev/shm") if device == "cuda" else Path(folder)
    root, disk = tempfile.mkdtemp(prefix="zeroshard-test-", dir=shm), f"{folder}/ckpt"
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    random.seed(rank)
    model = make_model(11).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "lr": torch.tensor(1e-3, device=device)},
        {"params": [p for p in params if p.dim() < 2], "lr": torch.tensor(3e-3, device=device)},
    ]
    inner = torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=True)
    model, opt = zs.initialize(model, inner, {"stage": 2, "min_unit_params": 1})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    snaps = Snapshots(model, opt, every=1, full_every=3, client_state={"sched": sched}, root=root)
    try:
        states, consumed, after = {}, {}, {}
        for s in range(5):
            batch = global_batches(8, 1, 12, 1)[s, 0]
            x = batch.reshape(world, -1, batch.shape[-1])[rank].to(device)
            loss_fn(model, x).backward()
            consumed[s + 1] = _lrs(opt)
            opt.step()
            opt.zero_grad()
            sched.step()
            states[s + 1] = _state(model, opt)
            after[s + 1] = _lrs(opt)
            with _no_sync(device):
                assert snaps.take(s + 1)
        snaps.wait()
        # The headers: what `.item()` gave at `take`, floats as floats.
        full = _file.parse(_file.mapped(snaps.store.path(4, rank, world, OWN)), "step 4")
        entry = _file.parse(_file.mapped(snaps.store.path(5, rank, world, ENTRY)), "step 5")
        assert full.meta is not None and entry.journal is not None
        steps = {json.dumps(g.scalars) for g in full.meta.groups if g.requires_grad}
        assert steps == {json.dumps({"step": 4.0})}, steps
        assert [p["lr"] for p in full.meta.param_groups] == after[4]
        assert [p["lr"] for p in entry.journal["consumed"]] == consumed[5]
        assert [p["lr"] for p in entry.journal["after"]] == after[5]
        assert consumed[5] != after[5] and len(set(after[5])) == 2  # each value its own
        dist.barrier()
        assert snaps.resume(disk) == 5 and snaps.last_resume.source == "memory"
        got = _state(model, opt)
        assert got.keys() == states[5].keys()
        for k, v in states[5].items():
            assert torch.equal(got[k], v), k
    finally:
        snaps.close()
        shutil.rmtree(root, ignore_errors=True)


def test_tensor_scalars_restore_bit_for_bit(tmp_path: Path) -> None:
    """On the CPU (2 ranks, each keeping the other's replica): the deferred header path
    (values taken at `take`, the header written in the background) with fused AdamW and
    tensor learning rates."""
    run_ranks(_tensor_scalars, 2, str(tmp_path), "cpu")


@pytest.mark.gpu
def test_take_does_not_synchronize_on_cuda(tmp_path: Path, device: str) -> None:
    """On one GPU: fused AdamW's step and the learning rates on the device; `take`, full
    and entry, under set_sync_debug_mode("error"); the restore bit for bit."""
    if device != "cuda":
        pytest.skip("a host-device synchronization needs CUDA; run with -m gpu --device cuda")
    world_fits(device, 1)
    run_ranks(_tensor_scalars, 1, str(tmp_path), device, device=device)
