"""zeroshard.compile: a zeroshard stage-3 model as one torch.compile graph.

import zeroshard.compile as zc
model, optimizer = zeroshard.engine.initialize(model, optimizer, {"stage": 3})
compiled = zc.compile(model)             # or backend="aot_eager", pipeline=..., budgets
loss = compiled(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from zeroshard.compile._async import issue_async
from zeroshard.compile._attention import drop_causal_masks
from zeroshard.compile._compile import CompiledModel, compile
from zeroshard.compile._passes import (
    default_pipeline,
    free_early,
    fuse_downcast,
    gather_at_first_use,
    insert_releases,
    mark_recompute,
    prefetch,
)
from zeroshard.compile._pipeline import PASSES_KEY, GraphPass, PassContext, Phase, Pipeline, Step
from zeroshard.compile._tables import save_tables

__all__ = [
    "PASSES_KEY",
    "CompiledModel",
    "GraphPass",
    "PassContext",
    "Phase",
    "Pipeline",
    "Step",
    "compile",
    "default_pipeline",
    "drop_causal_masks",
    "free_early",
    "fuse_downcast",
    "gather_at_first_use",
    "insert_releases",
    "issue_async",
    "mark_recompute",
    "prefetch",
    "save_tables",
]
