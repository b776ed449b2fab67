"""`zeroshard-plan` refuses impossible inputs; its GPT presets are examples/gpt.py's shapes;
the activation measurement agrees with a real CPU run and sees activation checkpointing;
the NVLink defaults are the fit of the measured curves."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.engine import ZeroConfig
from zeroshard.engine.planner import _cli as cli
from zeroshard.engine.planner._activations import GradPath, default_loss, trace_operators
from zeroshard.engine.planner._arguments import parser as _parser
from zeroshard.engine.planner._cli import main
from zeroshard.engine.planner._cluster import NVLINK_GBPS_FIT, NVLINK_LATENCY_US_FIT
from zeroshard.engine.planner._estimate import estimate, estimate_on_trace, trace_micro_batch
from zeroshard.engine.planner._groups import plan_groups
from zeroshard.engine.planner._presets import PRESETS, PresetModel, build
from zeroshard.engine.planner._whole import muon_recipe

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
        (["1.3b", "--world", "1", "--snapshots", "24"], "snapshots do not fit in host memory"),
        # 29.4 GiB of full snapshots fit, with 5 journal entries of 4.9 GiB no more.
        (
            ["1.3b", "--world", "1", "--snapshots", "40", "--full-every", "5"],
            "smaller --full-every",
        ),
        (
            ["tiny", "--world", "2", "--full-every", "2"],
            "--full-every takes K >= 1 with --snapshots",
        ),
        (["tiny", "--world", "2", "--snapshots", "0"], "--snapshots takes the host memory"),
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
        (["tiny", "--world", "2", "--achieved-tflops", "100"], "needs --flops-per-token"),
        (["tiny", "--world", "2", "--flops-per-token", "1e9"], "needs --achieved-tflops"),
        (
            [
                *("tiny", "--world", "2", "--step-ms", "5"),
                *("--achieved-tflops", "100", "--flops-per-token", "1e9"),
            ],
            "not both",
        ),
        (["/some/config.json", "--world", "2", "--layers", "2"], "--layers takes"),
        (
            [
                *("tiny", "--world", "2", "--optimizer", "muon", "--offload", "optimizer"),
                *("--step-ms", "5", "--cpu-adam-params-per-s", "5e9"),
            ],
            "--optimizer muon with --offload prices memory only: drop --step-ms",
        ),
        (
            [
                *("tiny", "--world", "2", "--master-dtype", "bf16", "--offload", "optimizer"),
                *("--step-ms", "5", "--cpu-adam-params-per-s", "5e9"),
            ],
            "--master-dtype bf16 with --offload prices memory only: drop --step-ms",
        ),
        (
            ["tiny", "--world", "2", "--master-dtype", "bf16", "--dtype", "fp16"],
            "masters are fp32, or bf16 with bf16 compute",
        ),
        # What initialize refuses of a pair, refused as it would (docs/config.md's table).
        (
            [
                *("tiny", "--world", "4", "--tp", "2", "--stage", "1", "--offload", "optimizer"),
                *("--offload-overlap", "backward"),
            ],
            "step_in_backward: stage 1 reduces the gradients at the step",
        ),
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
                "--snapshots",
                "64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "= projected peak" in out and "tokens/s/GPU" in out and " * stage" in out
    assert "snapshots in host memory per rank" in out and "of its 64 GiB" in out


def test_without_compute_figures_the_recommendation_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Speed not priced: the mark goes to the least overhead that fits (here stage 2
    without offload, not the smallest peak, which offload gives), and a line says so."""
    argv = ["tiny", "--world", "16", "--micro-batch", "2", "--memory-limit-gib", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    best = [ln for ln in out.splitlines() if ln.startswith(" * ")]
    assert len(best) == 1 and best[0].startswith(" * stage 2, shard 16, offload off"), out
    assert "   * speed not priced (no --step-ms, nor --achieved-tflops with" in out


def test_muon_prices_its_state_and_its_step() -> None:
    """Muon's matrices keep 4 bytes of state per element (AdamW 8), and its step adds the
    exchange with the owners and, given FLOP/s, the busiest rank's Newton-Schulz."""
    model = build("tiny", activation_checkpointing=False)
    compute = cli.Compute(flops_per_step=1e12, flops_per_s=1e14)
    plans = {
        kind: estimate(
            model,
            {"stage": 3, "compute_dtype": "bf16"},
            4,
            1,
            64,
            compute=compute,
            optimizer=None if kind == "adamw" else muon_recipe(model),
        )
        for kind in ("adamw", "muon")
    }
    adamw, muon = plans["adamw"], plans["muon"]
    assert adamw.whole_matrix is None and muon.whole_matrix is not None
    w = muon.whole_matrix
    matrices = sum(math.prod(m.shape) for m in w.owners.matrices)
    # 4 bytes less per element of the matrices, a quarter of them per rank (plus padding).
    saved = adamw.states["optimizer"] - muon.states["optimizer"]
    assert matrices <= saved <= matrices * 1.01, (saved, matrices)
    assert w.sent_bytes > 0 and w.max_flops > 0 and w.balance >= 1.0
    assert adamw.step is not None and muon.step is not None
    extra = muon.step.total_s - adamw.step.total_s
    assert extra >= w.max_flops / 1e14, (extra, w.max_flops)
    assert "whole-matrix step: Newton-Schulz" in muon.table()
    # Its step's scratch (the update, the owners' buffers) is in the step's peak.
    assert muon.step_scratch == w.update_bytes + w.buffer_bytes + w.orthogonalize_bytes > 0
    assert "| whole-matrix step scratch (in a step) |" in muon.table()


def test_cli_prices_bf16_masters(capsys: pytest.CaptureFixture[str]) -> None:
    """`--master-dtype bf16` halves the masters and AdamW's state, on the device and
    offloaded on the host (test_estimate_states checks the bytes against engines)."""
    rows = {}
    for dtype in ("fp32", "bf16"):
        for offload in ("none", "optimizer"):
            argv = ["1.3b", "--layers", "4", "--world", "2", "--master-dtype", dtype]
            argv += ["--offload", offload]
            assert main(argv) == 0
            out = capsys.readouterr().out
            for row in ("master", "optimizer", "host (offload), of it pinned"):
                found = re.search(rf"^\| {re.escape(row)} \| ([0-9.]+)", out, re.M)
                if found:
                    rows[dtype, offload, row] = float(found.group(1))
    assert {("bf16", "none", "master"), ("bf16", "none", "optimizer")} <= rows.keys(), rows
    for (dtype, offload, row), gib in rows.items():
        if dtype == "bf16" and row != "host (offload), of it pinned":
            assert gib == pytest.approx(rows["fp32", offload, row] / 2, abs=0.01), row
    host = "host (offload), of it pinned"
    assert rows["bf16", "optimizer", host] < 0.7 * rows["fp32", "optimizer", host], rows


def test_cli_prices_muon_offloaded(capsys: pytest.CaptureFixture[str]) -> None:
    """`--optimizer muon --offload`: Muon's momentum on the host (4 bytes an element where
    AdamW keeps 8), its update's scratch on the device."""
    host = {}
    for optimizer in ("adamw", "muon"):
        argv = ["tiny", "--world", "2", "--offload", "optimizer", "--optimizer", optimizer]
        assert main(argv) == 0
        out = capsys.readouterr().out
        host[optimizer] = float(out.split("| host (offload), of it pinned | ")[1].split(",")[0])
        assert ("whole-matrix step scratch" in out) == (optimizer == "muon"), out
    assert host["muon"] < host["adamw"], host
    # Beside AdamW, Muon's matrices step at step() while AdamW's groups step in backward
    # or delayed (docs/config.md's table): the planner prices both schedules.
    for overlap in ("backward", "delayed"):
        argv = ["tiny", "--world", "2", "--offload", "optimizer", "--optimizer", "muon"]
        assert main([*argv, "--stage", "2", "--offload-overlap", overlap]) == 0
        capsys.readouterr()


def test_every_option_has_help_and_names_its_default() -> None:
    for action in _parser()._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help, action.dest
        default = action.default
        if default is not None and not isinstance(default, bool):
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert f"default {shown}" in action.help, (action.dest, action.help)


def test_cli_version_and_sizes_as_people_write_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--version`; a preset in any case (`7B` was an unknown preset); a parameter rate
    as `5.3B` (it took `5.3e9` only)."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert re.fullmatch(
        r"zeroshard-plan \S+ \(zeroshard-engine; torch \S+\)\n", capsys.readouterr().out
    )
    rate = ["--cpu-adam-params-per-s"]
    for argv, model, per_s in [
        (["7B", *rate, "5.278B"], "7b", 5.278e9),
        (["Llama-70B", *rate, "800M"], "llama-70b", 8e8),
        (["1.3b", *rate, "5.278e+09"], "1.3b", 5.278e9),
        (["path/to/Config.json"], "path/to/Config.json", None),
    ]:
        a = _parser().parse_args([*argv, "--world", "2"])
        assert (a.model, a.cpu_adam_params_per_s) == (model, per_s), argv
    with pytest.raises(SystemExit):
        _parser().parse_args(["7b", "--world", "2", *rate, "5.3X"])
    assert "'5.3X' is not a count" in capsys.readouterr().err


def test_one_trace_serves_every_config_of_a_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recommendation replays the gradient path of each candidate on one traced
    micro-batch: each estimate equals a fresh `estimate()`, and the command traces once."""
    model = build("tiny", activation_checkpointing=False)
    configs = [
        {"stage": 1},
        {"stage": 2, "max_inflight_reductions": 1},
        {"stage": 2, "offload_optimizer": True},
        {"stage": 3, "reduce_dtype": "fp32"},
        {"stage": 3, "offload_optimizer": True, "offload_params": True},
    ]
    trace = trace_micro_batch(
        model, ZeroConfig.from_dict({"compute_dtype": "bf16"}), 2, 64, default_loss
    )
    for c in configs:
        cfg = ZeroConfig.from_dict({**c, "compute_dtype": "bf16"})
        assert estimate_on_trace(trace, model, cfg, 4) == estimate(model, cfg, 4, 2, 64), c
    traced = []

    def counted(*args: object) -> object:
        traced.append(args)
        return trace_micro_batch(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cli, "trace_micro_batch", counted)
    assert main(["tiny", "--world", "16", "--memory-limit-gib", "1"]) == 0
    assert len(traced) == 1


def test_preset_sizes_are_their_models() -> None:
    """The sizes the help lists are the built models' counts; 7b with 34 blocks is the
    7.06B GPT of the offload benchmarks the README cites."""
    for name, shape in PRESETS.items():
        built = build(name, activation_checkpointing=False)
        assert shape.parameters == sum(p.numel() for p in built.parameters()), name
    deeper = build("7b", activation_checkpointing=False, n_layer=34)
    assert round(sum(p.numel() for p in deeper.parameters()) / 1e9, 2) == 7.06
    assert "7b (6.66B)" in _parser().format_help().replace("\n", " ")


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
    peak = GradPath(plan, cfg).peak(trace_operators(meta, 2, 64, default_loss))
    assert abs(peak - measured) <= 0.02 * measured, (peak, measured)


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
