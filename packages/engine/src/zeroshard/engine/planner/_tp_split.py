"""What tensor parallelism splits of a model, as `zeroshard-plan --tp` prices it, and the
collectives the split adds to each micro-batch.

The split is Megatron-LM's (torchtitan's plan; a Hugging Face model's own `tp_plan`):
the embedding by vocabulary, attention's q/k/v (or qkv) and the MLP's up/gate colwise,
their output projections rowwise, the head colwise with its output gathered; norms and
rowwise biases stay whole on every tensor-parallel rank. `localize` gives a meta
model's split parameters their local shapes, from which `_tensor_parallel.py` plans
zeroshard over the data-parallel ranks.

[Note: tensor-parallel collectives]
Priced as Megatron-LM issues them (torchtitan's plan does the same): one collective per
region, a region being the colwise layers that read one input (attention's q, k, v; the
MLP's gate and up) or one rowwise layer. Without sequence parallelism a colwise region
all-reduces its input's gradient in backward, a rowwise layer all-reduces its output in
forward. With it the activations between regions are split along the sequence: a
colwise region all-gathers its input in forward and reduce-scatters its gradient in
backward, a rowwise layer reduce-scatters its output in forward and all-gathers its
gradient in backward, and each norm's weight gradient (`Partial` over tp) is all-reduced
once per backward. Sizes are the full activation, [micro-batch, seq, width], in the
compute dtype; times are the cluster model's ring collectives over N consecutive GPUs.
They are on the step's critical path (torch's eager TP waits for each).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.engine.planner._cluster import Cluster
from zeroshard.engine.planner._step_time import TensorParallelTime

COLWISE, ROWWISE, EMBEDDING, GATHERED = "colwise", "rowwise", "embedding", "colwise, gathered"
# The presets' (and examples/') modules, by name: gpt and llama alike.
PRESET_PLAN = {
    "tok_emb": EMBEDDING,
    "blocks.*.attn.qkv": COLWISE,
    "blocks.*.attn.q": COLWISE,
    "blocks.*.attn.k": COLWISE,
    "blocks.*.attn.v": COLWISE,
    "blocks.*.attn.kv": COLWISE,
    "blocks.*.attn.proj": ROWWISE,
    "blocks.*.mlp.gate": COLWISE,
    "blocks.*.mlp.fc": COLWISE,
    "blocks.*.mlp.up": COLWISE,
    "blocks.*.mlp.proj": ROWWISE,
    "head": GATHERED,
}
# Hugging Face's `tp_plan` styles, as priced here.
HF_STYLES = {
    "colwise": COLWISE,
    "rowwise": ROWWISE,
    "embedding_rowwise": EMBEDDING,
    "colwise_gather_output": GATHERED,
}


@dataclass(frozen=True)
class Collective:
    """One tensor-parallel collective of a micro-batch (see [Note: tensor-parallel
    collectives]): where, when, which, how many times per micro-batch and its size."""

    layer: str
    phase: str  # forward / backward
    op: str  # all-reduce / all-gather / reduce-scatter
    count: int
    nbytes: int  # each one's full tensor

    def seconds(self, cluster: Cluster, tp: int) -> float:
        """The ring time of all `count` of them over `tp` consecutive GPUs."""
        time = {
            "all-reduce": cluster.all_reduce_s,
            "all-gather": cluster.all_gather_s,
            "reduce-scatter": cluster.reduce_scatter_s,
        }[self.op]
        return self.count * time(self.nbytes, tp)


def split_styles(model: nn.Module) -> dict[str, str]:
    """Module path -> how the plan splits it: the model's own `tp_plan` (Hugging Face), or
    the presets' names."""
    rules = getattr(model, "tp_plan", None)
    plan = (
        {k: HF_STYLES[v] for k, v in rules.items() if v in HF_STYLES}
        if isinstance(rules, Mapping)
        else PRESET_PLAN
    )
    patterns = [
        (re.compile(k.replace(".", r"\.").replace("*", r"\d+")), v) for k, v in plan.items()
    ]
    out = {}
    for name, _ in model.named_modules():
        style = next((v for p, v in patterns if p.fullmatch(name)), None)
        if style is not None:
            out[name] = style
    return out


def _split_dim(style: str, param: str, ndim: int) -> int | None:
    """The dim a parameter of a module split by `style` is cut along (None: whole)."""
    if style == ROWWISE:
        return 1 if param == "weight" and ndim == 2 else None
    return 0  # colwise weight and bias, the embedding's vocabulary


def localize(model: nn.Module, styles: Mapping[str, str], tp: int) -> dict[int, nn.Parameter]:
    """Give `model`'s (meta) split parameters their local shapes, in place: id of each
    split parameter -> its piece. ValueError where tp does not divide a split dim."""
    modules = dict(model.named_modules())
    local: dict[int, nn.Parameter] = {}
    for path, style in styles.items():
        module = modules[path]
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in local:  # a tied parameter: cut once
                setattr(module, name, local[id(p)])
                continue
            dim = _split_dim(style, name, p.dim())
            if dim is None:
                continue
            if p.shape[dim] % tp:
                raise ValueError(
                    f"--tp {tp} does not divide {path}.{name}'s dim {dim} ({p.shape[dim]})"
                )
            shape = list(p.shape)
            shape[dim] //= tp
            new = nn.Parameter(torch.empty(shape, device="meta", dtype=p.dtype), p.requires_grad)
            local[id(p)] = new
            setattr(module, name, new)
    return local


def _width(module: nn.Module, which: str) -> int:
    """A layer's input or output width (a Linear's features, an Embedding's dim)."""
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    features = getattr(module, f"{which}_features", None)
    if not isinstance(features, int):
        raise ValueError(f"cannot price tensor parallelism of a {type(module).__name__}")
    return features


def collectives(
    model: nn.Module, styles: Mapping[str, str], tokens: int, itemsize: int, sp: bool
) -> tuple[Collective, ...]:
    """The collectives of one micro-batch of `tokens` tokens (see [Note: tensor-parallel
    collectives]), per kind of layer (`blocks.*` for every block alike)."""
    modules = dict(model.named_modules())
    counts: dict[tuple[str, str, str, int], int] = {}

    def add(layer: str, phase: str, op: str, width: int, rows: int = tokens) -> None:
        key = (re.sub(r"\.\d+\.", ".*.", layer), phase, op, rows * width * itemsize)
        counts[key] = counts.get(key, 0) + 1

    regions: dict[str, int] = {}  # colwise layers reading one input: one per parent
    for path, style in styles.items():
        module = modules[path]
        if style in (COLWISE, GATHERED):
            parent = path.rpartition(".")[0] if style == COLWISE else path
            regions.setdefault(parent, _width(module, "in"))
            if style == GATHERED:
                add(path, "forward", "all-gather", _width(module, "out"))
        elif style in (ROWWISE, EMBEDDING):
            width = _width(module, "out")
            add(path, "forward", "reduce-scatter" if sp else "all-reduce", width)
            if sp:
                add(path, "backward", "all-gather", width)
    for parent, width in regions.items():
        if sp:
            add(parent, "forward", "all-gather", width)
        add(parent, "backward", "reduce-scatter" if sp else "all-reduce", width)
    if sp:
        for name, module in modules.items():
            if isinstance(module, nn.LayerNorm | nn.RMSNorm):
                for p in module.parameters(recurse=False):
                    add(name, "backward", "all-reduce", p.numel(), rows=1)
    return tuple(
        Collective(layer, phase, op, n, size) for (layer, phase, op, size), n in counts.items()
    )


def tensor_parallel_time(
    ops: Sequence[Collective], cluster: Cluster, tp: int
) -> TensorParallelTime:
    """The seconds and count of a micro-batch's tensor-parallel collectives `ops`, forward
    and backward."""
    phases = {phase: [c for c in ops if c.phase == phase] for phase in ("forward", "backward")}
    seconds = {k: sum(c.seconds(cluster, tp) for c in v) for k, v in phases.items()}
    counts = {k: sum(c.count for c in v) for k, v in phases.items()}
    return TensorParallelTime(
        tp, seconds["forward"], seconds["backward"], counts["forward"], counts["backward"]
    )
