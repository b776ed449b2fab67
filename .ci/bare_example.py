"""The example end to end on the packages alone: run by `nox -s bare` after the README's install.

python .ci/bare_example.py WORKDIR

In an environment holding torch and the five packages with what they declare, nothing
else (no test dependencies, no PYTHONPATH into the clone), examples/train_gpt.py trains
at stage 3 on 2 gloo ranks under torchrun, checkpoints and writes its final weights with
safetensors' `save_file`; a second run resumes from its first checkpoint and must log
the step it resumed at and end bit-identical; `zeroshard-ckpt consolidate --verify` of
the last checkpoint must give those weights. Any "Failed to initialize NumPy" warning,
i.e. a dependency torch or safetensors needs and no package declares, fails it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY = 12, 6
TRAIN = [
    *("--stage", "3", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)),
    *("--batch", "4", "--seq-len", "32", "--eval-batches", "1", "--sample", "16"),
]
# Words in the output that mean a dependency is missing or a rank failed.
FORBIDDEN = ("Failed to initialize NumPy", "No module named", "Traceback")


def _run(cmd: list[str]) -> str:
    """Run `cmd` in the clone with no PYTHONPATH: the installed packages, not the sources."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    print(out)
    if done.returncode != 0:
        raise SystemExit(f"bare_example: {cmd[:4]} exited {done.returncode}")
    for word in FORBIDDEN:
        if word in out:
            raise SystemExit(f"bare_example: {word!r} in the output of {cmd[:4]}")
    return out


def _train(work: Path, name: str) -> str:
    out = _run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node=2", "examples/train_gpt.py", *TRAIN),
            *("--ckpt-dir", str(work / name), "--loss-log", str(work / f"{name}.log")),
            *("--final-weights", str(work / f"{name}.safetensors")),
        ]
    )
    # The progress bar's last state once (it was printed again by close()).
    done = [line for line in re.split(r"[\r\n]", out) if line.startswith("train: 100%")]
    if len(done) != 1:
        raise SystemExit(f"bare_example: the progress bar ended {len(done)} times: {done}")
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    if a.keys() != b.keys():
        raise SystemExit(f"bare_example: {what}: names differ: {sorted(a.keys() ^ b.keys())}")
    for name, t in a.items():
        if not torch.equal(t, b[name]):
            raise SystemExit(f"bare_example: {what}: {name} differs")


def _consolidated(path: Path) -> dict[str, torch.Tensor]:
    """The consolidated file's tensors, each tied alias (written once, under the
    canonical name, and listed in the metadata) restored under its own name."""
    with safe_open(str(path), framework="pt") as f:
        tied = json.loads((f.metadata() or {}).get("zeroshard.tied", "{}"))
    tensors = load_file(path)
    return {**tensors, **{alias: tensors[name] for alias, name in tied.items()}}


def main(work: Path) -> None:
    """Train, resume, consolidate; raise SystemExit naming the first thing that is wrong."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _train(work, "first")
    # The second run finds only the first checkpoint, as a job killed before the second
    # save would, and must go on from there.
    shutil.copytree(work / "first" / f"step-{SAVE_EVERY}", work / "resumed" / f"step-{SAVE_EVERY}")
    out = _train(work, "resumed")
    for line in (f"at step {SAVE_EVERY} (world size 2 then", f"step {SAVE_EVERY}: held-out loss"):
        if line not in out:
            raise SystemExit(f"bare_example: the resumed run did not log {line!r}")
    first = (work / "first.log").read_text().splitlines()
    if (work / "resumed.log").read_text().splitlines() != first[SAVE_EVERY:]:
        raise SystemExit("bare_example: the resumed run's losses differ from the first run's")
    weights = load_file(work / "resumed.safetensors")
    _same(load_file(work / "first.safetensors"), weights, "resumed vs uninterrupted weights")
    ckpt = Path(sys.executable).with_name("zeroshard-ckpt")  # the environment's command
    if not ckpt.is_file():
        raise SystemExit(f"bare_example: the zeroshard-ckpt command is not installed ({ckpt})")
    full = work / "consolidated.safetensors"
    _run([str(ckpt), "consolidate", str(work / "resumed" / f"step-{STEPS}"), str(full), "--verify"])
    _same(weights, _consolidated(full), "consolidated checkpoint vs final weights")
    print(f"bare_example: trained, resumed at step {SAVE_EVERY} and consolidated; all identical")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
