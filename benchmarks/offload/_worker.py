"""One part of benchmarks/offload, run in a process of its own.

    python -m benchmarks.offload._worker PART ARGS_JSON OUT_JSON

PART is `train-zs`, `train-zs-overlap`, `train-zs-dpu`, `train-zs-clip`, `train-ds`, `fwd-bwd`,
`transfer`, `host-stream`, `ds-build`, `adam-torch-fused`, `adam-torch-foreach`, `adam-ds`
or `adam-zs-host`; a zeroshard part with `-compiled` after its name runs with
`offload_compiled_step`, and a zeroshard or DeepSpeed part with `-bf16` after its name
with bf16 masters (`BF16`).
Each part runs alone so that a host or device out-of-memory, or a crash in a JIT-built
extension, costs only its own row, and so that every part starts with the host memory
empty. The result (or the
error) is written to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import join, place_ranks
from benchmarks.offload._bf16 import BF16
from examples.gpt import GPT, GPTConfig, parameters_count

LR = 1e-4
GIB = 1024**3


def _host_peak_gib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _join_alone(smoke: bool) -> torch.device:
    """This process as the only rank of its group, placed as every benchmark's ranks are."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return join(place_ranks(1, smoke=smoke))


def _step_times(
    step: Callable[[], object], device: torch.device, warmup: int, steps: int
) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _time_steps(step: Callable[[], object], device: torch.device, warmup: int, steps: int) -> float:
    return statistics.median(_step_times(step, device, warmup, steps))


def _gpt(a: dict[str, Any], device: torch.device) -> tuple[torch.nn.Module, GPTConfig]:
    cfg = GPTConfig.preset(
        a["preset"],
        n_layer=a["layers"],
        seq_len=a["seq_len"],
        activation_checkpointing=a["activation_checkpointing"],
    )
    with torch.device(device):
        model = GPT(cfg)
    return model, cfg


def train(a: dict[str, Any], engine: str) -> dict[str, Any]:
    """Time one offloaded training step (bf16 compute, AdamW on the CPU); `zs-overlap`
    steps the CPU inside backward (`step_in_backward`), `zs-ratio` too but with only
    `offload_ratio` of the shards offloaded (the rest steps on the device), `zs-dpu` beside
    the next forward and backward (`offload_delay_param_update`: weights one step behind),
    `zs-clip` clips the gradients' global norm first; `BF16` after any: bf16 masters."""
    device = _join_alone(a["smoke"])
    torch.manual_seed(0)
    start = time.perf_counter()
    setup = _setup_ds if engine.removesuffix(BF16) == "ds" else _setup_zs
    # zeroshard's stage 3 materializes a meta model one block at a time on the device:
    # the whole fp32 model (80 GB at 20B parameters, more than an H100 holds) never is.
    meta = setup is _setup_zs and a["stage"] == 3
    model, cfg = _gpt(a, torch.device("meta") if meta else device)
    step, held = setup(model, a, engine)
    init_s = time.perf_counter() - start
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (a["micro_batch"], cfg.seq_len)
    x = torch.randint(0, cfg.vocab_size, shape, device=device, generator=gen)
    y = torch.randint(0, cfg.vocab_size, shape, device=device, generator=gen)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _step_times(lambda: step(x, y), device, a["warmup"], a["steps"])
    seconds = statistics.median(times)
    return {
        "params": parameters_count(cfg),
        "init_s": init_s,
        "step_s": seconds,
        "steps_run": a["warmup"] + a["steps"],
        # The offloaded step's speed moves from step to step (docs/benchmarks.md).
        "fastest_step_s": min(times),
        "slowest_step_s": max(times),
        "tokens_per_s": a["micro_batch"] * cfg.seq_len / seconds,
        "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GIB
        if device.type == "cuda"
        else 0.0,
        "host_peak_gib": _host_peak_gib(),
        **held(),
    }


# A row's step, and what its engine holds, read after the steps.
Setup = tuple[Callable[..., None], Callable[[], dict[str, Any]]]


def zs_config(a: dict[str, Any], engine: str) -> dict[str, Any]:
    """The zeroshard config of the part `train-<engine>` (`zs-overlap-bf16`, ...): a
    `-compiled` part is its row with offload_compiled_step, a `BF16` one with bf16 masters."""
    mode = engine.removesuffix(BF16).removesuffix("-compiled")
    return {
        "stage": a["stage"],
        "compute_dtype": "bf16",
        "master_dtype": "bf16" if engine.endswith(BF16) else "fp32",
        "offload_optimizer": True,
        "offload_params": a["offload_params"],
        "offload_ratio": a["offload_ratio"] if mode == "zs-ratio" else 1.0,
        "offload_delay_param_update": mode == "zs-dpu",
        "offload_compiled_step": "-compiled" in engine,
    }


def steps_in_backward(engine: str) -> bool:
    """Whether the part `train-<engine>` steps the CPU inside backward."""
    return engine.startswith(("zs-overlap", "zs-ratio"))


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    """Every zeroshard row's optimizer (DeepSpeed's config names the same)."""
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), fused=True)


def _setup_zs(model: torch.nn.Module, a: dict[str, Any], engine: str) -> Setup:
    import zeroshard.engine as zs

    zmodel, zopt = zs.initialize(model, adamw(model.parameters()), zs_config(a, engine))
    in_backward = steps_in_backward(engine)
    clip = engine.startswith("zs-clip")

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = zmodel(x, y)
        if in_backward:
            with zopt.step_in_backward():
                loss.backward()
        else:
            loss.backward()
        if clip:
            zopt.clip_grad_norm_(1.0)
        zopt.step()
        zopt.zero_grad()

    return step, lambda: _zs_held(zmodel, zopt)


def _zs_held(zmodel: torch.nn.Module, zopt: Any) -> dict[str, Any]:
    """The host bytes zeroshard's offload holds by its own count: its buffers (masters,
    gradients, staging; with offload_params the compute shards) and the optimizer's state
    of the groups homed on the host (AdamW's moments, in the masters' dtype)."""
    import zeroshard.engine as zs

    if not hasattr(zs, "HomeKind"):
        # A tree from before issue 72's homes (benchmarks.before_after's "before"): its
        # step is timed, its host bytes are not counted.
        return {}
    from zeroshard.engine.runtime.offload import HostOffload

    state = zs.engine_state(zmodel)
    store = state.offload
    assert isinstance(store, HostOffload), "an offload row homes groups on the host"
    masters = [g.home.master for g in state.groups if g.home.kind is zs.HomeKind.HOST]
    moments = [
        t
        for m in masters
        for t in zopt.state.get(m, {}).values()
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0
    ]
    return {
        "master_dtype": str(masters[0].dtype).removeprefix("torch."),
        "moments_dtype": str(moments[0].dtype).removeprefix("torch.") if moments else "none",
        "engine_host_bytes": store.nbytes().host + sum(t.nbytes for t in moments),
    }


def _setup_ds(model: torch.nn.Module, a: dict[str, Any], engine: str) -> Setup:
    """DeepSpeed ZeRO-Offload; `ds-bf16`: its bf16 masters, gradients and optimizer states
    (DeepSpeedCPUAdam with `fp32_optimizer_states=False`), else its default fp32 ones."""
    import deepspeed  # type: ignore[import-not-found, import-untyped, unused-ignore]

    precision: dict[str, Any] = {"enabled": True}
    if engine.endswith(BF16):
        precision |= {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    config = {
        "train_micro_batch_size_per_gpu": a["micro_batch"],
        "gradient_accumulation_steps": 1,
        "bf16": precision,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95]}},
        "zero_optimization": {
            "stage": a["stage"],
            "overlap_comm": True,
            "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            **(
                {"offload_param": {"device": "cpu", "pin_memory": True}}
                if a["offload_params"]
                else {}
            ),
        },
        "steps_per_print": 1 << 30,
    }
    ds, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        ds.backward(ds(x, y))
        ds.step()

    def held() -> dict[str, Any]:
        # What DeepSpeed runs with, read back rather than assumed from the config (where
        # its optimizer does not say, "not reported": the measured row is kept).
        masters = getattr(ds.optimizer, "master_weights_and_grads_dtype", None)
        cpu_adam = getattr(ds.optimizer, "optimizer", None)
        fp32_moments = getattr(cpu_adam, "fp32_optimizer_states", None)
        if masters is None or fp32_moments is None:
            return {"master_dtype": "not reported", "moments_dtype": "not reported"}
        master = str(masters).removeprefix("torch.")
        return {"master_dtype": master, "moments_dtype": "float32" if fp32_moments else master}

    return step, held


def _chunk_sizes(n: int, chunk: int) -> list[int]:
    """The lengths of `n` elements cut into tensors of at most `chunk`."""
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def fwd_bwd(a: dict[str, Any]) -> dict[str, Any]:
    """The GPU's share alone: forward and backward of the same GPT in bf16, no optimizer,
    no offload (the gradients stay on the device)."""
    device = _join_alone(a["smoke"])
    torch.manual_seed(0)
    model, cfg = _gpt(a, device)
    model.to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (a["micro_batch"], cfg.seq_len)
    x = torch.randint(0, cfg.vocab_size, shape, device=device, generator=gen)
    y = torch.randint(0, cfg.vocab_size, shape, device=device, generator=gen)

    def step() -> None:
        model(x, y).backward()
        for p in model.parameters():
            p.grad = None

    return {"params": parameters_count(cfg), "step_s": _time_steps(step, device, 1, a["steps"])}


def transfer(a: dict[str, Any]) -> dict[str, Any]:
    """The bus's share alone, as offload moves it: a bf16 copy of every parameter down
    (pinned host), and up the fp32 masters (cast on the device), or with offload_params
    the bf16 shards."""
    device = _join_alone(a["smoke"])
    cfg = GPTConfig.preset(a["preset"], n_layer=a["layers"], seq_len=a["seq_len"])
    n = parameters_count(cfg)
    pin = device.type == "cuda"
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)
    dev = torch.ones(n, dtype=torch.bfloat16, device=device)
    down = _time_steps(lambda: host.copy_(dev, non_blocking=pin), device, 1, a["steps"])
    up_dtype = torch.bfloat16 if a["offload_params"] else torch.float32
    if up_dtype != host.dtype:
        del host, dev
        host = torch.empty(n, dtype=up_dtype, pin_memory=pin)
        dev = torch.ones(n, dtype=up_dtype, device=device)
    up = _time_steps(lambda: dev.copy_(host, non_blocking=pin), device, 1, a["steps"])
    return {
        "params": n,
        "d2h_s": down,
        "h2d_s": up,
        "h2d_dtype": str(up_dtype).removeprefix("torch."),
        "step_s": down + up,
        "d2h_gb_per_s": n * 2 / 1e9 / down,
        "h2d_gb_per_s": n * up_dtype.itemsize / 1e9 / up,
        "host_peak_gib": _host_peak_gib(),
    }


def host_stream(a: dict[str, Any]) -> dict[str, Any]:
    """The host memory's streaming rate, with every core: `c = a + b` over as many fp32
    elements as the CPU optimizer rows, in tensors of `a['chunk']` elements. 16 bytes an
    element: two reads, and a write into lines not in cache, which the core reads first."""
    n, chunk = a["adam_params"], a["chunk"]
    sizes = _chunk_sizes(n, chunk)
    xs = [torch.full((s,), 1.0) for s in sizes]
    ys = [torch.full((s,), 2.0) for s in sizes]
    zs = [torch.empty(s) for s in sizes]

    def step() -> None:
        for x, y, z in zip(xs, ys, zs, strict=True):
            torch.add(x, y, out=z)

    seconds = _time_steps(step, torch.device("cpu"), 1, a["adam_steps"])
    return {
        "elements": n,
        "step_s": seconds,
        "gb_per_s": 16 * n / seconds / 1e9,
        "threads": torch.get_num_threads(),
        "host_peak_gib": _host_peak_gib(),
    }


def ds_build(a: dict[str, Any]) -> dict[str, Any]:
    """Build (or load from the cache) DeepSpeedCPUAdam's extension: untimed set-up."""
    from deepspeed.ops.op_builder import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
        CPUAdamBuilder,
    )

    start = time.perf_counter()
    CPUAdamBuilder().load()
    return {"build_s": time.perf_counter() - start}


def adam(a: dict[str, Any], kind: str) -> dict[str, Any]:
    """Parameters per second of one AdamW step on CPU fp32 tensors of `a['chunk']` elements."""
    torch.set_num_threads(os.cpu_count() or 1)
    n, chunk = a["adam_params"], a["chunk"]
    if kind == "torch-foreach":
        n //= 10  # op by op on CPU tensors, with temporaries: bound its time
    sizes = _chunk_sizes(n, chunk)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt: torch.optim.Optimizer
    if kind == "ds":
        from deepspeed.ops.adam import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
            DeepSpeedCPUAdam,
        )

        opt = DeepSpeedCPUAdam(params, lr=LR, betas=(0.9, 0.95), adamw_mode=True)
    else:
        fused = kind == "torch-fused"
        opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), fused=fused, foreach=not fused)
    seconds = _time_steps(opt.step, torch.device("cpu"), 1, a["adam_steps"])
    return {
        "params": n,
        "step_s": seconds,
        "params_per_s": n / seconds,
        "threads": torch.get_num_threads(),
        "host_peak_gib": _host_peak_gib(),
    }


def zs_host(a: dict[str, Any], *, compiled: bool, bf16: bool) -> dict[str, Any]:
    """zeroshard's offloaded step alone, as `train-zs` runs it after backward: bf16
    gradients on the host in, torch's fused AdamW on the fp32 masters (or the compiled
    step: `adam-zs-host-compiled`; `bf16`: on bf16 masters and moments,
    `adam-zs-host-bf16`), the masters up to be cast on the device; no forward or backward.
    The same element count as the CPU optimizer rows, in tensors of `a['chunk']`
    elements."""
    import zeroshard.engine as zs
    from zeroshard.engine.runtime.offload import HostOffload
    from zeroshard.engine.runtime.offload._step import step_offloaded

    device = _join_alone(a["smoke"])
    n, chunk = a["adam_params"], a["chunk"]
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.zeros(min(chunk, n - i), device=device).normal_(0, 0.02))
        for i in range(0, n, chunk)
    )
    opt = adamw(model.parameters())
    config = {
        "stage": 2,
        "compute_dtype": "bf16",
        "master_dtype": "bf16" if bf16 else "fp32",
        "offload_optimizer": True,
        "offload_compiled_step": compiled,
    }
    start = time.perf_counter()
    wrapped, zopt = zs.initialize(model, opt, config)
    init_s = time.perf_counter() - start
    offload = zs.engine_state(wrapped).offload
    assert isinstance(offload, HostOffload)
    groups = [g for g in zopt.flat_groups if g.trainable]
    for g in groups:
        # The reduced gradient as it lands on the host (bf16); the step never clears it.
        g.home.claim_grad_shard().fill_(1e-3)

    def step() -> None:
        step_offloaded(zopt.inner, offload, [], groups)

    seconds = _time_steps(step, device, 1, a["adam_steps"])
    return {
        "params": n,
        "step_s": seconds,
        "params_per_s": n / seconds,
        "threads": torch.get_num_threads(),
        "init_s": init_s,
        "host_peak_gib": _host_peak_gib(),
    }


def main() -> None:
    """Run PART with the JSON arguments; write the result or the error to OUT_JSON."""
    part, args, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        if part.startswith("train-"):
            result = train(args, part.removeprefix("train-"))
        elif part.startswith("adam-zs-host"):
            result = zs_host(args, compiled="-compiled" in part, bf16=part.endswith(BF16))
        elif part in ("fwd-bwd", "transfer", "host-stream", "ds-build"):
            parts = {
                "fwd-bwd": fwd_bwd,
                "transfer": transfer,
                "host-stream": host_stream,
                "ds-build": ds_build,
            }
            result = parts[part](args)
        else:
            result = adam(args, part.removeprefix("adam-"))
        result["ok"] = True
    except BaseException as e:  # every failure becomes a row, never a lost run
        oom = isinstance(e, torch.OutOfMemoryError)
        why = "GPU out of memory" if oom else f"{type(e).__name__}: {e}".splitlines()[0][:160]
        result = {"ok": False, "error": why, "trace": traceback.format_exc()[-4000:]}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
