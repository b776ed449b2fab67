"""The README's Use loop runs as written, under torchrun on 2 gloo ranks, and its restart
and consolidate lines do what the README says.

The loop trains 4 epochs, checkpointing each, warning of nothing. A second run given only
the checkpoint of epoch 2 (what a job killed during epoch 3 leaves behind, its later
saves never made) resumes from it, says so in one line, logs epochs 2 and 3 with the
uninterrupted run's losses, and the README's `zeroshard-ckpt consolidate` line writes
bit-identical weights for both runs.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from zeroshard.ckpt._cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def _use_section() -> str:
    text = README.read_text()
    start = text.index("\n## Use\n")
    return text[start : text.index("\n## ", start + 1)]


def _loop() -> str:
    """The Use section's Python block."""
    found = re.search(r"```python\n(.*?)```", _use_section(), re.S)
    assert found, "README's Use section has no python block"
    return found.group(1)


def _consolidate_line() -> list[str]:
    """The Use section's `zeroshard-ckpt consolidate` command, split as a shell would."""
    lines = [ln.strip() for ln in _use_section().splitlines()]
    return shlex.split(next(ln for ln in lines if ln.startswith("zeroshard-ckpt consolidate")))


def _run(cmd: list[str], cwd: Path) -> tuple[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{cmd[:3]} exited {done.returncode}:\n{out[-4000:]}"
    return done.stdout, done.stderr


def _train(cwd: Path) -> tuple[list[str], list[str]]:
    """Run the loop under torchrun; its epoch lines, and what it logged (stderr)."""
    (cwd / "train.py").write_text(_loop())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    out, err = _run([*torchrun, "--nproc-per-node=2", "train.py"], cwd)
    return [ln for ln in out.splitlines() if ln.startswith("epoch ")], err.splitlines()


def _consolidate(cwd: Path) -> dict[str, torch.Tensor]:
    """The README's command, its paths taken in `cwd`, through the command's own `main`
    (in this process: the console script's entry point is checked by .ci/check_dists.py)."""
    name, command, src, out = _consolidate_line()
    assert (name, command) == ("zeroshard-ckpt", "consolidate")
    assert main([command, str(cwd / src), str(cwd / out), "--quiet"]) == 0
    return load_file(cwd / out)


def test_readme_loop_trains_resumes_and_consolidates(tmp_path: Path) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    lines, logged = _train(whole)
    assert [ln.split(":")[0] for ln in lines] == [f"epoch {e}" for e in range(4)], lines
    assert float(lines[-1].split()[-1]) < float(lines[0].split()[-1])  # it learns
    # A first run says it starts fresh, once, and warns of nothing (it printed a
    # UserWarning naming the missing ckpt/ on every first run).
    assert not [ln for ln in logged if "Warning" in ln], logged
    fresh = f"INFO:zeroshard.engine:resume: {whole / 'ckpt'} does not exist: starting from step 0"
    assert logged.count(fresh) == 1, logged
    shutil.copytree(whole / "ckpt" / "step-2", resumed / "ckpt" / "step-2")
    again, logged = _train(resumed)
    assert again == lines[2:]
    said = "INFO:zeroshard.engine:resumed from ckpt/step-2 at step 2 (world size 2 then, 2 now)"
    assert logged.count(said) == 1, logged
    ref, got = _consolidate(whole), _consolidate(resumed)
    assert ref.keys() == got.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, t in ref.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, got[name]), name
