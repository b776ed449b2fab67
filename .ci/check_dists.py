"""Check the built wheels and sdists in DIST before anyone uploads them (stdlib only).

python .ci/check_dists.py DIST

Each of the six distributions must have one wheel and one sdist whose metadata names
the Apache-2.0 license, ships the LICENSE file (the repository's, byte for byte), has
classifiers, authors and its README. The meta-distribution's sdist must ship no monorepo
files.

They are installed from a clone, not from an index: so they name no project URLs (there
is no public repository to name), and their READMEs link relatively, as links work in a
clone and on any host (tests/integration/test_docs_links.py checks every target). A
release to an index would need both: absolute links in the long description, and URLs.
"""

from __future__ import annotations

import email.message
import email.parser
import sys
import tarfile
import zipfile
from pathlib import Path

DISTRIBUTIONS = (
    "zeroshard",
    "zeroshard-comm",
    "zeroshard-partition",
    "zeroshard-ckpt",
    "zeroshard-engine",
    "zeroshard-compile",
)
REPO_ROOT = Path(__file__).resolve().parent.parent
META_SDIST_ALLOWED = {"PKG-INFO", "pyproject.toml", "README.md", "LICENSE", ".gitignore"}


def _metadata(text: str) -> email.message.Message:
    return email.parser.Parser().parsestr(text)


def _check_metadata(where: str, meta: email.message.Message, name: str) -> list[str]:
    problems = []
    if meta["Name"] != name:
        problems.append(f"Name is {meta['Name']!r}")
    if meta["License-Expression"] != "Apache-2.0":
        problems.append(f"License-Expression is {meta['License-Expression']!r}")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        problems.append("no License-File: LICENSE")
    if not meta.get_all("Classifier"):
        problems.append("no Classifier")
    if not (meta["Author"] or meta["Author-email"]):
        problems.append("no Author")
    if meta["Description-Content-Type"] != "text/markdown":
        problems.append(f"Description-Content-Type is {meta['Description-Content-Type']!r}")
    body = meta.get_payload()
    if not isinstance(body, str) or len(body) < 100:
        problems.append("no README in the long description")
    return [f"{where}: {p}" for p in problems]


def check_wheel(path: Path, name: str, license_text: bytes) -> list[str]:
    """Problems of one wheel (empty when it is fine)."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        problems = _check_metadata(path.name, _metadata(z.read(info).decode()), name)
        lic = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        if not lic or z.read(lic[0]) != license_text:
            problems.append(f"{path.name}: LICENSE missing or not the repository's")
        if name == "zeroshard-ckpt":
            entry = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
            text = z.read(entry).decode() if entry else ""
            if "zeroshard-ckpt = zeroshard.ckpt._cli:main" not in text:
                problems.append(f"{path.name}: no zeroshard-ckpt console script")
        if name == "zeroshard-engine":
            # The Lightning strategy names without an import (_zeroshard_lightning.py).
            for top in ("zeroshard_engine_lightning.pth", "_zeroshard_lightning.py"):
                if top not in names:
                    problems.append(f"{path.name}: no {top} at the top of the wheel")
    return problems


def check_sdist(path: Path, name: str, license_text: bytes) -> list[str]:
    """Problems of one sdist (empty when it is fine)."""
    with tarfile.open(path) as t:
        top = path.name.removesuffix(".tar.gz")
        members = {m.name.removeprefix(top + "/"): m for m in t.getmembers() if m.isfile()}
        pkg_info = t.extractfile(members["PKG-INFO"])
        assert pkg_info is not None
        problems = _check_metadata(path.name, _metadata(pkg_info.read().decode()), name)
        lic = t.extractfile(members["LICENSE"]) if "LICENSE" in members else None
        if lic is None or lic.read() != license_text:
            problems.append(f"{path.name}: LICENSE missing or not the repository's")
    if name == "zeroshard":
        extra = sorted(set(members) - META_SDIST_ALLOWED)
        if extra:
            problems.append(f"{path.name}: the meta sdist ships {extra[:8]}")
    elif any(m.startswith((".ci/", ".github/", "benchmarks/", "tests/")) for m in members):
        problems.append(f"{path.name}: ships monorepo files")
    return problems


def check(dist: Path) -> list[str]:
    """Problems of every distribution in `dist`."""
    license_text = (REPO_ROOT / "LICENSE").read_bytes()
    problems = []
    for name in DISTRIBUTIONS:
        stem = name.replace("-", "_")
        wheels = sorted(dist.glob(f"{stem}-*-py3-none-any.whl"))
        sdists = sorted(dist.glob(f"{stem}-*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            problems.append(f"{name}: {len(wheels)} wheels and {len(sdists)} sdists in {dist}")
            continue
        problems += check_wheel(wheels[0], name, license_text)
        problems += check_sdist(sdists[0], name, license_text)
    return problems


if __name__ == "__main__":
    found = check(Path(sys.argv[1]))
    for line in found:
        print(f"check_dists: {line}", file=sys.stderr)
    print(f"check_dists: {len(DISTRIBUTIONS)} distributions, {len(found)} problems")
    sys.exit(1 if found else 0)
