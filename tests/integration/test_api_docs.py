"""docs/api.md is what docs/make_api.py writes from the code: a section for every public
module (a package `__init__.py` with `__all__`) and an entry for every name of its
`__all__`, with the signature and docstring the code has now."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_api_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    assert spec is not None and spec.loader is not None
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    modules = make_api.public_modules()
    assert {"zeroshard.comm", "zeroshard.ckpt", "zeroshard.engine", "zeroshard.compile"} <= set(
        modules
    )
    written = (ROOT / "docs" / "api.md").read_text()
    for module in modules:
        for name in importlib.import_module(module).__all__:
            assert f"### `{module}.{name}`" in written, f"docs/api.md lacks {module}.{name}"
    assert written == make_api.render(), "docs/api.md is out of date: python docs/make_api.py"
