"""docs/benchmarks.md opens with the summary `python -m benchmarks.summary` writes from the
run sections below it: current (a section rewritten and the summary not fails here), its
rows the sections' own figures and their quotients. Its links are checked with every
other link (test_docs_links.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from benchmarks.summary.__main__ import render
from benchmarks.summary._sections import sections

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def test_the_summary_opens_the_doc_and_is_current() -> None:
    text = DOC.read_text()
    assert text.index("<!-- ") == text.index("<!-- summary:start -->"), "not the first section"
    current = text.split("<!-- summary:start -->\n", 1)[1].split("\n<!-- summary:end -->")[0]
    assert current == render(sections(text)), "stale: python -m benchmarks.summary"


def test_the_summary_copies_and_divides_the_sections_figures() -> None:
    doc = sections(DOC.read_text())
    one = doc["train_step_1gpu"]
    changed = one.body.replace("| 57,333 | 52.6 | 48.4 |", "| 60,000 | 55.0 | 40.0 |")
    assert changed != one.body
    doc["train_step_1gpu"] = dataclasses.replace(one, body=changed)
    row = next(r for r in render(doc).splitlines() if r.startswith("| `zs3` | 60,000 |"))
    # 60,000 / floor32's 57,393 and / fsdp2's 56,112, from the same section.
    assert row.startswith("| `zs3` | 60,000 | 55.0 | 40.0 | 1.045 `floor32` | 1.069 `fsdp2` |")
