"""On 2 ranks: warnings and INFO logs appear once, on rank 0, pointing at the user's line;
a warning about a per-rank condition appears on each rank that meets it, naming the rank.

Captured per rank: the unfused-optimizer warning of `initialize` (offload), the flatten
INFO log of `zeroshard.partition`, compile's fallback warning (a model with data-dependent
control flow, at its first call), and the pageable-memory warning of offload (pinning
fails without CUDA).
"""

from __future__ import annotations

import inspect
import logging
import warnings

import torch
import torch.distributed as dist

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.compile.test_compiled import Branchy
from tests.engine._models import make_model
from zeroshard.engine.runtime.offload._io import host_tensor


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _line() -> int:
    """The caller's line number."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def _ours(caught: list[warnings.WarningMessage], text: str) -> list[warnings.WarningMessage]:
    return [w for w in caught if text in str(w.message)]


def _ranks() -> None:
    rank = dist.get_rank()
    records = _Records()
    partition_log = logging.getLogger("zeroshard.partition")
    partition_log.addHandler(records)
    partition_log.setLevel(logging.INFO)

    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    config = {"stage": 2, "offload_optimizer": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line() + 1
        zs.initialize(model, opt, config)
    unfused = _ours(caught, "fused=True")
    flattened = [m for m in records.messages if m.startswith("flattened")]
    if rank == 0:
        assert len(unfused) == 1, [str(w.message) for w in caught]
        assert (unfused[0].filename, unfused[0].lineno) == (__file__, line), unfused[0]
        assert flattened, records.messages
    else:
        assert unfused == [], [str(w.message) for w in unfused]
        assert flattened == [], flattened

    torch.manual_seed(0)
    branchy = Branchy()
    config = {"stage": 3, "min_unit_params": 1}
    model, _ = zs.initialize(branchy, torch.optim.SGD(branchy.parameters(), lr=0.1), config)
    compiled = zc.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line() + 1
        compiled(torch.randn(3, 6))
    fallback = _ours(caught, "zeroshard.compile: cannot capture")
    if rank == 0:
        assert len(fallback) == 1, [str(w.message) for w in caught]
        assert (fallback[0].filename, fallback[0].lineno) == (__file__, line), fallback[0]
    else:
        assert fallback == [], [str(w.message) for w in fallback]

    if not torch.cuda.is_available():  # pinning fails: every rank says so, naming itself
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = _line() + 1
            host_tensor(8, torch.float32, pin=True)
        pageable = _ours(caught, "pageable")
        assert len(pageable) == 1, [str(w.message) for w in caught]
        assert str(pageable[0].message).startswith(f"[rank {rank}] ")
        assert (pageable[0].filename, pageable[0].lineno) == (__file__, line), pageable[0]


def test_warnings_and_info_logs_once_on_rank0_at_the_users_line() -> None:
    run_ranks(_ranks, 2)


def test_loggers_have_public_names() -> None:
    """Every `logging.getLogger` in the packages names a public logger (`zeroshard.partition`,
    not `zeroshard.partition._flatten`): a literal, no component private, so a user's
    `logging.getLogger("zeroshard.partition").setLevel(...)` reaches every record."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "packages"
    found, wrong = 0, []
    for path in sorted(src.glob("*/src/zeroshard/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node if isinstance(node, ast.Call) else None
            if call is None or not (
                isinstance(call.func, ast.Attribute) and call.func.attr == "getLogger"
            ):
                continue
            found += 1
            arg = call.args[0] if call.args else None
            name = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg or call)
            parts = str(name).split(".")
            if (
                not isinstance(name, str)
                or parts[0] != "zeroshard"
                or any(p.startswith("_") for p in parts)
            ):
                wrong.append(f"{path.relative_to(src)}:{call.lineno}: getLogger({name})")
    assert found >= 5, found
    assert not wrong, wrong
