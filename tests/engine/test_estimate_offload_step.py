"""The planner's offloaded step ([Note: the offload model] in planner/_step_time.py): the
CPU step priced by its host memory traffic, after backward, beside it under
`step_in_backward()`, or beside the next forward and backward with `delay_param_update`;
the engine's refusals; the command's `--offload-overlap`."""

from __future__ import annotations

from typing import Any

import pytest

from zeroshard.engine import ZeroConfig
from zeroshard.engine.planner._cli import main
from zeroshard.engine.planner._estimate import Estimate, estimate
from zeroshard.engine.planner._presets import build
from zeroshard.engine.planner._step_time import Compute, host_bytes_per_param

RATE = 1e9  # CPU AdamW parameters a second (the tiny model steps in well under 1 ms)


def _estimate(flat: dict[str, Any], step_s: float, *, step_in_backward: bool = False) -> Estimate:
    cfg = {"compute_dtype": "bf16", "offload_optimizer": True, **flat}
    compute = Compute(step_s=step_s, cpu_adam_params_per_s=RATE)
    model = build("tiny", activation_checkpointing=False)
    # One rank: no communication, so the step is compute and the CPU alone.
    return estimate(model, cfg, 1, 1, 16, compute=compute, step_in_backward=step_in_backward)


@pytest.mark.parametrize(
    ("flat", "nbytes"),
    [
        # master and moments read and written 24, a bf16 gradient down and read 4, the
        # fp32 master up 4
        ({"stage": 2, "compute_dtype": "bf16", "offload_optimizer": True}, 32),
        ({"stage": 2, "compute_dtype": "fp32", "offload_optimizer": True}, 36),
        # the bf16 shard written (its lines read first) and read by two gathers: 8
        (
            {
                "stage": 3,
                "compute_dtype": "bf16",
                "offload_optimizer": True,
                "offload_params": True,
            },
            36,
        ),
    ],
)
def test_host_bytes_per_param(flat: dict[str, Any], nbytes: int) -> None:
    assert host_bytes_per_param(ZeroConfig.from_dict(flat)) == nbytes


def test_cpu_step_is_the_host_traffic_at_fused_adamws_bandwidth() -> None:
    e = _estimate({"stage": 2}, 1.0)
    assert e.step is not None and e.step.comm_s == 0
    # Every parameter is offloaded and trainable; shards add at most 16 bytes of
    # alignment padding per parameter tensor.
    moved = e.step.cpu_s * RATE * 28 / 32
    tensors = len(list(build("tiny", activation_checkpointing=False).parameters()))
    assert e.parameters <= moved < e.parameters + 16 * tensors


@pytest.mark.parametrize("cpu_heavier", [True, False])
def test_each_mode_overlaps_what_it_runs_beside(cpu_heavier: bool) -> None:
    cpu = _estimate({"stage": 2}, 1.0).step
    assert cpu is not None
    # A GPU step 10x shorter or longer than the CPU's.
    c = cpu.cpu_s / 10 if cpu_heavier else cpu.cpu_s * 10
    f, b = c / 3, 2 * c / 3  # forward : backward = 1 : 2 without recompute
    serial = _estimate({"stage": 2}, c).step
    in_backward = _estimate({"stage": 2}, c, step_in_backward=True).step
    delayed = _estimate({"stage": 2, "offload_delay_param_update": True}, c).step
    assert serial is not None and in_backward is not None and delayed is not None
    x = cpu.cpu_s
    assert serial.total_s == pytest.approx(f + b + x)
    assert in_backward.total_s == pytest.approx(f + max(b, x))
    assert delayed.total_s == pytest.approx(max(f + b, x))
    for s in (serial, in_backward, delayed):
        assert s.cpu_s == pytest.approx(x)
    assert serial.bound == "cpu optimizer"
    assert in_backward.bound == ("cpu optimizer" if cpu_heavier else "compute")
    assert delayed.bound == ("cpu optimizer" if cpu_heavier else "compute")


@pytest.mark.parametrize(
    ("flat", "why"),
    [
        ({"stage": 2, "offload_optimizer": False}, "it needs offload_optimizer"),
        ({"stage": 1}, "stage 1 reduces the gradients at the step"),
        ({"stage": 2, "compute_dtype": "fp16"}, "fp16 loss scaling"),
        ({"stage": 2, "offload_delay_param_update": True}, "[a-z_.]+ already overlaps"),
    ],
)
def test_step_in_backward_is_refused_where_the_engine_refuses_it(
    flat: dict[str, Any], why: str
) -> None:
    with pytest.raises(ValueError, match=f"step_in_backward: {why}"):
        _estimate(flat, 1.0, step_in_backward=True)


def test_cli_prices_the_overlap_in_the_estimate_and_the_recommendation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["tiny", "--world", "8", "--stage", "2", "--offload", "optimizer"]
    rates = ["--step-ms", "3", "--cpu-adam-params-per-s", "1e8", "--memory-limit-gib", "1"]
    outs = {}
    for overlap in ("none", "backward", "delayed"):
        assert main([*base, *rates, "--offload-overlap", overlap]) == 0
        outs[overlap] = capsys.readouterr().out

    def step_ms(out: str) -> float:
        line = next(x for x in out.splitlines() if x.startswith("step "))
        assert "CPU optimizer" in line
        return float(line.split()[1])

    # The CPU step (5 ms) is longer than the GPU's (3 ms): what it runs beside is hidden.
    assert step_ms(outs["delayed"]) < step_ms(outs["backward"]) < step_ms(outs["none"])
    # Every candidate was estimated, offloaded ones with the overlap where allowed.
    for out in outs.values():
        assert " * stage" in out and "stage 3, shard 8, offload on" in out


@pytest.mark.parametrize("stage", [2, 3])
def test_pinned_host_bytes_follow_offload_pin_memory(stage: int) -> None:
    """offload_pin_memory off: the runtime pins none of offload's buffers, so the plan's
    pinned share is none of its host bytes (which stay the same)."""
    flat = {"stage": stage, "offload_params": stage == 3}
    pinned = _estimate(flat, 1.0)
    pageable = _estimate({**flat, "offload_pin_memory": False}, 1.0)
    assert 0 < pinned.pinned <= pinned.host
    assert pageable.pinned == 0 and pageable.host == pinned.host
