"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone.

Each script owns the text between `<!-- NAME:start -->` and `<!-- NAME:end -->`; the
section always starts with the device, the versions and the command that produced it.
"""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
# Smoke runs write here (ignored by git), never over the real figures in DOC.
SMOKE_OUT = ROOT / "bench-out"
HEADER = (
    "# Benchmarks\n\n"
    "Every figure here is written by a script in `benchmarks/`; each section names the\n"
    "device, the versions and the command that produced it. Nothing is typed in by hand.\n"
)


def environment() -> str:
    """One line: date, device, torch / CUDA / Python versions, and the command line."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        device = f"{n} x {torch.cuda.get_device_name(0)}"
        cuda = f", CUDA {torch.version.cuda}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
        cuda = ""
    cmd = command()
    return (
        f"Measured {datetime.date.today().isoformat()} on {device}; torch {torch.__version__}"
        f"{cuda}, Python {platform.python_version()}. Command: `{cmd}`"
    )


def entry_point() -> list[str]:
    """How this process was started: `["-m", "benchmarks.train_step"]` for the benchmarks
    (run with `python -m` or `torchrun -m` from the repository root), or the script's path
    for a script run by its path (benchmarks/consolidate.py)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return ["-m", spec.name] if spec is not None else [sys.argv[0]]


def command() -> str:
    """The command line of this run, e.g. `-m benchmarks.train_step --model llama`."""
    head = entry_point()
    if head[0] != "-m":
        head = [Path(head[0]).name]
    return shlex.join([*head, *sys.argv[1:]])


def write_section(name: str, title: str, body: str, *, measured: str | None = None) -> None:
    """Replace (or append) section `name` of docs/benchmarks.md with `body`.

    `measured` replaces the environment line, for a report built from runs made elsewhere.
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n## {title}\n\n{measured or environment()}\n\n{body.rstrip()}\n{end}"
    text = DOC.read_text() if DOC.exists() else HEADER
    if start in text and end in text:
        before, rest = text.split(start, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def publish(name: str, title: str, body: str, *, smoke: bool, measured: str | None = None) -> None:
    """A full run replaces section `name` of docs/benchmarks.md; a smoke run writes bench-out/."""
    if smoke:
        SMOKE_OUT.mkdir(exist_ok=True)
        (SMOKE_OUT / f"{name}.md").write_text(body + "\n")
    else:
        write_section(name, title, body, measured=measured)


def init_ranks(nproc: int, *, cuda: bool) -> torch.device:
    """Relaunch this script under torchrun on `nproc` ranks unless it already is, then join
    the process group (NCCL with `cuda`, else gloo) and return this rank's device."""
    import os
    import subprocess

    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", *entry_point(), *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(1)  # ranks share the host's cores
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", local) if cuda else torch.device("cpu")
