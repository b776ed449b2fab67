"""benchmarks/train_step's `floorr` engines: every block of the benchmark's three models
(smoke sizes, fp32, CPU) as a `torch.compiler.nested_compile_region`, the model compiled
whole (aot_eager, fullgraph) beside an eager copy with the same weights and batch.

The compiled model must give the eager loss and gradients (to float rounding), Dynamo
must install one region body for all blocks (inductor then compiles it once), a fresh
model of the same class must keep plain blocks, and the schema memo of `floorr-memo`
must give the same and put torch's own method back afterwards. What the memo is for is
shown too: without it torch re-traces a region (`gen_schema`) at every block's call, with
it as often as for one block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks._common._models import MODELS, bench_model
from benchmarks.train_step._torch_engines import mark_block_regions, memoized_region_schemas


def _loss_and_grads(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    loss = model(x, y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches empty before and after: the models' forwards are other tests' too."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("memo", [False, True], ids=["regions", "memo"])
@pytest.mark.parametrize("name", MODELS)
def test_block_regions_compile_one_body_and_keep_the_gradients(name: str, memo: bool) -> None:
    if name == "hf-llama":
        pytest.importorskip("transformers")
    bm = bench_model(name, "1.3b", smoke=True, seq_len=16, activation_checkpointing=False)
    torch.manual_seed(0)
    model: Any = bm.build()
    reference: Any = bm.build()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, bm.vocab_size, (2, bm.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    bodies: list[int] = []

    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Any:
        # The regions' bodies are the graph's submodules (one per distinct body).
        bodies.append(sum(1 for n, _ in gm.named_children() if "subgraph" in n))
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example)

    mark_block_regions(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    original = _gen_schema()
    if memo:
        with memoized_region_schemas():
            assert _gen_schema() is not original
            loss, grads = _loss_and_grads(compiled, x, y)
    else:
        loss, grads = _loss_and_grads(compiled, x, y)
    assert _gen_schema() is original
    ref_loss, ref_grads = _loss_and_grads(reference, x, y)

    assert len(model.blocks) >= 2 and bodies == [1], bodies
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # Only this model's blocks became regions.
    fresh: Any = bm.build()
    assert type(fresh.blocks[0]) is type(reference.blocks[0])
    assert type(model.blocks[0]) is not type(fresh.blocks[0])


def _gen_schema() -> Any:
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    return InvokeSubgraphHOP.gen_schema


def test_torch_retraces_a_region_per_call_unless_memoized(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    real: Any = InvokeSubgraphHOP.gen_schema
    calls = [0]

    def counting(self: Any, *args: Any) -> Any:
        calls[0] += 1
        return real(self, *args)

    # Installed first, so that the memo wraps the counter and counts what reaches torch.
    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counting)
    bm = bench_model("llama", "1.3b", smoke=True, seq_len=16, activation_checkpointing=False)
    x = torch.randint(0, bm.vocab_size, (2, bm.seq_len))
    traced: dict[bool, int] = {}
    for memo in (False, True):
        torch._dynamo.reset()
        calls[0] = 0
        model: Any = bm.build()
        mark_block_regions(model)
        compiled: Any = torch.compile(model, backend="aot_eager", fullgraph=True)
        with memoized_region_schemas() if memo else contextlib.nullcontext():
            compiled(x, x).backward()
        traced[memo] = calls[0]
    blocks = len(model.blocks)
    assert blocks >= 2 and traced[True] > 0, traced
    assert traced[False] == blocks * traced[True], traced
