"""Write a benchmark's section of a generated doc, leaving the other sections alone.

Each benchmark owns the text between `<!-- NAME:start -->` and `<!-- NAME:end -->` of
docs/benchmarks.md; the section always starts with the device, the versions, zeroshard's
commit and the command that produced it. Smoke runs write bench-out/NAME.md instead, never
over the real figures.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
# The committed JSON of GPU runs that the report-only benchmarks (scaling, plan_validation) read.
RESULTS = ROOT / "benchmarks" / "results"
# Smoke runs write here (ignored by git), never over the real figures in DOC.
SMOKE_OUT = ROOT / "bench-out"
HEADER = (
    "# Benchmarks\n\n"
    "Every figure here is written by a benchmark in `benchmarks/` (see its README); each\n"
    "section names the host, the versions and the command that produced it. Nothing is\n"
    "typed in by hand. Benchmarks that start ranks put them on GPUs over NCCL only where the\n"
    "host has a GPU for every rank, else on the CPU over gloo; their first line says which.\n"
)


def host() -> str:
    """The machine: its GPUs (or its CPU), cores and memory, e.g.
    `1 x NVIDIA H100 80GB HBM3 (host: 16 cores, 125 GiB)`."""
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    machine = f"host: {cores} cores, {memory:.0f} GiB"
    gpus = torch.cuda.device_count()
    if gpus:
        return f"{gpus} x {torch.cuda.get_device_name(0)} ({machine})"
    return f"CPU ({platform.processor() or platform.machine()}; {machine})"


def _git(*args: str) -> str:
    """What `git ARGS` prints in the repository (raises where git or a checkout is missing)."""
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def code_version() -> str:
    """zeroshard's commit, "with uncommitted changes" where tracked files differ from it."""
    try:
        commit = _git("rev-parse", "--short=12", "HEAD")
        # Tracked files that differ from it: the tree measured is not that commit's.
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        commit, changed = "unknown (not a git checkout)", ""
    return f"zeroshard commit {commit}" + (" with uncommitted changes" if changed else "")


def environment(ranks: str | None = None) -> str:
    """One line: date, host, torch / CUDA / Python versions, where the ranks ran (`ranks`,
    from `Placement.describe`, for benchmarks that start ranks), the code and the command
    line."""
    cuda = f", CUDA {torch.version.cuda}" if torch.cuda.device_count() else ""
    where = f" Ranks: {ranks}." if ranks else ""
    return (
        f"Measured {datetime.date.today().isoformat()} on {host()}; torch {torch.__version__}"
        f"{cuda}, Python {platform.python_version()}.{where} Code: {code_version()}. "
        f"Command: `{command()}`"
    )


def entry_point() -> list[str]:
    """How this process was started: `["-m", "benchmarks.train_step"]` for a benchmark run
    with `python -m` or `torchrun -m` from the repository root (its package's `__main__`),
    or the script's path for a script run by its path."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:
        return [sys.argv[0]]
    return ["-m", spec.name.removesuffix(".__main__")]


def command() -> str:
    """The command line of this run, e.g. `-m benchmarks.train_step --model llama`."""
    head = entry_point()
    if head[0] != "-m":
        head = [Path(head[0]).name]
    return shlex.join([*head, *sys.argv[1:]])


def replace_section(doc: Path, name: str, text: str) -> None:
    """Put `text` between `<!-- name:start -->` and `<!-- name:end -->` of `doc` (appended
    with its markers if the doc has none; the doc is made, with HEADER, if missing)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.rstrip()}\n{end}"
    current = doc.read_text() if doc.exists() else HEADER
    if start in current and end in current:
        before, rest = current.split(start, 1)
        _, after = rest.split(end, 1)
        current = before + block + after
    else:
        current = current.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(current)


def write_section(
    name: str, title: str, body: str, *, measured: str | None = None, ranks: str | None = None
) -> None:
    """Replace (or append) section `name` of docs/benchmarks.md: title, environment, `body`.

    `measured` replaces the environment line, for a report built from runs made elsewhere;
    `ranks` says where the ranks ran.
    """
    replace_section(DOC, name, f"## {title}\n\n{measured or environment(ranks)}\n\n{body}")


def publish(
    name: str,
    title: str,
    body: str,
    *,
    smoke: bool,
    measured: str | None = None,
    ranks: str | None = None,
) -> None:
    """A full run replaces section `name` of docs/benchmarks.md; a smoke run writes
    bench-out/NAME.md, its environment line included (so it says where the ranks ran)."""
    if smoke:
        SMOKE_OUT.mkdir(exist_ok=True)
        text = f"{measured or environment(ranks)}\n\n{body}\n"
        (SMOKE_OUT / f"{name}.md").write_text(text)
    else:
        write_section(name, title, body, measured=measured, ranks=ranks)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
