"""The registry of engines that benchmarks/train_step times: one `Engine` line each.

To add an engine, write its setup (`(model, Settings) -> Stepper`, see `_settings.py`) in
the module of its family (`_torch_engines.py`, `_zeroshard_engines.py`,
`_deepspeed_engines.py`) and add its `Engine` to `ENGINES` below; `--engines`, the
report, the JSON and the plots take it from here.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from benchmarks.train_step import _torch_engines as tch
from benchmarks.train_step._deepspeed_engines import setup_ds
from benchmarks.train_step._float8 import in_float8
from benchmarks.train_step._settings import Settings, Stepper
from benchmarks.train_step._tensor_parallel_engines import (
    setup_fsdp2tp,
    setup_zs3ctp,
    setup_zs3m,
    setup_zs3tp,
)
from benchmarks.train_step._zeroshard_engines import (
    setup_zs,
    setup_zs3_noted,
    setup_zs3b,
    setup_zs3c,
)


@dataclass(frozen=True)
class Engine:
    """A name, a one-line description, a setup function and whether it can be imported.

    `what` may name `{shard}` and `{replicate}`: the hybrid group sizes of the run, and
    `{tp}`: its `--tp`.
    """

    name: str
    what: str
    setup: Callable[[nn.Module, Settings], Stepper]
    available: Callable[[], bool]
    # A floor: one device, no communication; runs alone on rank 0 while the others wait.
    rank0_only: bool = False
    # Its blocks run compiled: its floor is `floorc` (inductor's kernels), not `floor`.
    compiled: bool = False
    # Runs after every other engine: importing and initializing DeepSpeed sets process-wide
    # state (its accelerator, logging, hooks), which must not touch the engines timed before.
    runs_last: bool = False
    # Runs only where `--engines` names it: a diagnostic whose cold compile alone takes
    # about a minute on a GPU, of no use to a run that compares the engines' steps; or an
    # fp8 engine, which a run asks for with its floors.
    on_request: bool = False
    # Its blocks' linears train in fp8 (torchao, `--fp8`): its floor is `floor8`/`floorc8`.
    fp8: bool = False
    # Splits the model over `--tp` consecutive ranks: each GPU computes 1/tp of the tokens.
    tensor_parallel: bool = False

    @property
    def floor(self) -> str:
        """The floor this engine's gap is measured against."""
        return ("floorc" if self.compiled else "floor") + ("8" if self.fp8 else "")


def _has(module: str, attr: str | None = None) -> Callable[[], bool]:
    """Whether `module` can be found (and, if `attr`, imported and has it)."""

    def check() -> bool:
        try:
            if importlib.util.find_spec(module) is None:
                return False
            return attr is None or hasattr(importlib.import_module(module), attr)
        except Exception:  # a broken install is "not available"
            return False

    return check


def _always() -> bool:
    return True


def _zs(
    stage: int, hybrid: bool = False, offload: bool = False
) -> Callable[[nn.Module, Settings], Stepper]:
    return lambda m, s: setup_zs(m, s, stage, hybrid, offload)


def _zs3c(
    fuse_downcast: bool, name: str, offload: bool = False
) -> Callable[[nn.Module, Settings], Stepper]:
    return lambda m, s: setup_zs3c(m, s, fuse_downcast, name, offload)


def _zs3(name: str) -> Callable[[nn.Module, Settings], Stepper]:
    return lambda m, s: setup_zs3_noted(m, s, name)


def _ds(stage: int) -> Callable[[nn.Module, Settings], Stepper]:
    return lambda m, s: setup_ds(m, s, stage)


_ZEROSHARD = _has("zeroshard.engine", "initialize")
_COMPILE = _has("zeroshard.compile", "compile")
_TORCHAO = _has("torchao.float8", "convert_to_float8_training")


def _both(*checks: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: all(check() for check in checks)


# Finds deepspeed without importing it (see `runs_last`).
_DEEPSPEED = _has("deepspeed")

# The flags of the fp8 engines: floors run alone, compiled ones against `floorc8`, and
# none runs unless named (a run asks for them with their floors).
_FP8: dict[str, bool] = {"fp8": True, "on_request": True}
_FP8C: dict[str, bool] = {**_FP8, "compiled": True}
_FLOOR: dict[str, bool] = {**_FP8, "rank0_only": True}
_FLOORC: dict[str, bool] = {**_FLOOR, "compiled": True}

ENGINES: dict[str, Engine] = {
    e.name: e
    for e in [
        Engine(
            "floor",
            "1 device, no communication, model in the compute dtype",
            tch.setup_floor,
            _always,
            rank0_only=True,
        ),
        Engine(
            "floor32",
            "1 device, no communication, compute-dtype weights, fp32 masters stepped by AdamW",
            tch.setup_floor32,
            _always,
            rank0_only=True,
        ),
        Engine(
            "floor32-adamw",
            "floor32 stepped by AdamW alone (in a --optimizer muon run: Muon's cost)",
            tch.setup_floor32_adamw,
            _always,
            rank0_only=True,
            on_request=True,
        ),
        Engine(
            "floorc",
            "the floor with every block torch.compile'd",
            tch.setup_floorc,
            _always,
            rank0_only=True,
            compiled=True,
        ),
        Engine(
            "floor32c",
            "`floor32` with every block torch.compile'd (zs3c's like-for-like floor)",
            tch.setup_floor32c,
            _always,
            rank0_only=True,
            compiled=True,
            on_request=True,
        ),
        # Compile-time peers of zs3c's one graph (see their setups): the floor compiled
        # whole, with its blocks as regions, and with torch's per-call region re-trace
        # memoized.
        *(
            Engine(name, what, setup, _always, rank0_only=True, compiled=True, on_request=True)
            for name, what, setup in (
                ("floorw", "the floor compiled whole", tch.setup_floorw),
                ("floorr", "floorw, blocks as nested_compile_regions", tch.setup_floorr),
                (
                    "floorr-memo",
                    "floorr, torch's region schema memoized (diagnostic patch)",
                    tch.setup_floorr_memo,
                ),
            )
        ),
        Engine("ddp", "torch DDP + autocast", tch.setup_ddp, _always),
        Engine("fsdp2", "FSDP2 fully_shard per block (ZeRO-3)", tch.setup_fsdp2, _always),
        Engine("fsdp2-zero2", "FSDP2, reshard_after_forward=False", tch.setup_fsdp2_zero2, _always),
        *(Engine(f"zs{k}", f"zeroshard stage {k}", _zs(k), _ZEROSHARD) for k in (1, 2, 3)),
        *(
            Engine(f"ds{k}", f"DeepSpeed ZeRO stage {k}", _ds(k), _DEEPSPEED, runs_last=True)
            for k in (1, 2, 3)
        ),
        *(
            Engine(
                f"zs{k}h",
                f"zeroshard stage {k}, hybrid: shard within {{shard}}, replicate across "
                "{replicate}",
                _zs(k, hybrid=True),
                _ZEROSHARD,
            )
            for k in (2, 3)
        ),
        Engine(
            "fsdp2h",
            "FSDP2 HSDP: shard within {shard}, replicate across {replicate}",
            tch.setup_fsdp2_hybrid,
            _always,
        ),
        # zeroshard.compile: compiled stage 3 and its peer, FSDP2 with compiled blocks.
        *(
            Engine(name, what, _zs3c(fuse_downcast, name), _COMPILE, compiled=True)
            for name, what, fuse_downcast in (
                ("zs3c", "zeroshard stage 3, compiled (zeroshard.compile, inductor)", True),
                ("zs3c-nofuse", "zs3c without the fused downcast (fp32 gathers, then cast)", False),
            )
        ),
        # The optimizer offloaded to the CPU (`offload_optimizer`), eager and compiled, run
        # only when named: beside `zs2`/`zs3` (AdamW or Muon) they show what the device
        # keeps and what the step costs, `zs3c-off` against `zs3-off` what compiling gives.
        *(
            Engine(
                f"zs{k}-off",
                f"zeroshard stage {k}, the optimizer offloaded to the CPU (offload_optimizer)",
                _zs(k, offload=True),
                _ZEROSHARD,
                on_request=True,
            )
            for k in (2, 3)
        ),
        Engine(
            "zs3c-off",
            "`zs3c` with the optimizer offloaded to the CPU (offload_optimizer)",
            _zs3c(True, "zs3c-off", offload=True),
            _COMPILE,
            compiled=True,
            on_request=True,
        ),
        Engine(
            "zs3b",
            "zeroshard stage 3, each block's forward torch.compile'd (hooks eager, as fsdp2c)",
            setup_zs3b,
            _ZEROSHARD,
            compiled=True,
        ),
        # Tensor parallelism (`--tp`) under each sharder; at --tp 1 zs3tp is zs3 through
        # initialize(device_mesh=...) with DTensor layers, zs3m without them.
        Engine(
            "zs3m",
            "zeroshard stage 3 through device_mesh (dp = world, tp 1), the model not split",
            setup_zs3m,
            _ZEROSHARD,
            on_request=True,
        ),
        Engine(
            "zs3tp",
            "zeroshard stage 3 over dp, the model split over tp {tp} (device_mesh)",
            setup_zs3tp,
            _ZEROSHARD,
            on_request=True,
            tensor_parallel=True,
        ),
        Engine(
            "zs3ctp",
            "`zs3tp` compiled (zeroshard.compile, inductor), the model split over tp {tp}",
            setup_zs3ctp,
            _COMPILE,
            compiled=True,
            on_request=True,
            tensor_parallel=True,
        ),
        Engine(
            "fsdp2tp",
            "FSDP2 fully_shard per block over dp, the model split over tp {tp}",
            setup_fsdp2tp,
            _always,
            on_request=True,
            tensor_parallel=True,
        ),
        Engine(
            "fsdp2c",
            "FSDP2 per block (ZeRO-3), each block torch.compile'd",
            tch.setup_fsdp2c,
            _always,
            compiled=True,
        ),
        # fp8 (`_float8.py`): the blocks' linears by torchao's `--fp8` recipe; "-fp8g"
        # gathers those weights in fp8 too (enable_fsdp_float8_all_gather).
        *(
            Engine(name, what, in_float8(setup, gather), _both(available, _TORCHAO), **flags)
            for name, what, setup, gather, available, flags in (
                ("floor8", "`floor`, blocks in fp8", tch.setup_floor, False, _always, _FLOOR),
                ("floorc8", "`floorc`, blocks in fp8", tch.setup_floorc, False, _always, _FLOORC),
                (
                    "floor32c8",
                    "`floor32c`, blocks in fp8",
                    tch.setup_floor32c,
                    False,
                    _always,
                    _FLOORC,
                ),
                ("zs3-fp8", "`zs3`, blocks in fp8", _zs3("zs3-fp8"), False, _ZEROSHARD, _FP8),
                (
                    "zs3-fp8g",
                    "`zs3`, blocks in fp8, their weights gathered in fp8",
                    _zs3("zs3-fp8g"),
                    True,
                    _ZEROSHARD,
                    _FP8,
                ),
                (
                    "zs3c-fp8",
                    "`zs3c`, blocks in fp8",
                    _zs3c(True, "zs3c-fp8"),
                    False,
                    _COMPILE,
                    _FP8C,
                ),
                (
                    "zs3c-fp8g",
                    "`zs3c`, blocks in fp8, their weights gathered in fp8",
                    _zs3c(True, "zs3c-fp8g"),
                    True,
                    _COMPILE,
                    _FP8C,
                ),
                ("fsdp2-fp8", "`fsdp2`, blocks in fp8", tch.setup_fsdp2, False, _always, _FP8),
                (
                    "fsdp2-fp8g",
                    "`fsdp2`, blocks in fp8, FSDP2's fp8 all-gather",
                    tch.setup_fsdp2_fp8_gather,
                    True,
                    _always,
                    _FP8,
                ),
                ("fsdp2c-fp8", "`fsdp2c`, blocks in fp8", tch.setup_fsdp2c, False, _always, _FP8C),
                (
                    "fsdp2c-fp8g",
                    "`fsdp2c`, blocks in fp8, FSDP2's fp8 all-gather",
                    tch.setup_fsdp2c_fp8_gather,
                    True,
                    _always,
                    _FP8C,
                ),
            )
        ),
    ]
}


def default_engines() -> list[str]:
    """What a run without `--engines` times: every engine that can be imported, but those
    run only on request."""
    return [n for n, e in ENGINES.items() if e.available() and not e.on_request]
