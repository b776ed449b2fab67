"""Train a small GPT on the shipped corpus with zeroshard, on as many ranks as torchrun starts.

    torchrun --standalone --nproc-per-node=2 examples/train_gpt.py --stage 2 --steps 300

gloo on CPU, NCCL on CUDA (one GPU per rank). `--batch` is the GLOBAL batch in sequences:
every rank draws the same random offsets into the corpus for a step and reads its own
slice of them, so the loss curve does not depend on the number of ranks. `--stage 0` runs
torch's DistributedDataParallel instead, for comparison. Plain `python
examples/train_gpt.py` runs one rank.

Long runs: `--ckpt-dir DIR --save-every N` checkpoints every N steps (`--async-save`
writes in the background) with the run's own state (learning-rate scheduler, data
position, RNG states); `--resume auto` (the default) loads the newest complete
checkpoint on start, so a job restarted by `torchrun --max-restarts` (or a resubmitted
one) ends exactly where an uninterrupted one would (docs/reliability.md):

    torchrun --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=localhost:0 examples/train_gpt.py --ckpt-dir ckpt --save-every 50
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, parameters_count  # type: ignore[import-not-found]
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

import zeroshard.engine as zs
from zeroshard.ckpt import SaveHandle
from zeroshard.comm import init_process_group

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger("train_gpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="Train a small GPT on examples/data/corpus.txt.")
    p.add_argument(
        "--stage",
        type=int,
        default=2,
        choices=[0, 1, 2, 3],
        help="ZeRO stage; 0 = torch DDP for comparison (default 2)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="compute dtype (auto: bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument(
        "--batch",
        type=int,
        default=16,
        help="global batch in sequences, split over ranks (default 16)",
    )
    p.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches per step on each rank (gradient accumulation)",
    )
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    p.add_argument("--preset", default="tiny", help="GPTConfig preset (default tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's seq_len")
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip; 0 = off")
    p.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        help="held-out batches for the start/end loss (default 4)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=300,
        help="characters to generate at the end on rank 0; 0 = none",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        help="hybrid sharding: shard within groups of N ranks (a node), replicate across",
    )
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint root (none: no saves)")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps; 0 = never")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="snapshot every N steps into host memory, replicated to another node, and "
        "restart from there (docs/reliability.md); 0 = never",
    )
    p.add_argument(
        "--snapshot-full-every",
        type=int,
        default=1,
        help="with --snapshot-every 1: a full snapshot every K steps and a gradient journal "
        "entry at each step between (Snapshots(full_every=K)); 1 = full snapshots only",
    )
    p.add_argument(
        "--resume",
        default="auto",
        choices=["auto", "never"],
        help="auto: load the newest complete checkpoint of --ckpt-dir if there is one",
    )
    p.add_argument(
        "--fp8",
        default="none",
        choices=["none", "tensorwise", "rowwise"],
        help="train the blocks' linears in fp8 with torchao's recipe (emulated on CPU)",
    )
    p.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="with --fp8 tensorwise at stage 3: gather those weights in fp8",
    )
    p.add_argument(
        "--offload",
        default="none",
        choices=["none", "optimizer", "delayed"],
        help="keep the optimizer's state and step on the CPU (offload_optimizer); delayed: "
        "its step beside the next forward and backward, one step behind "
        "(offload_delay_param_update, stages 1/2)",
    )
    p.add_argument("--loss-log", type=Path, default=None, help="rank 0 appends 'step loss' lines")
    p.add_argument(
        "--final-weights", type=Path, default=None, help="write the fp32 weights (safetensors)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.accum < 1 or args.batch < 1:
        p.error("--steps, --batch and --accum must be positive")
    if args.save_every < 0 or (args.save_every and args.ckpt_dir is None):
        p.error("--save-every needs --ckpt-dir and a count >= 0")
    if args.snapshot_every < 0 or (args.snapshot_every and args.ckpt_dir is None):
        p.error("--snapshot-every needs --ckpt-dir (the fallback) and a count >= 0")
    if args.ckpt_dir is not None and args.stage == 0:
        p.error("--ckpt-dir needs a ZeRO stage (1-3)")
    if args.shard_group_size is not None and args.stage == 0:
        p.error("--shard-group-size needs a ZeRO stage (1-3)")
    if args.fp8_all_gather and args.fp8 != "tensorwise":
        p.error("--fp8-all-gather needs --fp8 tensorwise (torchao's only recipe for it)")
    if args.offload != "none" and args.stage == 0:
        p.error("--offload needs a ZeRO stage (1-3)")
    return args


def to_float8(model: GPT, recipe: str, all_gather: bool, device: torch.device) -> None:
    """Every linear of the blocks trained in fp8 by torchao (the embedding and the tied
    head stay as they are); emulated off CUDA. `all_gather`: zeroshard's stage 3 gathers
    those weights in fp8 (torchao's `enable_fsdp_float8_all_gather`)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=device.type != "cuda",
        enable_fsdp_float8_all_gather=all_gather,
    )
    for block in model.blocks:
        convert_to_float8_training(block, config=config)


def init_distributed(device_kind: str) -> tuple[int, int, torch.device]:
    """Join (or, under plain python, create) the process group; return rank, world, device."""
    if "RANK" not in os.environ:
        # Plain `python train_gpt.py`: a world of one on a free local port.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # Not dist.init_process_group: zeroshard's comes up after torchrun restarts too.
    init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


class Corpus:
    """The corpus as byte tokens, split 95/5 into train and held-out parts."""

    def __init__(self, path: Path, seq_len: int) -> None:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        cut = int(len(data) * 0.95)
        self.train, self.val = data[:cut], data[cut:]
        self.seq_len = seq_len

    def batch(
        self, part: torch.Tensor, offsets_seed: int, global_batch: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows lo..hi of a global batch whose offsets depend only on `offsets_seed`."""
        g = torch.Generator().manual_seed(offsets_seed)
        starts = torch.randint(0, len(part) - self.seq_len - 1, (global_batch,), generator=g)
        rows = torch.stack([part[s : s + self.seq_len + 1] for s in starts[lo:hi].tolist()])
        return rows[:, :-1], rows[:, 1:]


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of steps (at most 50), then cosine down to peak/10."""
    warmup = max(1, min(50, steps // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_optimizer(model: nn.Module, lr: float, fused: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (two param groups); `fused`: torch's fused
    kernel (on CUDA, and for the offloaded step on the CPU)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


Wrapped = tuple[
    nn.Module,
    torch.optim.Optimizer,
    Callable[[float], torch.Tensor],
    Callable[[], dict[str, torch.Tensor]],
    Callable[[], contextlib.AbstractContextManager[None]],
]


def wrap(
    model: nn.Module,
    opt: torch.optim.AdamW,
    args: argparse.Namespace,
    dtype: torch.dtype,
    device: torch.device,
) -> Wrapped:
    """zeroshard (stages 1-3) or DDP (stage 0): model, optimizer, clip, full state, autocast."""
    if args.stage == 0:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if dtype == torch.float16:
            raise SystemExit("--stage 0 (DDP) runs fp32 or bf16 autocast here; use a ZeRO stage")
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

        def autocast() -> contextlib.AbstractContextManager[None]:
            return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

        return (
            ddp,
            opt,
            lambda c: torch.nn.utils.clip_grad_norm_(ddp.parameters(), c),
            lambda: {k: v.float() for k, v in model.state_dict().items()},
            autocast,
        )
    config: dict[str, Any] = {"stage": args.stage, "compute_dtype": args.dtype}
    if args.offload != "none":
        config["offload_optimizer"] = True
        config["offload_delay_param_update"] = args.offload == "delayed"
    if args.shard_group_size is not None:
        config["shard_group_size"] = args.shard_group_size
    zmodel, zopt = zs.initialize(model, opt, config)
    return (
        zmodel,
        zopt,
        lambda c: zopt.clip_grad_norm_(c),
        lambda: zs.full_state_dict(zmodel),
        contextlib.nullcontext,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    corpus: Corpus,
    args: argparse.Namespace,
    rank: int,
    world: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[None]],
) -> float:
    """Mean loss over the same held-out batches on every call, averaged over ranks."""
    model.eval()
    per_rank = args.batch // world
    total = torch.zeros((), device=device)
    for i in range(args.eval_batches):
        x, y = corpus.batch(
            corpus.val, 10_000 + i, args.batch, rank * per_rank, (rank + 1) * per_rank
        )
        with autocast():
            loss: torch.Tensor = model(x.to(device), y.to(device))
        total += loss.float()
    dist.all_reduce(total)
    model.train()
    count: int = args.eval_batches * world
    return float(total.item()) / count


@torch.no_grad()
def sample(state: dict[str, torch.Tensor], cfg: GPTConfig, n: int, prompt: str) -> str:
    """Generate `n` bytes after `prompt` from a plain GPT loaded with `state` (temperature 0.8)."""
    model = GPT(cfg)
    model.load_state_dict(state)
    model.eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([list(prompt.encode())])
    for _ in range(n):
        logits = model(idx[:, -cfg.seq_len :])[0, -1] / 0.8
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        idx = torch.cat([idx, nxt[None]], dim=1)
    return bytes(idx[0].tolist()).decode("ascii", errors="replace")


def micro_batches(
    corpus: Corpus, args: argparse.Namespace, step: int, rank: int, world: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's `accum` micro-batches of step `step` (global batch = --batch x --accum)."""
    per_rank = args.batch // world
    for a in range(args.accum):
        seed = args.seed * 1_000_003 + step * args.accum + a
        yield corpus.batch(corpus.train, seed, args.batch, rank * per_rank, (rank + 1) * per_rank)


def main() -> None:
    """Train, printing the held-out loss before and after."""
    args = parse_args()
    rank, world, device = init_distributed(args.device)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format="%(name)s: %(message)s"
    )
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    if args.dtype == "auto":
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    dtype = DTYPES[args.dtype]

    overrides = {"seq_len": args.seq_len} if args.seq_len else {}
    cfg = GPTConfig.preset(args.preset, **overrides)
    if cfg.vocab_size < 256:
        raise SystemExit("byte-level tokens need vocab_size >= 256")
    corpus = Corpus(CORPUS, cfg.seq_len)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    plain = GPT(cfg).to(device)
    if args.fp8 != "none":
        to_float8(plain, args.fp8, args.fp8_all_gather, device)
    engine = "DDP" if args.stage == 0 else f"zeroshard stage {args.stage}"
    log.info(
        "GPT %s: %.2fM parameters; %s, %s%s, %d rank(s) on %s; global batch %d x %d tokens",
        args.preset,
        parameters_count(cfg) / 1e6,
        engine,
        args.dtype,
        "" if args.fp8 == "none" else f", blocks in fp8 ({args.fp8})",
        world,
        device.type,
        args.batch * args.accum,
        cfg.seq_len,
    )
    t0 = time.perf_counter()
    model, opt, clip, full_state, autocast = wrap(
        plain,
        build_optimizer(plain, args.lr, device.type == "cuda" or args.offload != "none"),
        args,
        dtype,
        device,
    )
    log.info("wrapped in %.2f s", time.perf_counter() - t0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: learning_rate(step, args.steps, args.lr) / args.lr
    )
    # What the run depends on besides model and optimizer. Global: the scheduler and the
    # data position (batches here are a function of the step alone). Per rank: the RNGs.
    # Under hybrid sharding only the first replica writes files, so there is no per-rank
    # state (and a job that lost a node resumes at another world size, where per-rank
    # state could not load): nothing here draws random numbers after the seeded init
    # (no dropout; batches come from their own seeded generators), so none is lost.
    data = {"next_step": 0}
    client_state: dict[str, Any] = {"scheduler": sched, "data": data}
    rank_state = None if args.shard_group_size else {"rng": zs.RNGState()}
    snapshots = None
    if args.snapshot_every:
        snapshots = zs.Snapshots(
            model,
            opt,
            every=args.snapshot_every,
            full_every=args.snapshot_full_every,
            client_state=client_state,
            rank_state=rank_state,
        )
    if args.ckpt_dir is not None and args.resume == "auto":
        if snapshots is not None:  # memory first, else the newest checkpoint on disk
            resumed = snapshots.resume(args.ckpt_dir)
            last = snapshots.last_resume
            if resumed is not None:
                memory = last is not None and last.source == "memory"
                where = "the snapshots in memory" if memory else str(args.ckpt_dir)
                log.info("resumed from step %d of %s", resumed, where)
        else:
            # Logs, on rank 0, the checkpoint it resumed from, its step and the world
            # sizes then and now (or the fresh start).
            zs.resume_checkpoint(
                model, opt, args.ckpt_dir, client_state=client_state, rank_state=rank_state
            )
        data = client_state["data"]  # plain data comes back as a new value

    first_step = data["next_step"]  # 0, or the step a resumed run goes on from
    start_loss = evaluate(model, corpus, args, rank, world, device, autocast)
    log.info("step %d: held-out loss %.4f", first_step, start_loss)
    tokens_per_step = args.batch * args.accum * cfg.seq_len
    # Advanced by hand, once a step after its postfix is set: an iterated bar also shows
    # each step again when the postfix changes, and its last step once more on close(),
    # lines that all stay in a log that is not a terminal.
    bar = tqdm(
        total=args.steps - first_step,
        disable=rank != 0,
        desc="train",
        unit="step",
        mininterval=1.0,
        file=sys.stdout,
    )
    train_loss = float("nan")
    t_start = time.perf_counter()
    pending: SaveHandle | None = None
    for step in range(first_step, args.steps):
        loss_sum = torch.zeros((), device=device)
        for x, y in micro_batches(corpus, args, step, rank, world):
            with autocast():
                loss = model(x.to(device), y.to(device)) / args.accum
            loss.backward()
            loss_sum += loss.detach()
        if args.clip > 0:
            clip(args.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        train_loss = loss_sum.item()  # this rank's; synchronizes CUDA so the timing is real
        if args.loss_log is not None and rank == 0:
            with open(args.loss_log, "a") as f:
                f.write(f"{step} {train_loss.hex()}\n")  # exact, to compare runs
        bar.set_postfix(
            loss=f"{train_loss:.3f}",
            tok_s=f"{tokens_per_step * (bar.n + 1) / (time.perf_counter() - t_start):,.0f}",
            refresh=False,
        )
        if step + 1 < args.steps:
            bar.update()
        else:
            bar.n += 1  # shown once, by close(), with the whole run's rate
        data["next_step"] = step + 1
        if snapshots is not None:
            snapshots.take(step + 1)
        if args.save_every and (step + 1) % args.save_every == 0:
            pending = zs.save_checkpoint(
                model,
                opt,
                args.ckpt_dir,
                step=step + 1,
                async_save=args.async_save,
                # A resumed run redoes the steps after the checkpoint it loaded: their
                # checkpoints may exist (damaged, or committed but not yet `latest`).
                overwrite=True,
                client_state=client_state,
                rank_state=rank_state,
            )
    bar.close()
    if pending is not None:
        pending.wait()  # commit the last async save on every rank before exiting
    if snapshots is not None:
        snapshots.close()  # a normal end: the snapshots in memory go

    end_loss = evaluate(model, corpus, args, rank, world, device, autocast)
    log.info(
        "step %d: held-out loss %.4f (train %.4f); %.4f at step %d",
        args.steps,
        end_loss,
        train_loss,
        start_loss,
        first_step,
    )
    if args.sample > 0 or args.final_weights is not None:
        state = {k: v.cpu() for k, v in full_state().items()}  # collective: every rank calls
        if rank == 0 and args.final_weights is not None:
            # clone: tied weights share memory, which safetensors refuses to write.
            save_file({k: v.float().clone() for k, v in state.items()}, args.final_weights)
        if rank == 0 and args.sample > 0:
            print("--- sample ---\n" + sample(state, cfg, args.sample, "Chapter 7. ") + "\n---")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
