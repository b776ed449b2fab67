"""`zeroshard-ckpt consolidate` on DeepSpeed checkpoints, end to end, against zero_to_fp32.

The references are DeepSpeed's own consolidations of the fixtures (see make_fixtures.py).
Our output holds each tied tensor once, under the name that owns the data, and lists the
alias in the safetensors metadata (`zeroshard.tied`), as Hugging Face loaders expect.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.ckpt._ds import digest
from zeroshard.ckpt import consolidate, describe
from zeroshard.ckpt._cli import main
from zeroshard.ckpt.foreign._unpickle import load_torch_file

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
CASES = ["stage1", "stage1_bf16", "stage2", "stage3", "stage3_w3", "stage2_fp16", "stage3_fp16"]
FROZEN = {"frozen.weight", "frozen.bias", "spare.empty"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _load_with_tied(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as h:
        tied = json.loads((h.metadata() or {}).get("zeroshard.tied", "{}"))
    return load_file(path), tied


@pytest.mark.parametrize(
    "case,flag",
    [(case, "fp32") for case in CASES]
    + [("stage3", "bf16"), ("stage2_fp16", "fp16"), ("stage1_bf16", "fp16")],
)
def test_consolidate_equals_zero_to_fp32(case: str, flag: str, tmp_path: Path) -> None:
    # The reference is what DeepSpeed's converter writes with dtype=flag (fp32 is both
    # its default and ours): every floating tensor in that dtype, frozen ones included.
    root = FIXTURES / case
    out = tmp_path / "out"
    argv = ["consolidate", str(root), str(out), "--quiet", "--workers", "2"]
    assert main(argv + ([] if flag == "fp32" else ["--dtype", flag])) == 0
    got, tied = _load_with_tied(out / "model.safetensors")
    meta = json.loads((root / "reference.json").read_text())
    want, shared = meta["converted"][flag], meta["shared"]

    assert tied == shared
    assert set(got) == set(want) - set(shared)  # each tied tensor once
    for name, expected in want.items():
        assert digest(got[shared.get(name, name)]) == expected, name


@pytest.mark.parametrize("case", ["stage2", "stage3_w3"])
def test_consolidate_exclude_frozen(case: str, tmp_path: Path) -> None:
    # The frozen layer and the zero-element frozen parameter go; everything else is
    # zero_to_fp32's output, bit for bit; inspect still counts the frozen parameters.
    root = FIXTURES / case
    out = tmp_path / "lean.safetensors"
    argv = ["consolidate", str(root), str(out), "--exclude-frozen", "--quiet"]
    assert main(argv) == 0
    got, tied = _load_with_tied(out)
    want = load_file(root / "reference.safetensors")
    shared = json.loads((root / "reference.json").read_text())["shared"]
    assert set(want) - set(shared) - set(got) == FROZEN
    assert set(got) < set(want) and tied == shared
    for name, actual in got.items():
        assert torch.equal(_bits(actual), _bits(want[name])), name
    assert describe(root).frozen == len(FROZEN)


def test_consolidate_refuses_a_malicious_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage2", root)
    target = root / "global_step2" / "mp_rank_00_model_states.pt"
    state = load_torch_file(target, mmap=False)
    marker = tmp_path / "pwned"
    state["client_state"] = _Touch(str(marker))
    torch.save(state, target)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "zeroshard.ckpt._cli", "consolidate", str(root), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 1, proc.stderr
    assert "refused to unpickle" in proc.stderr and "posix.system" in proc.stderr
    assert not marker.exists()
    assert not out.exists()


class _Touch:
    """Unpickling this runs `touch PATH` through os.system."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def test_consolidate_names_a_missing_rank_file(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage3", root)
    (root / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        consolidate(root, tmp_path / "out")
    assert main(["consolidate", str(root), str(tmp_path / "out2"), "--quiet"]) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_consolidate_summary_and_buffer_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = FIXTURES / "stage3_w3"
    out = tmp_path / "m.safetensors"
    argv = ["consolidate", str(root), str(out), "--workers", "4", "--max-buffer-memory", "4KiB"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    m = re.fullmatch(
        r"wrote (\d+) tensors, ([\d.]+) GB in 1 safetensors file\(s\) to (\S+) in [\d.]+ s "
        r"\([\d.]+ GB/s; buffers peaked at ([\d.]+) MiB\)",
        line,
    )
    assert m, line
    want = load_file(root / "reference.safetensors")
    data = sum(t.numel() * t.element_size() for k, t in want.items() if k != "head.weight")
    assert int(m[1]) == len(want) - 1 and m[3] == str(out)
    assert abs(float(m[2]) * 1e9 - data) < 1e6  # printed in GB with 3 decimals
    assert float(m[4]) * 2**20 <= 4096 + 0.05 * 2**20  # the largest tensor is < 4 KiB
    assert main([*argv[:2], str(tmp_path / "x"), "--max-buffer-memory", "0"]) == 1
    assert "size must be positive" in capsys.readouterr().err
