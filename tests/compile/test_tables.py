"""`save_tables`: what forward computes without parameters is saved, not redone per layer.

On a hand-built joint graph: a rotary-like table (cos of positions times a buffer) that
forward broadcasts into an activation twice its size is tagged MUST_SAVE at its base (not
at the view that broadcasts it); a table as large as the activation, values computed from
a parameter and values computed in backward are not tagged.
In training (world 2, real process groups, aot_eager): a two-layer model that computes
rotary cos/sin in forward from a buffer. Without the pass the partitioner recomputes
cos/sin in backward; with it backward computes none and reads the saved table; both match
the single-process reference (losses and final weights) at rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import VOCAB, global_batches, loss_fn, make_optimizer, reference_run

aten = torch.ops.aten
GATHER = torch.ops.zeroshard.gather.default


def _val(node: fx.Node, shape: tuple[int, ...]) -> fx.Node:
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


def test_tables_broadcast_into_activations_are_saved_at_their_base() -> None:
    g = fx.Graph()
    shard = _val(g.placeholder("primals_1"), (24,))
    inv_freq = _val(g.placeholder("primals_2"), (4,))
    grad = _val(g.placeholder("tangents_1"), (2, 6, 4))
    full = _val(g.call_function(GATHER, (shard, 0, 2, torch.float32, torch.float32)), (48,))
    act = _val(g.call_function(aten.view.default, (full, [2, 6, 4])), (2, 6, 4))
    pos = _val(g.call_function(aten.arange.default, (6,)), (6,))
    freqs = _val(
        g.call_function(
            aten.mul.Tensor,
            (
                _val(g.call_function(aten.unsqueeze.default, (pos, 1)), (6, 1)),
                _val(g.call_function(aten.unsqueeze.default, (inv_freq, 0)), (1, 4)),
            ),
        ),
        (6, 4),
    )
    cos = _val(g.call_function(aten.cos.default, (freqs,)), (6, 4))
    table = _val(g.call_function(aten.unsqueeze.default, (cos, 0)), (1, 6, 4))
    out = _val(g.call_function(aten.mul.Tensor, (act, table)), (2, 6, 4))
    big = _val(g.call_function(aten.expand.default, (table, [2, 6, 4])), (2, 6, 4))
    big = _val(g.call_function(aten.sin.default, (big,)), (2, 6, 4))
    out2 = _val(g.call_function(aten.mul.Tensor, (act, big)), (2, 6, 4))
    ones = _val(g.call_function(aten.ones.default, ([1, 6, 4],)), (1, 6, 4))
    back = _val(g.call_function(aten.mul.Tensor, (grad, ones)), (2, 6, 4))
    back = _val(g.call_function(aten.mul.Tensor, (back, table)), (2, 6, 4))
    g.output((out, out2, back))
    zc.save_tables(g, zc.PassContext(zc.Phase.JOINT, 0, 0, 0))
    saved = {n.name for n in g.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_SAVE}
    # Not the broadcast view, the table itself; not `big` (as large as what it scales),
    # not `ones` (used in backward only), not what the parameter computes.
    assert saved == {cos.name}, saved


class RotaryLM(nn.Module):
    """Two layers that each rotate their projection by cos/sin computed in forward from a
    buffer of frequencies, as transformers' rotary embedding does."""

    def __init__(self, d: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, d, 2) / d))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        pos = torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for layer in self.layers:
            h = layer(x)
            half = h.shape[-1] // 2
            rotated = torch.cat([-h[..., half:], h[..., :half]], dim=-1)
            x = x + h * cos + rotated * sin
        return self.head(x)


def _training_case(device: str, save: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = 3
    torch.manual_seed(4)
    base = RotaryLM()
    batches = global_batches(steps, 1, world, 2)
    ref_losses, _, ref_state = reference_run(base, make_optimizer, batches, None)
    model = copy.deepcopy(base).to(device)
    model, opt = zs.initialize(model, make_optimizer(model), {"stage": 3, "min_unit_params": 1})
    backward_ops: list[object] = []

    def record(graph: fx.Graph, context: zc.PassContext) -> None:
        backward_ops.extend(n.target for n in graph.nodes)

    pipeline = zc.default_pipeline()
    pipeline = pipeline if save else pipeline.without("save_tables")
    pipeline = pipeline.append(record, {zc.Phase.BACKWARD})
    compiled = zc.compile(model, backend="aot_eager", pipeline=pipeline)
    losses = []
    for step in range(steps):
        loss = loss_fn(compiled, batches[step, 0, rank].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    assert not compiled.eager and compiled.compiles == 1
    recomputed = {aten.cos.default, aten.sin.default} & set(backward_ops)
    assert bool(recomputed) != save, (save, recomputed)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    full = zs.full_state_dict(model)
    for name, ref in ref_state.items():
        torch.testing.assert_close(full[name].cpu(), ref, rtol=1e-5, atol=1e-6, msg=name)


def _training_cases(device: str) -> None:
    run_each([{"save": True}, {"save": False}], lambda save: _training_case(device, save))


@pytest.mark.gpu
def test_training_saves_the_rotary_table_and_matches_the_reference(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_training_cases, 2, device, device=device)
