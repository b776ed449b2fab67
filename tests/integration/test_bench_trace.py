"""The profile split of benchmarks/train_step on a Chrome trace of known layout.

A trace written in the format `torch.profiler` exports (device kernels with `cat:
kernel`, launches with `cat: cuda_runtime` and a shared correlation id, the optimizer's
`Optimizer.step#...` CPU range), with every interval chosen so that each figure of the
split has one exact expected value.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.train_step._plots import plot_split
from benchmarks.train_step._report import profile_tables
from benchmarks.train_step._result import Result
from benchmarks.train_step._trace import (
    Kernel,
    kernel_medians,
    read_trace,
    summarize,
    summarize_chrome_trace,
)

CPU = {"pid": 1, "tid": 7}


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict[str, object]:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(ts: float, corr: int) -> dict[str, object]:
    return {
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 2,
        "args": {"correlation": corr},
        **CPU,
    }


def _trace(tmp_path: Path) -> Path:
    """One step (us): gemm alone [0, 100); NCCL [100, 300) with the same gemm overlapping it
    [150, 280) (30 us slower than alone); idle [300, 950); the optimizer's kernel [950, 990)
    launched inside `Optimizer.step`; a kernel launched outside it is not the optimizer's."""
    events = [
        {"cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 900, "dur": 60} | CPU,
        _launch(0, 1),
        _launch(90, 2),
        _launch(140, 3),
        _launch(920, 4),
        _kernel("gemm_bf16", 0, 100, 1),
        _kernel("ncclDevKernel_AllGather_RING_LL", 100, 200, 2),
        _kernel("gemm_bf16", 150, 130, 3),
        _kernel("multi_tensor_apply_kernel<adam>", 950, 40, 4),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5} | CPU,  # not a kernel
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_split_of_a_known_trace(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    kernels, optimizer = read_trace(path)
    assert len(kernels) == 4 and optimizer == {4}
    t = summarize_chrome_trace(path, steps=1)
    assert t is not None
    assert t.window_ms == pytest.approx(0.990)
    assert t.compute_ms == pytest.approx(0.100 + 0.130 + 0.040)
    assert t.optimizer_ms == pytest.approx(0.040)
    assert t.compute_only_ms == pytest.approx(0.230)
    assert t.comm_ms == pytest.approx(0.200)
    assert t.exposed_comm_ms == pytest.approx(0.050 + 0.020)  # [100, 150) and [280, 300)
    assert t.idle_ms == pytest.approx(0.650)
    assert t.overlapped_compute_ms == pytest.approx(0.130)
    # No reference: the overlapped gemm against its own instance that ran alone.
    assert t.overlap_slowdown_ms == pytest.approx(0.030)
    # The parts of the split are disjoint and fill the window.
    parts = t.compute_only_ms + t.optimizer_ms + t.exposed_comm_ms + t.idle_ms
    assert parts == pytest.approx(t.window_ms)


def test_slowdown_against_the_floor_reference() -> None:
    kernels = [
        Kernel("nccl_rs", 0, 100),
        Kernel("gemm", 10, 80),  # overlapped: 80 us against the floor's 50
        Kernel("softmax", 20, 30),  # overlapped, faster than the floor's: no negative cost
        Kernel("cast", 30, 10),  # overlapped, unknown to the floor and never alone: no cost
    ]
    floor = kernel_medians(
        [Kernel("gemm", 0, 50), Kernel("gemm", 60, 54), Kernel("softmax", 0, 40)]
    )
    assert floor == {"gemm": 52.0, "softmax": 40.0}
    t = summarize(kernels, 2, reference=floor)
    assert t is not None
    assert t.overlap_slowdown_ms == pytest.approx((80 - 52) / 2 / 1000)
    assert t.exposed_comm_ms == pytest.approx(20 / 2 / 1000)  # [0, 10) and [90, 100)
    assert summarize([], 1) is None


def test_report_splits_the_gap_to_the_floor(tmp_path: Path) -> None:
    t = summarize_chrome_trace(_trace(tmp_path), steps=1)
    floor = Result("floor", "no communication", step_ms=0.5, trace=None)
    zs3 = Result("zs3", "zeroshard stage 3", step_ms=1.2, trace=t)
    lines = "\n".join(profile_tables([zs3], {"floor": floor, "zs3": zs3}))
    # gap 0.7 = (a) 0.07 exposed + (b) 0.03 slowdown + 0.6 rest (2 decimals: 0.0 / 0.6).
    assert "| `zs3` | `floor` | 0.7 | 0.1 | 0.0 | 0.6 |" in lines


def test_split_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    t = summarize_chrome_trace(_trace(tmp_path), steps=1)
    floor = Result("floor", "no communication", step_ms=0.5, trace=None)
    zs3 = Result("zs3", "zeroshard stage 3", step_ms=1.2, trace=t)
    assert not plot_split([floor], tmp_path / "none.png", "test"), "nothing profiled: no plot"
    png = tmp_path / "split.png"
    assert plot_split([floor, zs3], png, "test")
    assert png.stat().st_size > 1000


def test_kernels_side_by_side(tmp_path: Path) -> None:
    """`benchmarks.train_step.kernels`: ms per step by name and by kind, the optimizer
    step's kernels apart (found through their launch inside `Optimizer.step`)."""
    from benchmarks.train_step.kernels import kind, per_step

    path = _trace(tmp_path)
    by_name, total, opt = per_step(path, steps=1)
    assert by_name == pytest.approx(
        {
            "gemm_bf16": 0.23,
            "ncclDevKernel_AllGather_RING_LL": 0.2,
            "multi_tensor_apply_kernel<adam>": 0.04,
        }
    )
    assert total == pytest.approx(0.47) and opt == pytest.approx(0.04)
    by_kind, _, _ = per_step(path, steps=2, by_kind=True)
    assert by_kind == pytest.approx({"matmul, bf16": 0.115, "other": 0.1, "optimizer step": 0.02})
    assert kind("nvjet_sm90_qqtst_192x192_128x4_1x2_h_bz_coopB_TNN") == "matmul, fp8"
    assert kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul, bf16"
    assert kind("triton_red_fused_abs_add_gelu_max_view_6") == "inductor, amax / scale / cast"
    assert kind("triton_poi_fused_add_gelu_3") == "inductor, other"
    assert kind("multi_tensor_apply_kernel<adam>") == "foreach (outside the optimizer step)"
