"""Train a transformers causal LM with zeroshard and write it back in Hugging Face format.

    torchrun --standalone --nproc-per-node=2 examples/hf_causal_lm.py \\
        --config llama --stage 3 --steps 60 --save-every 20 --output-dir out/hf-llama
    torchrun ... examples/hf_causal_lm.py --model path/to/local/model --stage 3 ...

`--config llama|gpt2` builds a small model from a config (byte tokens, no download);
`--model DIR` loads a local model: at stage 3 it is built on the meta device and each
rank reads only its shard of the weights (`zs.load_safetensors`). Training reads
examples/data/corpus.txt (with the model's tokenizer when DIR has one); `--batch` is the
global batch, the same rows on any number of ranks. Checkpoints go to OUT/checkpoints
every `--save-every` steps; at the end rank 0 consolidates the last one into OUT/hf
(safetensors, config and tokenizer files beside them), which
`AutoModelForCausalLM.from_pretrained(OUT/hf)` loads, and a greedy sample is generated
under stage 3 inside `zs.gathered_parameters`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from tqdm import tqdm

import zeroshard.engine as zs
from zeroshard.ckpt import consolidate
from zeroshard.comm import init_process_group
from zeroshard.engine.huggingface import rebuild_meta_buffers

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
log = logging.getLogger("hf_causal_lm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="Train a transformers causal LM with zeroshard.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a local transformers model directory")
    src.add_argument("--config", choices=["llama", "gpt2"], help="a small model from a config")
    p.add_argument("--tied", action="store_true", help="--config: tie the output head to the input")
    p.add_argument("--hidden", type=int, default=64, help="--config: hidden size (default 64)")
    p.add_argument("--layers", type=int, default=2, help="--config: layers (default 2)")
    p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage")
    p.add_argument("--compile", action="store_true", help="zeroshard.compile (stage 3)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="compute dtype")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip; 0 = off")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--output-dir", type=Path, required=True, help="checkpoints/ and hf/ go here")
    p.add_argument("--sample", type=int, default=32, help="tokens to generate at the end; 0 = none")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.seq_len, args.save_every) < 1:
        p.error("--steps, --batch, --seq-len and --save-every must be positive")
    if args.compile and args.stage != 3:
        p.error("--compile needs --stage 3")
    return args


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, under plain python, create) the process group; return rank, world, device."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python hf_causal_lm.py`: a world of one
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ["MASTER_PORT"] = str(port)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # zeroshard's, not dist.init_process_group: it comes up after torchrun restarts.
        init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def small_config(args: argparse.Namespace) -> transformers.PretrainedConfig:
    """A Llama or GPT-2 config of `--hidden` x `--layers`, byte vocabulary, no dropout."""
    if args.config == "llama":
        return transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq_len,
            tie_word_embeddings=args.tied,
        )
    return transformers.GPT2Config(
        vocab_size=256,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=4,
        n_positions=args.seq_len,
        tie_word_embeddings=args.tied,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def load_model(
    args: argparse.Namespace, device: torch.device
) -> tuple[torch.nn.Module, zs.ZeroOptimizer, Any]:
    """The sharded model, its optimizer and its tokenizer (None: byte tokens)."""
    cfg = {"stage": args.stage, "compute_dtype": args.dtype}
    tokenizer = None
    if args.config is not None:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = transformers.AutoModelForCausalLM.from_config(small_config(args)).to(device)
    elif args.stage == 3:
        # Built on the meta device: no rank ever holds the whole model. Rotary buffers
        # are in no checkpoint; they are recomputed, then the weights are read shard-wise.
        config = transformers.AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        rebuild_meta_buffers(model, device)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model).to(device)
    if args.model is not None and any((args.model / f).exists() for f in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, zopt = zs.initialize(model, opt, cfg, param_init=model._init_weights)
    if args.model is not None and args.stage == 3:
        report = zs.load_safetensors(model, args.model)
        log.info("loaded %s into the shards", report)
    return model, zopt, tokenizer


def tokens(tokenizer: Any) -> torch.Tensor:
    """The corpus as token ids: the tokenizer's, or bytes."""
    text = CORPUS.read_text(encoding="utf-8", errors="replace")
    if tokenizer is None:
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def batch(data: torch.Tensor, step: int, args: argparse.Namespace, rank: int, world: int) -> Any:
    """This rank's rows of step `step`'s global batch (offsets drawn from seed and step)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.seq_len, (args.batch,), generator=g)
    per_rank = args.batch // world
    mine = starts[rank * per_rank : (rank + 1) * per_rank].tolist()
    return torch.stack([data[s : s + args.seq_len] for s in mine])


def export(args: argparse.Namespace, model: torch.nn.Module, tokenizer: Any) -> Path:
    """Rank 0: consolidate the last checkpoint into OUT/hf with config and tokenizer files."""
    out = args.output_dir / "hf"
    consolidate(args.output_dir / "checkpoints", out, overwrite=True)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    elif args.model is not None:
        for name in TOKENIZER_FILES:
            if (args.model / name).exists():
                shutil.copy(args.model / name, out / name)
    return out


def main(argv: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Train, checkpoint, consolidate; return the final full state dict (on every rank)."""
    args = parse_args(argv)
    rank, world, device = init_distributed()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format="%(name)s: %(message)s"
    )
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    if args.dtype == "auto":
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    model, opt, tokenizer = load_model(args, device)
    forward: Any = model
    if args.compile:
        import zeroshard.compile as zc

        forward = zc.compile(model, backend=args.compile_backend)
    if tokenizer is None and model.config.vocab_size < 256:
        raise SystemExit(
            f"byte tokens need vocab_size >= 256, the model has {model.config.vocab_size}"
        )
    data = tokens(tokenizer)
    ckpts = args.output_dir / "checkpoints"
    # Advanced by hand after each step's postfix, as in train_gpt.py: an iterated bar
    # shows each step twice and its last once more on close().
    bar = tqdm(total=args.steps, disable=rank != 0, desc="train", unit="step", file=sys.stdout)
    for step in range(1, args.steps + 1):
        x = batch(data, step, args, rank, world).to(device)
        loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        if args.clip > 0:
            opt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        if step < args.steps:
            bar.update()
        else:
            bar.n += 1  # shown once, by close()
        if step % args.save_every == 0 or step == args.steps:
            zs.save_checkpoint(model, opt, ckpts, step=step)
    bar.close()
    if args.compile and getattr(forward, "eager", False):
        log.warning("zeroshard.compile fell back to the eager model (see the warning above)")
    if rank == 0:
        log.info("consolidated into %s", export(args, model, tokenizer))
    dist.barrier()
    if args.sample > 0:
        model.eval()
        prompt = batch(data, 0, args, 0, args.batch)[:, :8].to(device)
        # Collective at stage 3: every rank generates, with the full weights gathered.
        with zs.gathered_parameters(model):
            out = model.generate(prompt, max_new_tokens=args.sample, do_sample=False)
        if rank == 0:
            ids = out[0].tolist()
            text = tokenizer.decode(ids) if tokenizer else bytes(ids).decode(errors="replace")
            print(f"--- greedy sample ---\n{text}\n---")
        model.train()
    return zs.full_state_dict(model)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
