"""`zeroshard-plan` refuses impossible inputs; its GPT presets are examples/gpt.py's shapes;
the activation measurement agrees with a real CPU run and sees activation checkpointing;
the NVLink defaults are the fit of the measured curves."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.engine import ZeroConfig
from zeroshard.engine.planner._activations import default_loss, measure_activations
from zeroshard.engine.planner._cli import main
from zeroshard.engine.planner._cluster import NVLINK_GBPS_FIT, NVLINK_LATENCY_US_FIT
from zeroshard.engine.planner._estimate import estimate
from zeroshard.engine.planner._groups import plan_groups
from zeroshard.engine.planner._presets import PRESETS, PresetModel, build

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tiny", "--world", "6", "--shard-group-size", "4"], "does not divide --world 6"),
        (["gpt-9000", "--world", "2"], "unknown preset 'gpt-9000'"),
        (["tiny", "--world", "0"], "--world must be >= 1"),
        (["tiny", "--world", "2", "--stage", "2", "--offload", "params"], "needs --stage 3"),
        (["tiny", "--world", "2", "--offload-overlap", "backward"], "needs --offload"),
        (
            ["tiny", "--world", "2", "--offload", "optimizer", "--offload-overlap", "delayed"],
            "needs stage 1 or 2",
        ),
        (
            [
                *("tiny", "--world", "2", "--stage", "1", "--offload", "optimizer"),
                *("--offload-overlap", "backward"),
            ],
            "step_in_backward: stage 1 reduces the gradients at the step",
        ),
        (["/nonexistent/config.json", "--world", "2"], "no such config file"),
    ],
)
def test_cli_refuses(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_prints_table_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "tiny",
                "--world",
                "16",
                "--micro-batch",
                "2",
                "--step-ms",
                "10",
                "--memory-limit-gib",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "= projected peak" in out and "tokens/s/GPU" in out and " * stage" in out


def test_gpt_presets_match_examples() -> None:
    gpt = _load("gpt_example", ROOT / "examples" / "gpt.py")
    for name in ("tiny", "1.3b"):
        with torch.device("meta"):
            ref = gpt.GPT(gpt.GPTConfig.preset(name))
        ours = build(name, activation_checkpointing=False)
        assert [(n, p.shape) for n, p in ours.named_parameters()] == [
            (n, p.shape) for n, p in ref.named_parameters()
        ]
    assert PRESETS["7b"].d_model == gpt.PRESETS["7b"].d_model


def test_activation_checkpointing_is_measured() -> None:
    plain = estimate(build("tiny", activation_checkpointing=False), {"stage": 3}, 2, 8, 128)
    ckpt = estimate(build("tiny", activation_checkpointing=True), {"stage": 3}, 2, 8, 128)
    assert ckpt.activations_peak < 0.7 * plain.activations_peak
    assert ckpt.states == plain.states


def test_nvlink_defaults_are_the_fit_of_the_measured_curves() -> None:
    val = _load("plan_validation", ROOT / "benchmarks" / "plan_validation" / "_sections.py")
    link = val.nvlink_fit()
    assert round(link.gbps, 1) == NVLINK_GBPS_FIT
    assert round(link.latency_us, 1) == NVLINK_LATENCY_US_FIT


def test_offload_validation_reads_every_offload_run_it_names() -> None:
    """The generator of docs/scaling.md's offload rows parses docs/benchmarks.md as it is
    (a section it once read was removed and it raised), and the GPU peak it estimates is
    within 5% of each measured one."""
    val = _load("plan_validation", ROOT / "benchmarks" / "plan_validation" / "_sections.py")
    rows = [r for r in val.offload_validation().splitlines() if r.startswith("| offload")]
    assert len(rows) >= 3
    for row in rows:
        est, meas = (float(x) for x in row.split(" | ")[4].split(" (")[0].split(" / "))
        assert est == pytest.approx(meas, rel=0.05), row


def _cpu_profiler_peak(model: torch.nn.Module, idx: torch.Tensor) -> int:
    """Peak bytes allocated by one forward/backward, from torch.profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(idx).backward()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_peak_matches_a_measured_cpu_run(checkpointing: bool) -> None:
    """The meta-device trace agrees with the allocations of a real CPU run within 2%."""
    shape = dataclasses.replace(PRESETS["tiny"], n_layer=2)
    cfg = ZeroConfig(stage=1)
    torch.manual_seed(0)
    real = PresetModel(shape, checkpointing)
    with torch.device("meta"):
        meta = PresetModel(shape, checkpointing)
    for m in (real, meta):
        # Stage 1's gradients land in the grad buffer (a model state): free autograd's.
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    measured = _cpu_profiler_peak(real, torch.randint(0, shape.vocab_size, (2, 64)))
    plan = plan_groups(meta, cfg, 1)
    trace = measure_activations(meta, plan, cfg, 2, 64, default_loss)
    assert abs(trace.peak - measured) <= 0.02 * measured, (trace.peak, measured)


def test_cli_reads_a_hugging_face_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    config.save_pretrained(tmp_path)
    path = str(tmp_path / "config.json")
    assert main([path, "--world", "2"]) == 2
    assert "--seq is needed" in capsys.readouterr().err
    assert main([path, "--world", "2", "--seq", "32", "--activation-checkpointing"]) == 0
    assert "= projected peak" in capsys.readouterr().out
