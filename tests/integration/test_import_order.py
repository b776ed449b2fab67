"""Imports point one way: between the packages, and between the engine's parts.

Packages: comm <- partition <- ckpt <- engine <- compile (a package imports only those
before it), no package imports another's underscore (private) modules, and compile
reaches the engine through its public face only (and ckpt's `foreign/` folder is reached
through its face, from other packages through ckpt's). The engine's
parts (docs/design.md, "The engine's folders"): each imports only the parts
`ENGINE_PARTS` allows, none imports the public face `zeroshard.engine`, and the top level
holds nothing but that face. Every import counts: at module level, inside a function or
under TYPE_CHECKING. Files are parsed (`ast`), not imported.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["comm", "partition", "ckpt", "engine", "compile"]
ENGINE = ROOT / "packages" / "engine" / "src" / "zeroshard" / "engine"
# What each part of the engine may import of the others.
ENGINE_PARTS: dict[str, set[str]] = {
    "config": set(),
    "runtime": {"config"},
    "state": {"config", "runtime"},
    "setup": {"config", "runtime", "state"},
    "planner": {"config", "runtime"},
    "recovery": {"config", "runtime", "state"},
    "huggingface": {"config", "runtime", "state", "setup"},
    "lightning": {"config", "runtime", "state", "setup"},
}
# Integrations that may take from the other parts only what the public face exports.
PUBLIC_ONLY = ("lightning",)


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            name = "." * node.level + (node.module or "")
            yield node.lineno, importlib.util.resolve_name(name, package)


def _part_of(module: str) -> str | None:
    """The first name of `module` under zeroshard.engine ('' for zeroshard.engine itself),
    None outside the engine."""
    names = module.split(".")
    if names[:2] != ["zeroshard", "engine"]:
        return None
    return names[2] if len(names) > 2 else ""


def package_violations(root: Path) -> list[str]:
    """Imports under `root`/packages that point up the package order, into another
    package's private modules, or into the engine's parts from another package."""
    out = []
    for rank, name in enumerate(PACKAGES):
        src = root / "packages" / name / "src"
        for path in sorted(src.rglob("*.py")):
            module = _module_name(path, src)
            for line, imported in _imports(path, module):
                names = imported.split(".")
                if names[0] != "zeroshard" or len(names) < 2 or names[1] not in PACKAGES:
                    continue
                where = f"{path.relative_to(root)}:{line}"
                if PACKAGES.index(names[1]) > rank:
                    out.append(f"{where}: {name} imports {imported}, above it")
                elif names[1] != name and any(part.startswith("_") for part in names[2:]):
                    out.append(
                        f"{where}: {imported} is private to {names[1]}; import its public "
                        f"names from zeroshard.{names[1]}"
                    )
                elif name != "engine" and names[1] == "engine" and len(names) > 2:
                    out.append(f"{where}: {imported} is inside the engine; import zeroshard.engine")
    return out


def foreign_violations(root: Path) -> list[str]:
    """Imports of ckpt's `foreign/` folder (other formats) past its face: ckpt's other
    modules take its face's names, other packages take ckpt's public face."""
    src = root / "packages" / "ckpt" / "src"
    foreign = src / "zeroshard" / "ckpt" / "foreign"
    out = []
    for path in sorted((root / "packages").glob("*/src/zeroshard/**/*.py")):
        pkg_src = root / "packages" / path.relative_to(root / "packages").parts[0] / "src"
        module = _module_name(path, pkg_src)
        for line, imported in _imports(path, module):
            names = imported.split(".")
            if names[:3] != ["zeroshard", "ckpt", "foreign"] or foreign in path.parents:
                continue
            where = f"{path.relative_to(root)}:{line}"
            if pkg_src != src:
                out.append(f"{where}: {imported} is inside ckpt; import zeroshard.ckpt")
            elif len(names) > 3:
                out.append(f"{where}: {imported} is past foreign/'s face")
    return out


def engine_violations(engine: Path) -> list[str]:
    """Modules of the engine outside its parts, and imports between parts not allowed."""
    src = engine.parents[1]
    out = []
    for path in sorted(engine.rglob("*.py")):
        where = str(path.relative_to(src))
        inside = path.relative_to(engine).parts
        if len(inside) == 1:
            if path.name != "__init__.py":
                out.append(f"{where}: only the public face (__init__.py) lives at the top level")
            continue
        part = inside[0]
        if part not in ENGINE_PARTS:
            out.append(f"{where}: {part}/ is not one of the engine's parts {sorted(ENGINE_PARTS)}")
            continue
        for line, imported in _imports(path, _module_name(path, src)):
            target = _part_of(imported)
            if target is None or target == part or target in ENGINE_PARTS[part]:
                continue
            if target in ENGINE_PARTS:
                out.append(f"{where}:{line}: {part} imports {imported}, not allowed to it")
            else:
                out.append(f"{where}:{line}: a part imports the engine's top level {imported}")
    return out


# The runtime's feature folders: the rest of the engine reaches each through its face (its
# `__init__.py`) alone, and the runtime's core (the modules directly in runtime/) never
# imports them: they build on the core's seams (docs/design.md, "The engine's folders").
FEATURES = ("offload", "whole")


def feature_violations(engine: Path) -> list[str]:
    """Imports of a feature folder's private modules from outside it, and imports of a
    feature folder from the runtime's core."""
    src = engine.parents[1]
    runtime = engine / "runtime"
    out = []
    for path in sorted(engine.rglob("*.py")):
        inside = path.relative_to(runtime).parts if path.is_relative_to(runtime) else ()
        home = inside[0] if len(inside) > 1 else None
        core = len(inside) == 1
        for line, imported in _imports(path, _module_name(path, src)):
            names = imported.split(".")
            if names[:3] != ["zeroshard", "engine", "runtime"] or len(names) < 4:
                continue
            feature = names[3]
            if feature not in FEATURES or feature == home:
                continue
            where = f"{path.relative_to(src)}:{line}"
            if core:
                out.append(f"{where}: the runtime's core imports {imported}, a feature folder")
            elif len(names) > 4:
                out.append(
                    f"{where}: {imported} is private to runtime/{feature}/; import its face "
                    f"zeroshard.engine.runtime.{feature}"
                )
    return out


def public_names(engine: Path) -> set[str]:
    """The names in the public face's `__all__` (parsed, not imported)."""
    tree = ast.parse((engine / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {
                str(ast.literal_eval(e))
                for e in ast.walk(node.value)
                if isinstance(e, ast.Constant)
            }
    return set()


def private_name_violations(engine: Path, part: str) -> list[str]:
    """Names `part` imports from the engine's other parts that the public face does not
    export."""
    public = public_names(engine)
    src = engine.parents[1]
    out = []
    for path in sorted((engine / part).rglob("*.py")):
        module = _module_name(path, src)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            imported = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            target = _part_of(imported)
            if target is None or target == part:
                continue
            for alias in node.names:
                if alias.name not in public:
                    where = f"{path.relative_to(src)}:{node.lineno}"
                    out.append(f"{where}: {part} imports {alias.name} from {imported}, not public")
    return out


def test_packages_import_downward_only() -> None:
    assert package_violations(ROOT) == []


def test_foreign_formats_are_reached_through_their_face() -> None:
    assert foreign_violations(ROOT) == []


def test_engine_parts_import_in_order() -> None:
    assert engine_violations(ENGINE) == []


def test_feature_folders_are_reached_through_their_faces() -> None:
    assert feature_violations(ENGINE) == []


def test_a_feature_import_is_reported(tmp_path: Path) -> None:
    """The core importing a feature's face, the planner a feature's private module, and a
    feature another's private module are reported; a feature's own modules and the faces
    from setup are not."""
    runtime = tmp_path / "zeroshard" / "engine" / "runtime"
    for folder, text in {
        runtime: "from zeroshard.engine.runtime.offload import HostOffload\n",
        runtime / "offload": "from zeroshard.engine.runtime.offload._io import host_tensor\n",
        runtime / "whole": "from zeroshard.engine.runtime.offload._plan import GRAD_STAGING\n",
        runtime.parent / "planner": "from zeroshard.engine.runtime.whole._owners import x\n",
        runtime.parent / "setup": "from zeroshard.engine.runtime.whole import WholeMatrices\n",
    }.items():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "_x.py").write_text(text)
    assert feature_violations(runtime.parent) == [
        "zeroshard/engine/planner/_x.py:1: zeroshard.engine.runtime.whole._owners is private "
        "to runtime/whole/; import its face zeroshard.engine.runtime.whole",
        "zeroshard/engine/runtime/_x.py:1: the runtime's core imports "
        "zeroshard.engine.runtime.offload, a feature folder",
        "zeroshard/engine/runtime/whole/_x.py:1: zeroshard.engine.runtime.offload._plan is "
        "private to runtime/offload/; import its face zeroshard.engine.runtime.offload",
    ]


def test_integrations_use_public_names_only() -> None:
    for part in PUBLIC_ONLY:
        assert private_name_violations(ENGINE, part) == []


def test_an_upward_import_is_reported(tmp_path: Path) -> None:
    """The checks see what they are there to see: a runtime module importing the state, a
    part importing the face, config importing the runtime (relatively), a module at the
    top level, ckpt importing the engine, compile importing a part, the engine importing
    a private module of ckpt (at module level and inside a function)."""
    engine = tmp_path / "packages" / "engine" / "src" / "zeroshard" / "engine"
    for part, text in {
        "runtime": "from zeroshard.engine.state._masters import gather_masters\n",
        "planner": "def f():\n    from zeroshard.engine import initialize\n",
        "config": "from ..runtime._unit import Unit\n",
    }.items():
        (engine / part).mkdir(parents=True)
        (engine / part / "__init__.py").write_text("")
        (engine / part / "_x.py").write_text(text)
    (engine / "__init__.py").write_text("from zeroshard.engine.planner._x import f\n")
    (engine / "_stray.py").write_text("")
    compile_src = tmp_path / "packages" / "compile" / "src" / "zeroshard" / "compile"
    compile_src.mkdir(parents=True)
    (compile_src / "_y.py").write_text("from zeroshard.engine.runtime._stats import EngineStats\n")
    ckpt_src = tmp_path / "packages" / "ckpt" / "src" / "zeroshard" / "ckpt"
    ckpt_src.mkdir(parents=True)
    (ckpt_src / "_z.py").write_text("import zeroshard.engine\n")
    state = tmp_path / "packages" / "engine" / "src" / "zeroshard" / "engine" / "state"
    state.mkdir(parents=True)
    (state / "_w.py").write_text(
        "from zeroshard.ckpt._meta import MASTER\n"
        "from zeroshard.ckpt import load\n"
        "def f():\n    import zeroshard.comm._group\n"
        "from zeroshard.ckpt.foreign import dcp_specs\n"
    )
    (ckpt_src / "_v.py").write_text("from zeroshard.ckpt.foreign._dcp import dcp_specs\n")
    (ckpt_src / "foreign").mkdir()
    (ckpt_src / "foreign" / "_u.py").write_text("from zeroshard.ckpt.foreign._dcp import X\n")

    assert engine_violations(engine) == [
        "zeroshard/engine/_stray.py: only the public face (__init__.py) lives at the top level",
        "zeroshard/engine/config/_x.py:1: config imports zeroshard.engine.runtime._unit, "
        "not allowed to it",
        "zeroshard/engine/planner/_x.py:2: a part imports the engine's top level zeroshard.engine",
        "zeroshard/engine/runtime/_x.py:1: runtime imports zeroshard.engine.state._masters, "
        "not allowed to it",
    ]
    assert package_violations(tmp_path) == [
        "packages/ckpt/src/zeroshard/ckpt/_z.py:1: ckpt imports zeroshard.engine, above it",
        "packages/engine/src/zeroshard/engine/state/_w.py:1: zeroshard.ckpt._meta is private "
        "to ckpt; import its public names from zeroshard.ckpt",
        "packages/engine/src/zeroshard/engine/state/_w.py:4: zeroshard.comm._group is private "
        "to comm; import its public names from zeroshard.comm",
        "packages/compile/src/zeroshard/compile/_y.py:1: zeroshard.engine.runtime._stats is "
        "private to engine; import its public names from zeroshard.engine",
    ]
    assert foreign_violations(tmp_path) == [
        "packages/ckpt/src/zeroshard/ckpt/_v.py:1: zeroshard.ckpt.foreign._dcp is past "
        "foreign/'s face",
        "packages/engine/src/zeroshard/engine/state/_w.py:5: zeroshard.ckpt.foreign is inside "
        "ckpt; import zeroshard.ckpt",
    ]
