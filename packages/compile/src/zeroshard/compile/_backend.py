"""The torch.compile backend: run the pipeline on the captured, forward and backward graphs.

CAPTURE passes run on Dynamo's graph, JOINT passes on AOTAutograd's joint graph just
before the min-cut partitioner (which honours their recompute/save tags) splits it:
through inductor's `joint_custom_pre_pass`, or a partition function for `aot_eager`.
The forward and backward graphs then go through the FORWARD / BACKWARD passes and on to
inductor (`compile_fx_inner`) or, for `aot_eager`, run as traced.

[Note: compiling once per machine]
Inductor's FX-graph cache and AOTAutograd's cache let a second process load what a first
one compiled, keyed by the captured graph and inductor's configuration, which includes
the JOINT pass's `uuid()`. On a cache hit AOTAutograd skips the JOINT, FORWARD and
BACKWARD passes, so that uuid must name everything they depend on: the passes' code (the
sources of this package), their order and phases, the budgets, and the process groups
behind the op keys in the graph with this rank's place in each (after `issue_async` the
compiled code names the groups, and its in-place collectives the rank's part) and what
each reduce-scatter divides by.
A pipeline with a pass of the user's own has no such name (its code and state are
unknown): its uuid is None and inductor compiles afresh in every process.

[Note: the backend outlives the model]
torch keeps every backend given to `torch.compile` in a module-level table
(`torch._dynamo.eval_frame.cached_backends`) until `torch._dynamo.reset()`. So the
backend refers to nothing of its model: only the pipeline, the budgets and a `Captures`
counter. What Dynamo compiled (guards, graphs, inductor code) hangs off the forward's
own code object (see `gathered_forward`) and is freed with the `CompiledModel`.

[Note: inductor keeps the passes' order]
The FORWARD and BACKWARD passes order the graph for memory: each gather at its first use,
hoisted only within the prefetch budget, each release just after its buffer's last use.
Inductor's own `reorder_for_peak_memory` then reorders the scheduled kernels by an
estimate of buffer lifetimes that does not follow the in-place collectives (an `empty`
that `all_gather_into_tensor_out` fills), so it may judge hoisting a gather free. With
torchao's fp8 linears it did (one H200, a 24-block gpt): every block's gather, wait,
release and weight casts moved to the start of forward, so the whole model's weights were
gathered at once, the releases counted before the uses, and some 300 small kernels ran at
the host's pace while the GPU idled (docs/fp8.md). So it is off unless `options` turn it
on; the order within what the passes leave free is still inductor's.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx
from torch._functorch import config as functorch_config

from zeroshard.compile._graph import gathers
from zeroshard.compile._ops import divisor_of, group_name, rank_of, replicate_of
from zeroshard.compile._pipeline import PassContext, Phase, Pipeline

INNER_BACKENDS = ("inductor", "aot_eager")
# Inductor options set unless the user's `options` say otherwise (see [Note: inductor
# keeps the passes' order]).
INDUCTOR_DEFAULTS: Mapping[str, Any] = {"reorder_for_peak_memory": False}


@dataclass
class Captures:
    """How many graphs Dynamo handed a backend: the one piece of state the backend
    shares with its model (see [Note: the backend outlives the model])."""

    count: int = 0


def make_backend(
    pipeline: Pipeline,
    inner: str,
    *,
    prefetch_bytes: int,
    persist_bytes: int,
    fuse_bytes: int,
    options: Mapping[str, Any] | None,
    captures: Captures,
) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
    """A Dynamo backend running `pipeline`, then `inner` ("inductor" or "aot_eager")."""
    if inner not in INNER_BACKENDS:
        raise ValueError(f"backend {inner!r} is not supported; use one of {INNER_BACKENDS}")

    def context(phase: Phase) -> PassContext:
        return PassContext(phase, prefetch_bytes, persist_bytes, fuse_bytes)

    def apply(gm: fx.GraphModule, phase: Phase) -> None:
        pipeline.run(gm.graph, context(phase))
        gm.recompile()

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        captures.count += 1
        apply(gm, Phase.CAPTURE)
        # AOTAutograd compiles the backward graph lazily, at the first backward(), after
        # forward's collectives ran: a BACKWARD pass failing there could not fall back.
        # Compiled now, with forward, it fails before any collective, like a capture.
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            return lower(gm, example_inputs)

    def lower(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner_compile(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
                apply(g, Phase.BACKWARD if kwargs.get("is_backward") else Phase.FORWARD)
                return compile_fx_inner(g, inputs, **kwargs)

            patches = {**INDUCTOR_DEFAULTS, **(options or {})}
            if "joint_custom_pre_pass" in patches:
                raise ValueError(
                    "options['joint_custom_pre_pass'] is taken by zeroshard.compile; "
                    "add a JOINT pass to the pipeline instead"
                )
            uuid = _cache_uuid(pipeline, context(Phase.JOINT), gm.graph)
            patches["joint_custom_pre_pass"] = _joint_pass(pipeline, context(Phase.JOINT), uuid)
            return compile_fx(
                gm, example_inputs, inner_compile=inner_compile, config_patches=patches
            )
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch._aot_autograd.utils import make_boxed_func
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def compiler(phase: Phase) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
            def run(g: fx.GraphModule, inputs: Sequence[Any]) -> Any:
                apply(g, phase)
                return make_boxed_func(g.forward)

            return run

        def partition(joint: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
            apply(joint, Phase.JOINT)
            # The min-cut partitioner is the one that honours the recompute tags.
            return min_cut_rematerialization_partition(joint, inputs, **kwargs)

        return aot_autograd(
            fw_compiler=compiler(Phase.FORWARD),
            bw_compiler=compiler(Phase.BACKWARD),
            partition_fn=partition,
        )(gm, example_inputs)

    return backend


def _joint_pass(pipeline: Pipeline, context: PassContext, uuid: str | None) -> Any:
    """The pipeline's JOINT steps as an inductor joint-graph pass, named `uuid` in the
    compile caches (None: not cached; see [Note: compiling once per machine])."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class JointPass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            pipeline.run(graph, context)

        def uuid(self) -> str | None:
            return uuid

    return JointPass()


@functools.cache
def _package_source_hash() -> str:
    """A hash of this package's sources: the code of its passes and ops."""
    hasher = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        hasher.update(path.name.encode())
        hasher.update(path.read_bytes())
    return hasher.hexdigest()


def _cache_uuid(pipeline: Pipeline, context: PassContext, graph: fx.Graph) -> str | None:
    """What the passes' result depends on besides the graph, as one string; None when the
    pipeline has a pass from outside this package (see [Note: compiling once per machine])."""
    package = __name__.rpartition(".")[0]
    if any(getattr(s.fn, "__module__", "").rpartition(".")[0] != package for s in pipeline):
        return None
    steps = [(s.name, sorted(p.value for p in s.phases)) for s in pipeline]
    budgets = (context.prefetch_bytes, context.persist_bytes, context.fuse_bytes)
    keys = sorted({k for k in (n.args[1] for n in gathers(graph)) if isinstance(k, int)})
    groups = [(k, group_name(k), rank_of(k), replicate_of(k), divisor_of(k)) for k in keys]
    return f"zeroshard.compile {_package_source_hash()} {steps} {budgets} {groups}"


def capture_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean Dynamo could not capture the model (not a runtime failure)."""
    from torch._dynamo import exc

    return (exc.TorchDynamoException,)
