"""Every install line and link of the docs works from a clone.

Install lines are the `pip install ...` commands of every markdown file and of the
strings of the Python a user reads (packages/, examples/, benchmarks/). Nothing of
zeroshard is on the package index, so each zeroshard package is named by its path in
the clone: the path must exist, an extra must be one the package declares, and the line
must name every sibling the package pins (pip finds them only among the paths it is
given). Links are the markdown links and images: a relative target must exist, and an
anchor must be a heading of its file (GitHub's anchors); no file names the repository
URL `github.com/zeroshard/...`, which does not exist.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
# Options of `pip install` whose value is not a requirement.
_VALUED = {"-r", "-c", "-f", "-i", "-t", "--requirement", "--constraint", "--find-links"}
_VALUED |= {"--index-url", "--extra-index-url", "--target", "--prefix", "--root"}
_EDITABLE = {"-e", "--editable"}
_STOP = {"&&", "||", ";", "|", "(", ")"}
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DEAD_HOST = "github.com/zeroshard"


@dataclass(frozen=True)
class Package:
    """A package of the clone, as its pyproject.toml declares it."""

    name: str
    siblings: frozenset[str]  # the zeroshard distributions it pins
    extras: frozenset[str]


def _package(directory: Path) -> Package | None:
    pyproject = directory / "pyproject.toml"
    if not pyproject.is_file():
        return None
    project = tomllib.loads(pyproject.read_text())["project"]
    names = {re.split(r"[^A-Za-z0-9._-]", d, maxsplit=1)[0] for d in project["dependencies"]}
    return Package(
        project["name"],
        frozenset(n for n in names if n.startswith("zeroshard")),
        frozenset(project.get("optional-dependencies", {})),
    )


def _files(under: Path, suffix: str) -> list[Path]:
    """The files of the clone under `under` ending in `suffix`: git's (tracked, or new and
    not ignored: no smoke run's bench-out/), else every one outside hidden folders."""
    git = shutil.which("git")
    if git is not None and (ROOT / ".git").exists():
        listed = subprocess.run(
            [git, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", under],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return sorted(ROOT / f for f in set(listed.split("\0")) if f.endswith(suffix))
    found = []
    for folder, dirs, files in os.walk(under):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found += [Path(folder) / f for f in files if f.endswith(suffix)]
    return sorted(found)


def _markdown() -> list[Path]:
    return _files(ROOT, ".md")


def _prose(text: str) -> str:
    """`text` with fenced code blocks blanked (links there are code, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def install_commands(text: str) -> list[str]:
    """The argument strings of the `pip install` commands in `text`."""
    text = re.sub(r"\\\n\s*", " ", text)  # a shell line continued
    return [m.group(1) for m in re.finditer(r"pip install ([^`\n]*)", text)]


def install_problems(args: str, where: str) -> list[str]:
    """What is wrong with one `pip install` line, run from the clone's root."""
    try:
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError as e:
        return [f"{where}: `pip install {args}` does not parse: {e}"]
    problems: list[str] = []
    named: dict[str, Package] = {}
    it = iter(tokens)
    for token in it:
        if token in _STOP:
            break
        if token in _VALUED:
            next(it, None)
            continue
        if token in _EDITABLE:
            token = next(it, "")
        elif token.startswith("-"):
            continue
        spec = re.fullmatch(r"([^\[\]]+)(?:\[([^\]]*)\])?", token)
        if spec is None:
            problems.append(f"{where}: {token!r} is no requirement")
            continue
        target, extras = spec.group(1), spec.group(2)
        if "/" not in target and not target.startswith("."):
            if target.lower().startswith("zeroshard"):
                problems.append(
                    f"{where}: {token!r} is not on the package index; name its path in the "
                    "clone (./packages/<name>)"
                )
            continue
        dirs = [Path(p) for p in sorted(glob.glob(str(ROOT / target)))]
        packages = [(d, _package(d)) for d in dirs]
        if not packages or any(p is None for _, p in packages):
            problems.append(f"{where}: {target!r} is no package directory of the clone")
            continue
        for d, package in packages:
            assert package is not None
            named[package.name] = package
            wanted = set(filter(None, (e.strip() for e in (extras or "").split(","))))
            for extra in sorted(wanted - package.extras):
                problems.append(
                    f"{where}: {package.name} ({d.relative_to(ROOT)}) declares no extra "
                    f"{extra!r} (it declares {sorted(package.extras)})"
                )
    for package in named.values():
        missing = sorted(package.siblings - set(named))
        if missing:
            problems.append(
                f"{where}: `pip install {args}` names {package.name} without {missing}, "
                "which it pins: pip would look for them on the package index"
            )
    return problems


def _headings(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    anchors: set[str] = set()
    for line in _prose(path.read_text()).splitlines():
        found = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not found:
            continue
        slug = re.sub(r"[^\w\- ]", "", found.group(1).lower()).replace(" ", "-")
        anchor, n = slug, 1
        while anchor in anchors:
            anchor, n = f"{slug}-{n}", n + 1
        anchors.add(anchor)
    return anchors


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """The links of one markdown file whose target or anchor does not exist."""
    problems = []
    prose = re.sub(r"`[^`\n]*`", "", _prose(path.read_text()))  # not in code spans
    where = path.relative_to(root)
    for target in _LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            problems.append(f"{where}: link {target!r}: {file} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in _headings(resolved):
            problems.append(f"{where}: link {target!r}: no heading #{anchor} in {file or where}")
    return problems


def _python_files() -> list[Path]:
    return [p for d in ("packages", "examples", "benchmarks") for p in _files(ROOT / d, ".py")]


def _texts(path: Path) -> list[str]:
    """A markdown file's text; a Python file's strings (docstrings, messages)."""
    if path.suffix == ".md":
        return [path.read_text()]
    tree = ast.parse(path.read_text())
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_install_lines_work_from_a_clone() -> None:
    problems, seen = [], 0
    for path in [*_markdown(), *_python_files()]:
        where = str(path.relative_to(ROOT))
        for args in (a for text in _texts(path) for a in install_commands(text)):
            seen += 1
            problems += install_problems(args, where)
        text = path.read_text()
        if path.suffix == ".md":
            for m in re.finditer(r"zeroshard(?:-[a-z]+)?\[[a-z0-9,]+\]", text):
                problems.append(f"{where}: {m.group(0)} names an extra of the package index")
    assert seen >= 10, f"found only {seen} install lines: the scan is broken"
    assert not problems, "\n".join(problems)


def test_links_resolve_in_the_clone() -> None:
    problems, seen = [], 0
    for path in _markdown():
        seen += len(_LINK.findall(_prose(path.read_text())))
        problems += link_problems(path)
    assert seen >= 50, f"found only {seen} links: the scan is broken"
    for path in [*_markdown(), *_files(ROOT, "pyproject.toml"), *_python_files()]:
        if _DEAD_HOST in path.read_text():
            problems.append(f"{path.relative_to(ROOT)} names {_DEAD_HOST}, which does not exist")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("line", "wrong"),
    [
        ('"zeroshard-engine[hf]"', "not on the package index"),
        ("-e packages/engine", "without ['zeroshard-ckpt', 'zeroshard-comm', 'zeroshard-par"),
        ('./packages/* "./packages/engine[hff]"', "declares no extra 'hff'"),
        ("./packages/nothing", "no package directory"),
    ],
)
def test_the_install_check_finds_what_fails(line: str, wrong: str) -> None:
    assert any(wrong in p for p in install_problems(line, "here")), install_problems(line, "x")


def test_the_link_check_finds_what_fails(tmp_path: Path) -> None:
    (tmp_path / "index.md").write_text("## One\n\n## One\n")
    doc = tmp_path / "doc.md"
    links = "[a](index.md#one-1) [b](nowhere.md) [c](#a-title-here) [d](#no) [e](index.md#two)"
    doc.write_text(f"# A `title`, here\n\n{links} `[f](not-a-link.md)`\n")
    assert link_problems(doc, tmp_path) == [
        "doc.md: link 'nowhere.md': nowhere.md does not exist",
        "doc.md: link '#no': no heading #no in doc.md",
        "doc.md: link 'index.md#two': no heading #two in index.md",
    ]


def test_what_the_docs_write_in_the_clone_is_ignored() -> None:
    """The checkpoints and weights the README's and getting-started's commands write in
    the clone's root are not left as untracked files (`ckpt/` was)."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git clone")
    written: set[str] = set()
    for path in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        text = path.read_text()
        written |= set(re.findall(r"--ckpt-dir (\S+)", text))
        written |= set(re.findall(r"resume_checkpoint\(model, optimizer, \"(\w+)\"\)", text))
        for pair in re.findall(r"^ +zeroshard-ckpt consolidate (\S+) (\S+)", text, re.M):
            written |= set(pair)
    assert {"ckpt", "gpt.safetensors", "model.safetensors"} <= written, written
    for name in sorted(written):
        check = [git, "check-ignore", "-q", "--no-index", name]
        assert subprocess.run(check, cwd=ROOT).returncode == 0, f"{name} is not in .gitignore"
