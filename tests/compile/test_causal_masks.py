"""`drop_causal_masks`: attention with a constant causal mask becomes `is_causal=True`.

On Dynamo's graphs (one process): a causal mask built in the graph from constants (bool
from `tril`, float -inf from `triu`, indices compared as transformers does, passed by
keyword or position) is dropped and the call gets `is_causal=True`; the compiled function
matches eager at rtol 1e-5 / atol 1e-6. Left alone: a mask that depends on an input
(padding), constant masks that are not causal (sliding window, nothing masked, not
square) and a causal-valued mask drawn from random numbers. transformers' Llama, compiled
whole with the mask it builds before torch 2.14 (emulated here: see `_old_torch_masks`),
loses every mask; with a padding mask it keeps them.

Training (world 2, real process groups, aot_eager): a model that builds its causal mask
in the graph, and transformers' Llama with its pre-2.14 mask, compiled with the pass and
without it: both match the single-process reference (losses and final weights) at
rtol 1e-5 / atol 1e-6 (Llama's weights at atol 5e-5, as in the HF parity tests), with
one capture, and the pass removed every mask.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import VOCAB, global_batches, loss_fn, make_optimizer, reference_run

SDPA = F.scaled_dot_product_attention
CAPTURE = zc.PassContext(zc.Phase.CAPTURE, 0, 0, 0)
B, H, T, E = 2, 3, 6, 4


def _masks(graph: fx.Graph) -> list[bool]:
    """For each attention call in `graph`: whether it is given a mask."""
    calls = [n for n in graph.nodes if n.target is SDPA]
    return [
        (n.kwargs.get("attn_mask") if len(n.args) < 4 else n.args[3]) is not None for n in calls
    ]


def _compile_with_pass(fn: Callable[..., torch.Tensor], *args: Any) -> tuple[list[bool], Any]:
    """`fn(*args)` compiled by a backend running `drop_causal_masks` on Dynamo's graph: which
    attention calls still have a mask afterwards, and the compiled result."""
    after: list[bool] = []

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        zc.drop_causal_masks(gm.graph, CAPTURE)
        gm.graph.lint()
        gm.recompile()
        after.extend(_masks(gm.graph))
        calls = [n for n in gm.graph.nodes if n.target is SDPA]
        for call, masked in zip(calls, after, strict=True):
            assert masked or call.kwargs["is_causal"] is True
        return gm

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return after, out


def causal_bool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return SDPA(q, k, v, attn_mask=mask.expand(B, 1, T, T))


def causal_float_positional(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    mask = torch.full((T, T), -math.inf, device=q.device).triu(1)
    return SDPA(q, k, v, mask, 0.0)


def causal_from_indices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # As transformers' sdpa_mask builds it: key index <= query index.
    rows = torch.arange(T, device=q.device)[None, None, :, None]
    cols = torch.arange(T, device=q.device)[None, None, None, :]
    mask = (cols <= rows).expand(B, -1, T, T)
    return SDPA(q, k, v, attn_mask=mask, scale=0.3)


def padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return SDPA(q, k, v, attn_mask=causal & keep[:, None, None, :])


def sliding_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ones = torch.ones(T, T, dtype=torch.bool, device=q.device)
    return SDPA(q, k, v, attn_mask=ones.tril() & ones.triu(-2))


def nothing_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return SDPA(q, k, v, attn_mask=torch.ones(T, T, dtype=torch.bool, device=q.device))


def longer_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    k, v = torch.cat([k, k[:, :, :2]], dim=2), torch.cat([v, v[:, :, :2]], dim=2)
    mask = torch.ones(T, T + 2, dtype=torch.bool, device=q.device).tril()
    return SDPA(q, k, v, attn_mask=mask)


def random_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Causal in value, but drawn from random numbers: not provably the same every call.
    mask = (torch.rand(T, T, device=q.device) < 2).tril()
    return SDPA(q, k, v, attn_mask=mask)


def _qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, E, generator=g) for _ in range(3)]


@pytest.mark.parametrize("fn", [causal_bool, causal_float_positional, causal_from_indices])
def test_constant_causal_masks_are_dropped(fn: Callable[..., torch.Tensor]) -> None:
    qkv = _qkv()
    masks, out = _compile_with_pass(fn, *qkv)
    assert masks == [False]
    torch.testing.assert_close(out, fn(*qkv), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "fn", [sliding_window, nothing_masked, longer_keys, random_causal], ids=lambda f: f.__name__
)
def test_other_constant_masks_stay(fn: Callable[..., torch.Tensor]) -> None:
    qkv = _qkv()
    masks, out = _compile_with_pass(fn, *qkv)
    assert masks == [True]
    if fn is not random_causal:
        torch.testing.assert_close(out, fn(*qkv), rtol=1e-5, atol=1e-6)


def test_a_mask_depending_on_an_input_stays() -> None:
    qkv = _qkv()
    keep = torch.tensor([[True] * T, [False] * 2 + [True] * (T - 2)])
    masks, out = _compile_with_pass(padded, *qkv, keep)
    assert masks == [True]
    # Rows with no key left give NaN in both.
    torch.testing.assert_close(out, padded(*qkv, keep), rtol=1e-5, atol=1e-6, equal_nan=True)


@contextlib.contextmanager
def _old_torch_masks() -> Iterator[None]:
    """transformers as it runs under torch < 2.14 (the GPU machines' 2.11), on this torch:
    before pytorch#176499 Dynamo read `torch.compiler.is_exporting()` as True, so
    transformers' `_ignore_causal_mask_sdpa` never skips the causal mask under
    torch.compile and builds it in the graph. This is the check transformers makes."""
    import transformers.masking_utils as masking

    if not hasattr(masking, "is_torchdynamo_exporting"):
        # transformers before that check (the GPU image's) never skips the mask while
        # compiling: its behaviour is the one emulated.
        yield
        return
    saved = masking.is_torchdynamo_exporting
    masking.is_torchdynamo_exporting = lambda: True
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting = saved


def _tiny_llama(seed: int = 0) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def test_transformers_llama_masks_dropped_unless_padded() -> None:
    pytest.importorskip("transformers")
    model = _tiny_llama()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(B, T, dtype=torch.long)
    keep[1, :2] = 0
    with _old_torch_masks(), torch.no_grad():
        masks, logits = _compile_with_pass(lambda x: model(input_ids=x).logits, ids)
        assert masks == [False, False]
        torch.testing.assert_close(logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        masks, _ = _compile_with_pass(
            lambda x, m: model(input_ids=x, attention_mask=m).logits, ids, keep
        )
        assert masks == [True, True]


class MaskedAttentionLM(nn.Module):
    """Embedding, one attention block that builds its causal mask in the graph, a head."""

    def __init__(self, d: int = 12, heads: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(VOCAB, d)
        # No bias: softmax ignores a key bias, whose zero gradient AdamW would turn into
        # steps of noise.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, d = x.shape
        q, k, v = (
            y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for y in self.qkv(x).chunk(3, dim=-1)
        )
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        y = SDPA(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)
        return self.head(x + self.out(y))


class _HFLogits(nn.Module):
    """transformers' causal LM called as `model(idx) -> logits`, as `loss_fn` calls it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=idx).logits
        return logits


def _training_case(device: str, arch: str, drop: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = 3
    if arch == "llama":
        base: nn.Module = _HFLogits(_tiny_llama(seed=2))
        weight_atol = 5e-5
    else:
        torch.manual_seed(2)
        base, weight_atol = MaskedAttentionLM(), 1e-6
    batches = global_batches(steps, 1, world, 2)
    ref_losses, _, ref_state = reference_run(base, make_optimizer, batches, None)
    model = copy.deepcopy(base).to(device)
    model, opt = zs.initialize(model, make_optimizer(model), {"stage": 3, "min_unit_params": 1})
    seen: list[bool] = []

    def record(graph: fx.Graph, context: zc.PassContext) -> None:
        seen.extend(_masks(graph))

    pipeline = zc.default_pipeline()
    pipeline = pipeline if drop else pipeline.without("drop_causal_masks")
    compiled = zc.compile(
        model, backend="aot_eager", pipeline=pipeline.append(record, {zc.Phase.CAPTURE})
    )
    losses = []
    with _old_torch_masks() if arch == "llama" else contextlib.nullcontext():
        for step in range(steps):
            loss = loss_fn(compiled, batches[step, 0, rank].to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().reshape(1)
            dist.all_reduce(total)
            losses.append(float(total) / world)
    assert not compiled.eager and compiled.compiles == 1
    assert seen and all(masked != drop for masked in seen), seen
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    full = zs.full_state_dict(model)
    for name, ref in ref_state.items():
        torch.testing.assert_close(full[name].cpu(), ref, rtol=1e-5, atol=weight_atol, msg=name)


def _training_cases(device: str) -> None:
    cases = [{"arch": arch, "drop": drop} for arch in ("masked", "llama") for drop in (True, False)]
    run_each(cases, lambda arch, drop: _training_case(device, arch, drop))


@pytest.mark.gpu
def test_training_with_and_without_the_pass_matches_the_reference(device: str) -> None:
    pytest.importorskip("transformers")
    world_fits(device, 2)
    run_ranks(_training_cases, 2, device, device=device)
