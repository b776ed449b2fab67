"""matplotlib for the benchmarks' figures, or None where it is not installed."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), or None if
    matplotlib is missing: a figure is then left out, the report still written."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return plt
