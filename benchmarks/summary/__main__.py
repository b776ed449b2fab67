"""Write the summary that opens docs/benchmarks.md, from the run sections below it.

    python -m benchmarks.summary           # rewrite the "summary" section
    python -m benchmarks.summary --check   # exit 1 if it is not what the sections give

One table per setup (one GPU, two, one to four, Muon, fp8, CPU offload, consolidation):
each row is one engine of one run section, its figures copied and its ratios divided from
that section's own figures (`_tables.py`); the last column links the section. Nothing is
measured here, so it needs no GPU; run it after a benchmark rewrites a section it reads
(tests/integration/test_bench_summary.py fails while the summary is stale).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks._common._report import DOC, replace_section
from benchmarks.summary._sections import Section, sections
from benchmarks.summary._tables import (
    Offload,
    Step,
    consolidation_table,
    offload_table,
    scaling_table,
    step_table,
)

NAME = "summary"
INTRO = """\
## Summary

Written by `python -m benchmarks.summary` from the run sections below it: every figure is
one of theirs (the last column links it; the section names the command, the versions and
the host), every ratio the quotient of two figures of that section: speed is tokens/s, so
above 1 is faster than the engine named. The training runs compute in bf16 on random
tokens with torch's AdamW (fused on CUDA), the 1.3B presets at sequence 2048 and
micro-batch 8 per GPU, unless a table says otherwise. The floors are hand-written steps
without communication: `floor32` steps fp32 master weights as the engines do, `floorc`
compiles each block, `floorc8` also puts the blocks in fp8, `floor` keeps no master
weights. MFU: PaLM's FLOPs per token times tokens/s over 989 TFLOP/s, the fp8 runs too.
Peak: `torch.cuda.max_memory_allocated` of the largest rank."""

ONE_GPU = (
    "Eager engines against `floor32` and FSDP2 (`fsdp2`, `fully_shard` per block); compiled "
    "ones against `floorc` and FSDP2 with each block compiled (`fsdp2c`). `zs3c` is the "
    "model compiled whole by `zeroshard.compile`."
)


def _one_gpu(section: str) -> list[Step]:
    return [
        Step(section, "floor32"),
        Step(section, "floorc"),
        Step(section, "fsdp2", "floor32"),
        Step(section, "fsdp2c", "floorc"),
        Step(section, "zs2", "floor32", ("fsdp2",)),
        Step(section, "zs3", "floor32", ("fsdp2",)),
        Step(section, "zs3c", "floorc", ("fsdp2c",)),
    ]


def _muon(section: str, model: str) -> list[Step]:
    return [
        Step(section, "floor32", model=model),
        Step(section, "zs2", "floor32", ("ds2",), model),
        Step(section, "zs3", "floor32", ("ds3",), model),
        Step(section, "ds2", "floor32", model=model),
        Step(section, "ds3", "floor32", model=model),
    ]


def _fp8(section: str, model: str) -> list[Step]:
    return [
        Step(section, "floorc8", model=model),
        Step(section, "zs3c-fp8", "floorc8", model=model),
        Step(section, "zs3c-fp8g", "floorc8", model=model),
    ]


def render(doc: dict[str, Section]) -> str:
    """The summary section's text."""
    two = "train_step"
    parts = [
        INTRO,
        step_table("One GPU: GPT 1.3B", ONE_GPU, _one_gpu("train_step_1gpu"), doc),
        step_table(
            "One GPU: Llama 1.3B (examples/llama.py)",
            ONE_GPU,
            _one_gpu("train_step_llama_1gpu"),
            doc,
        ),
        step_table(
            "One GPU: transformers `LlamaForCausalLM` 1.3B",
            ONE_GPU,
            _one_gpu("train_step_hf_llama_1gpu"),
            doc,
        ),
        step_table(
            "Two GPUs: GPT 1.3B, against DDP, FSDP2 and DeepSpeed",
            "Before the engine's restructuring of 2026-11-23 (figures of commit 22a58b5); "
            "`floor` is one GPU's step of the bf16 model, without master weights.",
            [
                Step(two, "floor"),
                Step(two, "ddp", "floor"),
                Step(two, "fsdp2", "floor"),
                Step(two, "fsdp2-zero2", "floor"),
                Step(two, "ds1", "floor"),
                Step(two, "ds2", "floor"),
                Step(two, "ds3", "floor"),
                Step(two, "zs1", "floor", ("ddp", "ds1")),
                Step(two, "zs2", "floor", ("fsdp2-zero2", "ds2")),
                Step(two, "zs3", "floor", ("fsdp2", "ds3")),
            ],
            doc,
        ),
        scaling_table(
            "One to four GPUs: GPT 7B (6.66B), micro-batch 4, activation checkpointing",
            "Before the engine's restructuring of 2026-11-23. Each cell: tokens/s/GPU (its "
            "efficiency against `floor`, one GPU's bf16 step without master weights), then "
            "the peak; `zs3h`: stage 3 sharded within pairs of GPUs, replicated across. No "
            "8-GPU machine was lent.",
            doc,
            "7b",
        ),
        step_table(
            "Muon (torch's recipe: `torch.optim.Muon` on the hidden matrices, AdamW on the "
            "rest), one GPU",
            "`floor32` steps the same two optimizers on fp32 masters in one process; `ds2` "
            "and `ds3` are DeepSpeed 0.19.8's own Muon.",
            [
                *_muon("train_step_muon_1gpu", "gpt"),
                *_muon("train_step_llama_muon_1gpu", "llama"),
                *_muon("train_step_hf_llama_muon_1gpu", "hf-llama"),
            ],
            doc,
        ),
        step_table(
            "fp8 (torchao 0.18, tensorwise), one GPU, compiled",
            "`-fp8`: the blocks' linears in fp8; `-fp8g`: their weights also gathered in fp8 "
            "(at one GPU the same gather as bf16). `wide`: a GPT of d 4096, 8 layers, seq "
            "4096, micro-batch 2, 1.83B, with zeroshard's master weights and optimizer "
            "state in bf16 (`master_dtype`); FSDP2's rows are from other runs of the day.",
            [
                *_fp8("train_step_fp8_order_1gpu", "gpt"),
                Step("train_step_fp8_1gpu", "fsdp2c-fp8g", "floorc8", model="gpt"),
                *_fp8("train_step_llama_fp8_order_1gpu", "llama"),
                *_fp8("train_step_hf_llama_fp8_order_1gpu", "hf-llama"),
                Step("train_step_wide_fp8_bf16_masters_again_1gpu", "floorc", model="wide"),
                Step(
                    "train_step_wide_fp8_bf16_masters_again_1gpu",
                    "zs3c",
                    "floorc",
                    model="wide",
                ),
                *_fp8("train_step_wide_fp8_bf16_masters_again_1gpu", "wide"),
                Step("train_step_wide_fp8_1gpu", "fsdp2c-fp8g", "floorc8", model="wide"),
            ],
            doc,
        ),
        offload_table(
            "CPU offload, one GPU: GPTs of the 7B preset's width",
            "Optimizer state and fp32 masters on the host, stepped there by "
            "`offload_compiled_step`; 5.05B is the largest DeepSpeed ZeRO-Offload's host "
            "memory held. AdamW alone: torch's fused AdamW on the host's CPU over as many "
            "parameters, the step's floor.",
            [
                Offload(
                    "offload-ratio-deepspeed",
                    "zeroshard offload_optimizer, step_in_backward, compiled_step (stage 2)",
                    deepspeed="DeepSpeed ZeRO-Offload (stage 2)",
                ),
                Offload(
                    "offload-ratio-deepspeed",
                    "zeroshard offload_optimizer, offload_ratio 0.7, step_in_backward, "
                    "compiled_step (stage 2)",
                    deepspeed="DeepSpeed ZeRO-Offload (stage 2)",
                ),
                Offload("offload-ratio-deepspeed", "DeepSpeed ZeRO-Offload (stage 2)"),
                Offload(
                    "offload-modes",
                    "zeroshard offload_optimizer, compiled_step (stage 2)",
                    adamw=True,
                ),
                Offload(
                    "offload-modes",
                    "zeroshard offload_optimizer, step_in_backward, compiled_step (stage 2)",
                    adamw=True,
                ),
                Offload(
                    "offload-modes",
                    "zeroshard offload_optimizer, delay_param_update, compiled_step (stage 2)",
                    adamw=True,
                ),
            ],
            doc,
        ),
        consolidation_table(
            "Consolidating a checkpoint into safetensors (1.3B GPT, 2 CPU ranks)",
            "Cold: inputs evicted from the page cache; warm: read just before. Outputs "
            "bit-identical to the framework's own tool's.",
            doc,
        ),
        "Also below: Lightning's Trainer against the plain loop (`lightning`), fp8 and "
        "bf16 loss curves on real text (`float8_loss`), the engine before and after its "
        "restructuring (`arch-before-after`), flattening tiers, leaf-module fetch, and the "
        "runs each table above was chosen from. The run sections follow, in the order "
        "they were first written.",
    ]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with --check, compare) the summary section of docs/benchmarks.md."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the summary is stale")
    args = p.parse_args(argv)
    text = DOC.read_text()
    want = render(sections(text))
    start, end = f"<!-- {NAME}:start -->", f"<!-- {NAME}:end -->"
    if args.check:
        current = text.split(start, 1)[1].split(end, 1)[0].strip() if start in text else ""
        if current != want:
            print(f"{DOC} summary is stale: python -m benchmarks.summary", file=sys.stderr)
            return 1
        return 0
    if start not in text:
        # Opens the doc: after its introduction, before the first run section.
        first = text.index("<!-- ")
        DOC.write_text(f"{text[:first]}{start}\n{end}\n\n{text[first:]}")
    replace_section(DOC, NAME, want)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
