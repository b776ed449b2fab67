"""`zeroshard-plan --tp N`: what tensor parallelism splits on each rank and the
collectives of a micro-batch, for the `tiny` GPT preset (vocab 256, d 256, 4 blocks, MLP
1024, seq 128, tied head), counted by hand below; the model states against a real
engine are checked in test_tensor_parallel_state.

Against engines on 4 gloo ranks (`test_planned_pairs_match_the_engine`): torch's Muon
recipe under tp (its momentum per rank, offloaded or not) and a 3-D mesh
(`--shard-group-size` with `--tp`): the planned device states and host bytes per rank
are the engine's after a step, to the byte, and each term of Muon's step scratch (the
bf16 update, the owner buffers and those coming back, the matrices joined whole over
tp) is the largest the engine's step allocated on any rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine import _tp
from tests.engine._models import muon_and_adamw
from tests.engine.test_tensor_parallel import engine_config
from tests.engine.test_tensor_parallel_compositions import _dp, _mesh
from tests.engine.test_whole_params_compositions import factored_and_adamw
from zeroshard.ckpt import buffer_key
from zeroshard.comm._group import Handle
from zeroshard.comm._inflight import _held
from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._cli import main
from zeroshard.engine.planner._cluster import Cluster, Link
from zeroshard.engine.planner._presets import build
from zeroshard.engine.planner._step_time import Compute
from zeroshard.engine.planner._tensor_parallel import (
    plan_tensor_parallel,
)
from zeroshard.engine.recovery._contents import rank_contents
from zeroshard.engine.recovery._store import OWN
from zeroshard.engine.runtime._tensor_parallel import TensorParallel
from zeroshard.engine.runtime.whole._exchange import MatrixExchange
from zeroshard.engine.runtime.whole._muon import MuonStep

# Split over tp: the (tied) embedding 256 x 256 and, per block, qkv (768 x 256 + 768),
# the attention projection's weight (256 x 256), fc (1024 x 256 + 1024), the MLP
# projection's weight (256 x 1024). Whole on every rank: the positions (128 x 256), per
# block two LayerNorms (2 x 512) and two projection biases (2 x 256), the last LayerNorm.
SPLIT = 256 * 256 + 4 * (768 * 256 + 768 + 256 * 256 + 1024 * 256 + 1024 + 256 * 1024)
WHOLE = 128 * 256 + 4 * (2 * 512 + 2 * 256) + 512


@pytest.mark.parametrize("sp", [False, True])
def test_tiny_preset_split_and_collectives(sp: bool) -> None:
    cfg = ZeroConfig.from_dict({"stage": 3, "compute_dtype": "bf16"})
    plan = plan_tensor_parallel(
        build("tiny", activation_checkpointing=False),
        cfg,
        world_size=8,
        tp=2,
        micro_batch=2,
        seq_len=128,
        sequence_parallel=sp,
        cluster=Cluster(),
    )
    assert (plan.split, plan.per_rank, plan.parameters) == (
        SPLIT,
        SPLIT // 2 + WHOLE,
        SPLIT + WHOLE,
    )
    assert plan.dp == 4
    # 4 bytes of fp32 master per element a rank holds, sharded over dp 4, and the flat
    # groups' alignment padding (8 bf16 elements a slot at most).
    assert plan.per_rank <= plan.states["master"] < plan.per_rank + 4096
    ops = {(c.layer, c.phase, c.op): (c.count, c.nbytes) for c in plan.collectives}
    activation = 2 * 128 * 256 * 2  # [micro-batch, seq, d] in bf16
    if not sp:
        # Per block: the two rowwise outputs all-reduced in forward, the two colwise
        # inputs' gradients in backward; the embedding's output; the head's gathered
        # logits and its input's gradient.
        assert ops == {
            ("tok_emb", "forward", "all-reduce"): (1, activation),
            ("blocks.*.attn.proj", "forward", "all-reduce"): (4, activation),
            ("blocks.*.mlp.proj", "forward", "all-reduce"): (4, activation),
            ("blocks.*.attn", "backward", "all-reduce"): (4, activation),
            ("blocks.*.mlp", "backward", "all-reduce"): (4, activation),
            ("head", "forward", "all-gather"): (1, 2 * 128 * 256 * 2),
            ("head", "backward", "all-reduce"): (1, activation),
        }
        return
    assert ops[("blocks.*.attn", "forward", "all-gather")] == (4, activation)
    assert ops[("blocks.*.attn", "backward", "reduce-scatter")] == (4, activation)
    assert ops[("blocks.*.mlp.proj", "forward", "reduce-scatter")] == (4, activation)
    assert ops[("blocks.*.mlp.proj", "backward", "all-gather")] == (4, activation)
    # Each LayerNorm's weight and bias gradients (Partial over tp), 256 bf16 each.
    assert ops[("blocks.*.ln1", "backward", "all-reduce")] == (8, 256 * 2)
    assert sum(c.count for c in plan.collectives) == 4 * 12 + 2 + 3 + 2
    assert plan.tp_seconds > 0


@pytest.mark.parametrize("recompute", [False, True])
def test_tp_step_is_its_share_of_the_compute_and_its_collectives(recompute: bool) -> None:
    """[Note: the step under tensor parallelism]: with no data parallelism (world = tp)
    zeroshard's collectives cost nothing and the step is 1/tp of the one-GPU compute plus
    the tp collectives, the forward's twice under activation checkpointing."""
    cfg = ZeroConfig.from_dict({"stage": 3, "compute_dtype": "bf16"})
    compute = Compute(step_s=0.1, recompute=recompute)
    plan = plan_tensor_parallel(
        build("tiny", activation_checkpointing=recompute),
        cfg,
        world_size=2,
        tp=2,
        micro_batch=2,
        seq_len=128,
        sequence_parallel=False,
        cluster=Cluster(),
        compute=compute,
    )
    forward = sum(c.seconds(plan.cluster, 2) for c in plan.collectives if c.phase == "forward")
    assert plan.step is not None and plan.step.compute_s == pytest.approx(0.05)
    again = forward if recompute else 0.0
    assert plan.tp_step_s == pytest.approx(plan.tp_seconds + again)
    assert plan.step.total_s == pytest.approx(0.05 + plan.tp_seconds + again)
    assert plan.tokens_per_s_per_gpu == pytest.approx(2 * 128 / 2 / plan.step.total_s)


def test_tp_steps_dp_collectives_on_the_link_they_span() -> None:
    """The data-parallel ranks are tp apart: at tp 8 on nodes of 8 GPUs the flat groups'
    collectives cross nodes (the inter-node link prices them), at tp 4 on 8 GPUs not."""
    cfg = ZeroConfig.from_dict({"stage": 3, "compute_dtype": "bf16"})

    def step(world: int, tp: int, gbps: float) -> float:
        plan = plan_tensor_parallel(
            build("tiny", activation_checkpointing=False),
            cfg,
            world_size=world,
            tp=tp,
            micro_batch=2,
            seq_len=128,
            sequence_parallel=False,
            cluster=Cluster(internode=Link(gbps, 5.0)),
            compute=Compute(step_s=1e-4),
        )
        assert plan.step is not None
        return plan.step.total_s

    assert step(16, 8, 1.0) > step(16, 8, 50.0)
    assert step(8, 4, 1.0) == step(8, 4, 50.0)


def test_cli_prints_the_split_and_refuses_what_it_cannot_price(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["tiny", "--world", "4", "--tp", "2", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "tp 2, sequence parallel x dp 2" in out and "tensor-parallel collectives" in out
    # Offload under tensor parallelism: each rank's host holds its pieces' share.
    assert main(["tiny", "--world", "4", "--tp", "2", "--stage", "3", "--offload", "params"]) == 0
    out = capsys.readouterr().out
    assert "offload optimizer + params" in out and "| host (offload), of it pinned |" in out
    # Muon under tp, offloaded too, the 3-D mesh and the fp8 gather; the projected step.
    for argv, shown in [
        (["--step-ms", "100"], "(compute 50: 1/2 of one GPU's; communication"),
        (["--step-ms", "100", "--shard-group-size", "2"], "tokens/s/GPU"),
        (["--optimizer", "muon"], "| whole-matrix step scratch (in a step; matrices joined"),
        (["--optimizer", "muon", "--offload", "optimizer"], "| host (offload), of it pinned |"),
        (["--shard-group-size", "2"], "tp 2 x dp_shard 1 x dp_replicate 2, stage 3"),
        # Snapshots of each rank's pieces (their bytes against the engine's below).
        (["--snapshots", "64"], "snapshots in host memory per rank"),
        # The fp8 gather of the split weights' pieces (tests/engine/test_float8_tensor_parallel).
        (["--fp8", "tensorwise", "--fp8-all-gather"], "tp 2 x dp 2, stage 3"),
    ]:
        assert main(["tiny", "--world", "4", "--tp", "2", *argv]) == 0
        assert shown in capsys.readouterr().out, argv
    for argv, why in [
        (["--tp", "3"], "--tp 3 does not divide --world 4"),
        (["--sequence-parallel"], "--sequence-parallel needs --tp above 1"),
        (["--tp", "2", "--memory-limit-gib", "8"], "activations are not traced"),
        (["--tp", "4", "--shard-group-size", "2"], "a replica of the 3-D mesh is dp_shard x tp"),
    ]:
        assert main(["tiny", "--world", "4", *argv]) == 2
        assert why in capsys.readouterr().err


def held_bytes(run: Callable[[], Any]) -> tuple[Any, int]:
    """`run()`'s result and the most bytes it held at once beyond what was alive when it
    began, by the CPU allocator's own reports (torch.profiler's memory events), taken at
    the end of each outermost operator: a CPU bf16 matmul's scratch within the operator,
    which a GPU's cuBLAS does not allocate, left out."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        out = run()
    assert prof.profiler is not None
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ends, last = [], -1
    for start, end in sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() != "[memory]"
    ):
        if start >= last:
            ends.append(end)
            last = end
    peak = live = i = 0
    for end in [*ends, float("inf")]:
        while i < len(memory) and memory[i][0] <= end:
            live += memory[i][1]
            i += 1
        peak = max(peak, live)
    return out, peak


class Allocated:
    """The sizes of what Muon's step allocates on this rank, recorded by wrapping the
    engine's own functions (they run unchanged): the largest bf16 update, the owner
    buffers and the buffers coming back (summed over a step), the largest set of
    matrices joined whole over tp in one call, and the most one orthogonalization of a
    group's matrices held at once (`held_bytes`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.update = self.buffers = self.joined = self.orthogonalize = 0
        real_orthogonalized = MuonStep._orthogonalized
        real_wait = Handle.wait

        def wait(handle: Handle) -> None:
            # gloo's worker thread now and then lets go of a collective's tensors after
            # the caller has ([Note: gloo at interpreter exit]), freeing them on a thread
            # the profiler does not follow: wait here until it has, so that the caller's
            # free is the one seen (NCCL's wait releases them likewise).
            work = handle._work
            aliases = [a for a, w, _ in tuple(_held.values()) if work is not None and w() is work]
            del work
            real_wait(handle)
            deadline = time.monotonic() + 30
            while any(a() is not None for a in aliases):
                assert time.monotonic() < deadline, "gloo did not let go of a collective"
                time.sleep(0.001)

        monkeypatch.setattr(Handle, "wait", wait)

        def orthogonalized(*args: Any) -> Any:
            out, peak = held_bytes(lambda: real_orthogonalized(*args))
            self.orthogonalize = max(self.orthogonalize, peak)
            return out

        monkeypatch.setattr(MuonStep, "_orthogonalized", orthogonalized)

        def spy(cls: type, name: str, record: Callable[[Any], None]) -> None:
            real = getattr(cls, name)

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = real(*args, **kwargs)
                record(out)
                return out

            monkeypatch.setattr(cls, name, wrapped)

        def update(out: torch.Tensor) -> None:
            self.update = max(self.update, out.nbytes)

        def buffer(out: tuple[torch.Tensor, Any]) -> None:
            self.buffers += out[0].nbytes

        def joined(out: list[torch.Tensor]) -> None:
            self.joined = max(self.joined, sum(t.nbytes for t in out))

        spy(MuonStep, "_update", update)
        spy(MatrixExchange, "to_owners", buffer)
        spy(MatrixExchange, "from_owners", buffer)
        spy(TensorParallel, "whole_tensors", joined)

    def largest(self) -> tuple[int, int, int, int]:
        """Each figure's largest over the ranks."""
        t = torch.tensor([self.update, self.buffers, self.joined, self.orthogonalize])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t[0]), int(t[1]), int(t[2]), int(t[3])


def _pair(
    shape: tuple[int, ...],
    stage: int,
    muon: bool,
    offload: dict[str, Any],
    folder: str,
    declared: bool = False,
) -> None:
    mesh = _mesh(shape)
    # Small offload chunks: the host's staging buffers stay small.
    config = {**engine_config(stage, "fp32"), "offload_chunk_bytes": 1024, **offload}
    replica = shape[-2] * shape[-1]

    def optimizers(m: Any) -> list[torch.optim.Optimizer]:
        if declared:
            return factored_and_adamw(m)
        return muon_and_adamw(m) if muon else [_tp.make_optimizer(m)]

    plan = _tp.plan(
        zs.ZeroConfig.from_dict(config),
        sp=False,
        tp=shape[-1],
        optimizers=optimizers,
        shard_group_size=None if len(shape) == 2 else replica,
    )
    model, _ = _tp.split_model(mesh, sp=False, seed=1)
    opts = optimizers(model)
    with pytest.MonkeyPatch.context() as patch:
        allocated = Allocated(patch)
        model, opt = zs.initialize(model, opts, config, device_mesh=mesh)
        data = _tp.batches(1, 1, _dp(mesh)[0])
        _tp.loss_fn(model, data[0, 0, _dp(mesh)[1]]).backward()
        opt.step()
        opt.zero_grad()
    state = zs.engine_state(model)
    host = state.offload
    on_host = [g for g in state.groups if host is not None and host.holds(g)]
    on_device = [g for g in state.groups if g not in on_host]

    def held(groups: list[Any]) -> int:
        return sum(t.nbytes for g in groups for t in opt.state[g.master].values() if t.dim())

    # A declared optimizer's state: the whole matrices' at their owners (each tp rank of
    # an owner holds it whole), on the device or on the host; planned as the busiest rank's.
    owned = torch.zeros(2, dtype=torch.int64)
    whole = state.whole_params
    for name, p in ({} if whole is None else whole.owned).items():
        assert whole is not None
        kept = sum(
            t.numel() * t.element_size()
            for t in opt.state[p].values()
            if isinstance(t, torch.Tensor) and t.dim()
        )
        owned[int(name in whole.on_host)] += kept
    mine = int(owned.sum())
    dist.all_reduce(owned, op=dist.ReduceOp.MAX)
    if declared:
        assert int(owned[0]) > 0 and int(owned[1]) > 0, owned
    assert plan.states["master"] == sum(g.master.nbytes for g in on_device), plan.states
    device_state = held(on_device) + int(owned[0])
    assert plan.states["optimizer"] == device_state, (plan.states, device_state)
    if host is not None:
        # On the CPU nothing is pinned; the same buffers are allocated pageable.
        assert plan.host == host.nbytes().host + held(on_host) + int(owned[1]), plan.host
        assert plan.states["offload_compute"] == host.nbytes().device, plan.states
    else:
        assert plan.host == 0
    # A snapshot's file: its tensors (the planned bytes, less the optimizers' scalar step
    # counts), the module buffers, its header and alignment.
    snaps = zs.Snapshots(model, opt, every=1, root=folder)
    try:
        snaps.take(1)
        snaps.wait()
        _, tensors, _ = rank_contents(model, state, 1, None, None)
        planned = sum(
            t.nbytes for k, t in tensors.items() if t.dim() and not k.startswith(buffer_key(""))
        )
        # With the busiest owners' whole-parameter state in place of this rank's own.
        busiest = planned + int(owned.sum()) - mine
        assert plan.snapshot == busiest, (plan.snapshot, busiest)
        size = snaps.store.path(1, dist.get_rank(), 4, OWN).stat().st_size
        assert planned < size < planned + 64 * 1024, (planned, size)
    finally:
        snaps.close()
    w = plan.whole_matrix
    if not (muon or declared):
        assert w is None
        return
    assert w is not None and w.joined_bytes > 0
    planned = (w.update_bytes, w.buffer_bytes, w.joined_bytes, w.orthogonalize_bytes)
    measured = allocated.largest()
    assert planned == measured, (planned, measured)


PAIRS: list[dict[str, Any]] = [
    # Muon under tp: its momentum per rank, each matrix joined at its owners.
    {"shape": (2, 2), "stage": 2, "muon": True, "offload": {}},
    # Muon offloaded under tp, part of it (the momentum on the host).
    {
        "shape": (2, 2),
        "stage": 3,
        "muon": True,
        "offload": {"offload_optimizer": True, "offload_params": True, "offload_ratio": 0.5},
    },
    # A declared whole-matrix optimizer under tp, part of it offloaded: its state the
    # whole matrices' (Adafactor's row and column of each: r + c floats of the whole
    # r x c, not of a piece), on the host for the offloaded groups; its gradients and
    # masters joined whole over tp at the owners.
    {
        "shape": (2, 2),
        "stage": 2,
        "muon": False,
        "declared": True,
        "offload": {"offload_optimizer": True, "offload_ratio": 0.5},
    },
    # The 3-D mesh, (dp_replicate, dp_shard, tp) = (2, 1, 2): --shard-group-size 2.
    {"shape": (2, 1, 2), "stage": 3, "muon": False, "offload": {"offload_optimizer": True}},
    {"shape": (2, 1, 2), "stage": 2, "muon": True, "offload": {}},
]


def _pairs(folder: str) -> None:
    run_each([{**p, "folder": f"{folder}/{i}"} for i, p in enumerate(PAIRS)], _pair)


def test_planned_pairs_match_the_engine(tmp_path: Path) -> None:
    run_ranks(_pairs, 4, str(tmp_path))
