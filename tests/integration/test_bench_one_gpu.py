"""benchmarks/train_step's one-GPU pieces: the `floor32` engine against plain PyTorch, the
alternating order and the median of rounds, the goals tables of issues 25 and 73 (the
optimizer offloaded) and which engines a run times by default."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks._common import LR
from benchmarks.train_step.__main__ import round_order
from benchmarks.train_step._engines import ENGINES, default_engines
from benchmarks.train_step._goals import one_gpu_goals
from benchmarks.train_step._offload_goals import offload_goals
from benchmarks.train_step._result import Result
from benchmarks.train_step._run import combine
from benchmarks.train_step._settings import Settings
from benchmarks.train_step._torch_engines import setup_floor32
from examples import gpt

CFG = gpt.GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, seq_len=16)


def _settings(dtype: torch.dtype, clip: float = 0.0) -> Settings:
    return Settings(torch.device("cpu"), dtype, clip, 2, {})


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_floor32_in_fp32_is_plain_adamw(clip: float) -> None:
    """With an fp32 compute dtype the masters ARE the weights: three steps of floor32 must
    give bit for bit what plain AdamW on the model gives (tied head included)."""
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=(0.9, 0.95))
    step = setup_floor32(model, _settings(torch.float32, clip))
    x, y = _data()
    for _ in range(3):
        step(x, y)
        reference(x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        assert p.grad is None, f"{name}: gradient left after the step"


def test_floor32_in_bf16_steps_fp32_masters() -> None:
    """In bf16 the weights are the bf16 image of fp32 masters that AdamW steps with the
    bf16 gradients in fp32: the same as a hand-written reference, step for step."""
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    masters = copy.deepcopy(model)
    low = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(masters.parameters(), lr=LR, betas=(0.9, 0.95))
    step = setup_floor32(model, _settings(torch.bfloat16))
    x, y = _data()
    for _ in range(2):
        step(x, y)
        low(x, y).backward()
        for m, p in zip(masters.parameters(), low.parameters(), strict=True):
            assert p.grad is not None
            m.grad = p.grad.float()
        low.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(masters.parameters(), low.parameters(), strict=True):
                p.copy_(m)
    for (name, p), q in zip(model.named_parameters(), low.parameters(), strict=True):
        assert p.dtype == torch.bfloat16, name
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    # The same seed's initial weights: the steps moved them (not all: a step of lr 1e-4 is
    # below bf16's resolution on the norms' ones, which only the fp32 masters keep).
    torch.manual_seed(0)
    before = gpt.GPT(CFG).to(torch.bfloat16)
    pairs = zip(model.parameters(), before.parameters(), strict=True)
    assert sum(not torch.equal(p, q) for p, q in pairs) >= len(list(before.parameters())) // 2


def test_rounds_alternate_and_deepspeed_stays_last() -> None:
    names = ["floor", "floor32", "zs3", "ds3"]
    assert round_order(names, 0) == ["floor", "floor32", "zs3", "ds3"]
    assert round_order(names, 1) == ["zs3", "floor32", "floor", "ds3"]
    assert round_order(names, 2) == round_order(names, 0)
    assert ENGINES["ds3"].runs_last


def test_combine_takes_the_median_round_and_the_largest_peak() -> None:
    rounds = [
        Result("zs3", "w", 0.1, 300.0, 40.0, build_s=1.0),
        Result("zs3", "w", 0.3, 280.0, 41.0, build_s=1.0),
        Result("zs3", "w", 0.2, 290.0, 39.0, build_s=1.0),
    ]
    r = combine(rounds)
    assert (r.step_ms, r.init_s, r.peak_gib) == (290.0, 0.2, 41.0)
    assert r.rounds_ms == (300.0, 280.0, 290.0)
    failed = Result("zs3", "w", error="OOM")
    assert combine([rounds[0], failed]) is failed


def _goal_rows(by: dict[str, Result]) -> dict[str, tuple[str, ...]]:
    """The goals table's rows: goal -> (figure, target, status, at the floor)."""
    table = "\n".join(one_gpu_goals(by, []))
    return {
        cells[0]: tuple(cells[1:])
        for line in table.splitlines()
        if line.startswith("| ")
        and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 5
    }


def test_goals_say_not_measured_never_met_without_figures() -> None:
    rows = _goal_rows(
        {
            "floor32": Result("floor32", "w", 0.0, 100.0, 30.0),
            "zs3": Result("zs3", "w", 0.0, 100.5, 29.0),
            "zs2": Result("zs2", "w", 0.0, 110.0, 31.0),
            "fsdp2": Result("fsdp2", "w", 0.0, 104.0, 29.0),
            "fsdp2c": Result("fsdp2c", "w", error="OOM"),
        }
    )
    assert rows["2. `zs3` speed / `floor32`"][2] == "met"  # 100 / 100.5 = 0.995
    assert rows["2. `zs2` speed / `floor32`"][2] == "MISSED"  # 0.909
    assert rows["5. `zs3` peak / `floor32`'s"][2] == "met"
    assert rows["1. `floor32` measured"][:3] == ("yes", "yes", "met")
    # Asked for and failed: missed.
    assert rows["1. `fsdp2c` measured"][:3] == ("no (failed)", "yes", "MISSED")
    # zs3c was not asked for: not measured.
    for goal in ("3. `zs3c` speed / `floorc`", "4. `zs3c` cold compile, s"):
        assert rows[goal][2] == "not measured", goal
    # floor32 is 1.04x fsdp2: even an engine at the floor would miss ">= 1.05".
    assert rows["2. `zs3` speed / `fsdp2`"] == ("1.035", ">= 1.05", "MISSED", "1.040")
    assert rows["3. `zs3c` speed / `fsdp2c`"][3] == "-"  # neither ran


def test_goals_need_a_zeroshard_engine() -> None:
    """The floors alone meet or miss no goal; one zeroshard engine brings the table, with
    the engines not asked for as not measured (not missed)."""
    floors = {
        name: Result(name, "w", 0.0, ms, 30.0)
        for name, ms in (("floorc", 100.0), ("floorw", 98.0), ("floorr", 99.0))
    }
    assert one_gpu_goals(floors, []) == []
    rows = _goal_rows({**floors, "zs3c": Result("zs3c", "w", 0.0, 101.0, 29.0)})
    assert rows["3. `zs3c` speed / `floorc`"][:3] == ("0.990", ">= 0.98", "met")
    assert rows["1. `floor32` measured"][:3] == ("not run", "yes", "not measured")


def _rows(lines: list[str], columns: int) -> dict[str, tuple[str, ...]]:
    """A report's table rows of `columns` cells: first cell -> the others."""
    return {
        cells[0]: tuple(cells[1:])
        for line in "\n".join(lines).splitlines()
        if line.startswith("| ")
        and len(cells := [c.strip() for c in line.strip("|").split("|")]) == columns
    }


def test_offload_engines_beside_their_twins_and_the_compiled_goal() -> None:
    """Each offload engine against its twin on the device from the run's figures; the
    compiled offload goal from `zs3c-off` and `zs3-off`, "not measured" where one failed,
    and no table without an offload engine."""
    every = {
        "zs3": Result("zs3", "w", 0.0, 400.0, 70.0, states_gib=10.0),
        "zs3-off": Result("zs3-off", "w", 0.0, 500.0, 60.0, states_gib=3.0),
        "zs3c-off": Result("zs3c-off", "w", 0.0, 480.0, 58.0, states_gib=3.0),
        "zs2-off": Result("zs2-off", "w", error="OOM"),
    }
    lines = offload_goals(every)
    rows = _rows(lines, 7)
    assert rows["`zs3-off`"] == (
        "`zs3`",
        "500.0 / 400.0",
        "0.800",
        "60.0 / 70.0",
        "3.0 / 10.0",
        "ok",
    )
    assert rows["`zs3c-off`"][-1] == "`zs3c` not run"
    assert rows["`zs2-off`"][-1] == "FAILED: OOM"
    assert _rows(lines, 4)["`zs3c-off` speed / `zs3-off`"] == ("1.042", ">= 1", "met")
    every["zs3-off"] = Result("zs3-off", "w", error="OOM")
    goal = _rows(offload_goals(every), 4)["`zs3c-off` speed / `zs3-off`"]
    assert goal == ("-", ">= 1", "not measured")
    assert offload_goals({"zs3": every["zs3"]}) == []
    # Run only when named: a default run times none of them.
    assert not {"zs2-off", "zs3-off", "zs3c-off"} & set(default_engines())


def test_compile_time_floors_run_only_when_named() -> None:
    """A run without --engines leaves out the diagnostic floors (each a minute's cold
    compile on a GPU) and keeps every other importable engine."""
    names = default_engines()
    assert not {"floorw", "floorr", "floorr-memo"} & set(names)
    assert {"floor", "floor32", "floorc", "fsdp2", "fsdp2c", "zs3", "zs3c"} <= set(names)
    assert all(ENGINES[n].on_request for n in set(ENGINES) - set(names) if ENGINES[n].available())
