"""The torch.compile backend: run the pipeline on the captured, forward and backward graphs.

CAPTURE passes run on Dynamo's graph, JOINT passes on AOTAutograd's joint graph just
before the min-cut partitioner (which honours their recompute/save tags) splits it:
through inductor's `joint_custom_pre_pass`, or a partition function for `aot_eager`.
The forward and backward graphs then go through the FORWARD / BACKWARD passes and on to
inductor (`compile_fx_inner`) or, for `aot_eager`, run as traced.

[Note: the backend outlives the model]
torch keeps every backend given to `torch.compile` in a module-level table
(`torch._dynamo.eval_frame.cached_backends`) until `torch._dynamo.reset()`. So the
backend refers to nothing of its model: only the pipeline, the budgets and a `Captures`
counter. What Dynamo compiled (guards, graphs, inductor code) hangs off the forward's
own code object (see `gathered_forward`) and is freed with the `CompiledModel`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx
from torch._functorch import config as functorch_config

from zeroshard.compile._pipeline import PassContext, Phase, Pipeline

INNER_BACKENDS = ("inductor", "aot_eager")


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

            patches = dict(options or {})
            if "joint_custom_pre_pass" in patches:
                raise ValueError(
                    "options['joint_custom_pre_pass'] is taken by zeroshard.compile; "
                    "add a JOINT pass to the pipeline instead"
                )
            patches["joint_custom_pre_pass"] = _joint_pass(pipeline, context(Phase.JOINT))
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


def _joint_pass(pipeline: Pipeline, context: PassContext) -> Any:
    """The pipeline's JOINT steps as an inductor joint-graph pass."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class JointPass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            pipeline.run(graph, context)

        def uuid(self) -> None:
            # User passes cannot be hashed: no inductor FX-graph cache for these graphs.
            return None

    return JointPass()


def capture_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean Dynamo could not capture the model (not a runtime failure)."""
    from torch._dynamo import exc

    return (exc.TorchDynamoException,)
