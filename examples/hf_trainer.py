"""Train a small transformers Llama with `transformers.Trainer` on zeroshard (or DDP, stage 0).

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --stage 3 \\
        --max-steps 8 --save-steps 4 --output-dir out/hf-trainer
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --stage 3 \\
        --max-steps 8 --save-steps 4 --output-dir out/hf-trainer \\
        --resume-from-checkpoint out/hf-trainer/checkpoint-4
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py \\
        --ds-config ds_config.json --max-steps 8 --save-steps 4 --output-dir out/hf-ds

The model is built from a config (no download) and trained on synthetic sequences
(each a random start and stride mod the vocabulary: learnable, and the same on any world
size). `--stage 0` is the Trainer's own DistributedDataParallel, the baseline; stages
1-3 use `zeroshard.engine.huggingface.ZeroTrainer`; `--ds-config` gives it a DeepSpeed
config instead ("auto" values filled from the Trainer's arguments and the model);
`--torch-compile BACKEND` compiles each decoder layer. gloo on CPU (or with `--cpu`),
NCCL on GPUs. OUT follows the Trainer's layout; `checkpoint-K/zeroshard/` holds
the sharded state, and the run ends with `trainer.save_model()` (full weights) and
`trainer.save_state()`.
"""

from __future__ import annotations

import argparse
import logging

import torch
import transformers
from torch.utils.data import Dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="transformers.Trainer on zeroshard, tiny Llama.")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="0 = DDP baseline")
    p.add_argument("--max-steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--save-steps", type=int, default=4, help="checkpoint every K steps")
    p.add_argument("--output-dir", required=True, help="the Trainer's output directory")
    p.add_argument("--resume-from-checkpoint", default=None, help="OUT/checkpoint-K to resume")
    p.add_argument("--per-device-batch", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="global clip; 0 = off")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (zeroshard: the engine's)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the Llama (default 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (gloo) even with GPUs")
    p.add_argument(
        "--torch-compile",
        default=None,
        metavar="BACKEND",
        help="TrainingArguments(torch_compile=True) with this backend (inductor, aot_eager...): "
        "ZeroTrainer compiles each decoder layer",
    )
    p.add_argument(
        "--ds-config",
        default=None,
        help="a DeepSpeed ds_config.json for ZeroTrainer; its zero_optimization.stage "
        "replaces --stage",
    )
    args = p.parse_args(argv)
    if args.ds_config is not None and args.stage == 0:
        p.error("--ds-config is for ZeroTrainer: not with --stage 0 (the DDP baseline)")
    if min(args.max_steps, args.save_steps, args.per_device_batch, args.grad_accum) < 1:
        p.error("--max-steps, --save-steps, --per-device-batch and --grad-accum must be positive")
    return args


VOCAB = 128


class StrideSequences(Dataset[dict[str, torch.Tensor]]):
    """Sequences `start + stride * i (mod VOCAB)`, a fixed set drawn from `seed`."""

    def __init__(self, count: int, seq_len: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (count, 1), generator=g)
        stride = torch.randint(1, 8, (count, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq_len)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(args: argparse.Namespace) -> transformers.PreTrainedModel:
    """A Llama of `--hidden` x `--layers` from a config, seeded: the same on every rank."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(args.seed)
    model: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(config)
    return model


def build_training_args(args: argparse.Namespace) -> transformers.TrainingArguments:
    """The Trainer's arguments from the command line."""
    return transformers.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=1,
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        max_grad_norm=args.max_grad_norm,
        bf16=args.bf16,
        seed=args.seed,
        use_cpu=args.cpu or not torch.cuda.is_available(),
        report_to="none",
        dataloader_num_workers=0,
        torch_compile=args.torch_compile is not None,
        torch_compile_backend=args.torch_compile,
    )


def build_trainer(
    args: argparse.Namespace, training_args: transformers.TrainingArguments
) -> transformers.Trainer:
    """The Trainer (stage 0) or a ZeroTrainer at `--stage` (or `--ds-config`), tiny Llama."""
    model = build_model(args)
    data = StrideSequences(256, args.seq_len, args.seed + 1)
    if args.stage == 0:
        return transformers.Trainer(model=model, args=training_args, train_dataset=data)
    from zeroshard.engine.huggingface import ZeroTrainer

    if args.ds_config is not None:
        return ZeroTrainer(
            model=model, args=training_args, train_dataset=data, ds_config=args.ds_config
        )
    return ZeroTrainer(
        model=model, args=training_args, train_dataset=data, zero_config={"stage": args.stage}
    )


def main(argv: list[str] | None = None) -> transformers.Trainer:
    """Train, save the model and the Trainer's state; return the Trainer."""
    args = parse_args(argv)
    training_args = build_training_args(args)
    # Before the Trainer is built: ZeroTrainer logs what a ds_config asks that it ignores.
    if training_args.process_index == 0:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    trainer = build_trainer(args, training_args)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    trainer.save_state()
    return trainer


if __name__ == "__main__":
    main()
