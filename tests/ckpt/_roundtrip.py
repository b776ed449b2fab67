"""Rank bodies shared by the save/load tests and the session fixture (spawned by name)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tests._dist import run_each, subtests
from tests.ckpt._model import Built, build, same_bits
from zeroshard.ckpt import load, read_latest, save
from zeroshard.comm import Group

STAGES = (1, 2, 3)


def check_rank(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, w in want.items():
        g = got[k].cpu()
        assert same_bits(g, w), f"{k}: loaded shard differs from the saved one"


def round_trip(root: str, device: str) -> None:
    """On every rank of the default group: `round_trip_body` over that group."""
    round_trip_body(root, device, dist.get_rank(), dist.get_world_size(), Group())


def round_trip_body(root: str, device: str, rank: int, world: int, group: Group | None) -> None:
    """Save stages 1-3, sync and async, load back at the same world size, compare."""

    def body(stage: int, async_save: bool) -> None:
        b = build(world, stage)
        mine = {k: v.to(device, copy=True) for k, v in b.ranks[rank].items()}
        d = Path(root) / f"s{stage}-async{int(async_save)}"
        h10 = save(d, 10, meta=b.meta, tensors=mine, group=group, async_save=async_save)
        if async_save:
            # The snapshot was taken at save(): updating the live tensors now (as the
            # next optimizer step would) must not reach the file being written.
            for t in mine.values():
                t.zero_()
            # The next save waits for the previous one and commits it first.
            again = {k: v.to(device, copy=True) for k, v in b.ranks[rank].items()}
            h11 = save(d, 11, meta=b.meta, tensors=again, group=group, async_save=True)
            assert h10.done
            h11.wait()
        assert h10.wait() == d / "step-10"
        assert read_latest(d) == ("step-11" if async_save else "step-10")
        for step in [10, 11] if async_save else [10]:
            loaded = load(d, rank=rank, world_size=world, step=step, device=device)
            assert loaded.meta.step == step
            assert loaded.meta.with_files(0, {}) == b.meta
            # Every rank gets the buffers (rank 0 stored them).
            buffers = {k: v for k, v in b.ranks[0].items() if k.startswith("buffer.")}
            check_rank(dict(loaded.tensors), {**b.ranks[rank], **buffers})
        if rank == 0:
            names = sorted(p.name for p in d.iterdir())
            want = ["latest", "step-10", "step-11"] if async_save else ["latest", "step-10"]
            assert names == want, names
            write_reference(Path(root) / f"reference-s{stage}.safetensors", b)

    run_each(subtests({"stage": STAGES, "async_save": [False, True]}), body)


def write_reference(path: Path, b: Built) -> None:
    """What the ranks trained, straight from the model and the optimizer state.

    (Rebuilding it in the pytest process could differ in the last bit: another thread count.)
    """
    ref = {f"param.{n}": p.detach() for n, p in b.model.named_parameters()}
    # The model's own state_dict(), tied alias included (cloned: safetensors refuses
    # tensors that share memory).
    ref.update({f"sd.{k}": v.clone() for k, v in b.model.state_dict().items()})
    ref.update({f"buffer.{n}": t for n, t in b.model.named_buffers()})
    for n, st in b.optim_state.items():
        ref.update({f"optim.{k}.{n}": v for k, v in st.items()})
    ref.update(
        {f"flat.{k}": f[: b.meta.group(k.split(".")[0]).layout.numel] for k, f in b.flats.items()}
    )
    save_file({k: v.contiguous() for k, v in ref.items()}, str(path))
