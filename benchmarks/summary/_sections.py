"""Reading docs/benchmarks.md's run sections: their tables, dates, devices and anchors."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    """One run section: its name (the markers'), heading, and text between the markers."""

    name: str
    title: str
    body: str

    @property
    def anchor(self) -> str:
        """GitHub's anchor of the section's heading."""
        return slug(self.title)

    @property
    def measured(self) -> tuple[str, str]:
        """(date, device) of its "Measured DATE on DEVICE;" line; the device without its
        host's cores and memory."""
        found = re.search(r"^Measured (\d{4}-\d{2}-\d{2}) on ([^;(]+)", self.body, re.M)
        if found is None:
            raise ValueError(f"section {self.name!r} has no 'Measured DATE on DEVICE;' line")
        return found.group(1), found.group(2).strip()

    def table(self, first: str, *, after: str | None = None, has: str = "") -> list[dict[str, str]]:
        """The rows of the first table whose header starts with column `first` and holds
        `has` (after the text `after`, if given), as {column: cell}; cells without
        backticks."""
        text = self.body if after is None else self.body.split(after, 1)[1]
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(f"| {first} |") and has in line:
                header = _cells(line)
                rows = []
                for row in lines[i + 2 :]:
                    if not row.startswith("|"):
                        break
                    rows.append(dict(zip(header, _cells(row), strict=False)))
                return rows
        raise ValueError(f"section {self.name!r} has no table with a '{first}' column first")


def _cells(line: str) -> list[str]:
    return [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def sections(doc: str) -> dict[str, Section]:
    """Every `<!-- NAME:start -->` ... `<!-- NAME:end -->` section of `doc`, by name."""
    out = {}
    for m in re.finditer(r"<!-- ([\w-]+):start -->\n(.*?)<!-- \1:end -->", doc, re.S):
        title = re.search(r"^## (.*)$", m.group(2), re.M)
        out[m.group(1)] = Section(m.group(1), title.group(1) if title else m.group(1), m.group(2))
    return out


def number(cell: str) -> float:
    """The leading number of a cell: `57,393`, `285.5 (285.4 / 285.6)`, `5.05B`, `3,709M`."""
    found = re.match(r"([\d,]+(?:\.\d+)?)\s*([BM]?)", cell)
    if found is None:
        raise ValueError(f"no number in {cell!r}")
    scale = {"": 1.0, "M": 1e6, "B": 1e9}[found.group(2)]
    return float(found.group(1).replace(",", "")) * scale
