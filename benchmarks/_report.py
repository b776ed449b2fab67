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

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "Every figure here is written by a script in `benchmarks/`; each section names the\n"
    "device, the versions and the command that produced it. Nothing is typed in by hand.\n"
)


def environment() -> str:
    """One line: date, device, torch / CUDA / Python versions, and the command line."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        device = f"{n} x {torch.cuda.get_device_name(0)}"
        cuda = f", CUDA {torch.version.cuda}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
        cuda = ""
    cmd = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    return (
        f"Measured {datetime.date.today().isoformat()} on {device}; torch {torch.__version__}"
        f"{cuda}, Python {platform.python_version()}. Command: `{cmd}`"
    )


def write_section(name: str, title: str, body: str) -> None:
    """Replace (or append) section `name` of docs/benchmarks.md with `body`."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n## {title}\n\n{environment()}\n\n{body.rstrip()}\n{end}"
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
