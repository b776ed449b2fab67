"""Every way to test, type-check, lint, demo and benchmark zeroshard.

Sessions install `torch==2.13.0` first: a CPU build that satisfies every package's
`torch>=2.6`, so nothing else pulls a multi-gigabyte CUDA build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "typecheck", "lint"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
PACKAGES = ["comm", "partition", "ckpt", "engine", "compile"]
EDITABLE = [arg for p in PACKAGES for arg in ("-e", f"packages/{p}")]
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "numpy", "matplotlib"]
# The versions tests/integration/test_hf_*.py and zeroshard.engine.huggingface are checked with.
HF_DEPS = ["transformers==5.23.0", "accelerate==1.15.0"]
# The version tests/integration/test_lightning.py and zeroshard.engine.lightning are checked with.
LIGHTNING = "lightning==2.6.6"
# The version the fp8 tests (tests/*/test_float8*.py) check zeroshard's fp8 training with;
# installed after torch, which it needs (its wheel does not pin one).
TORCHAO = "torchao==0.18.0"


def _install(session: nox.Session, *extra: str) -> None:
    session.install(TORCH)
    session.install(*EDITABLE, *extra)


# Only for comparing our "auto" resolution with transformers' own, whose DeepSpeed config
# class needs DeepSpeed installed (no ops built; nothing else in the suite imports it).
DEEPSPEED = "deepspeed==0.19.8"


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite on CPU ranks over gloo."""
    _install(session, *TEST_DEPS, *HF_DEPS, LIGHTNING)
    session.install(TORCHAO)
    session.install(DEEPSPEED, env={"DS_BUILD_OPS": "0"})
    session.run("pytest", *(session.posargs or ["-q", "--durations=25"]))


def _readme_install() -> str:
    """The install line of the README's Install section, as a user would paste it."""
    for line in Path("README.md").read_text().splitlines():
        if line.strip().startswith("python -m pip install ./packages/"):
            return line.strip()
    raise RuntimeError("README.md has no 'python -m pip install ./packages/...' line")


@nox.session(reuse_venv=False)
def bare(session: nox.Session) -> None:
    """The README's install in a fresh virtualenv (torch, then the packages with only what
    they declare), then examples/train_gpt.py trained, resumed and consolidated on 2 CPU
    ranks: .ci/bare_example.py."""
    session.install(TORCH)
    session.run("bash", "-c", _readme_install(), external=True)
    session.run("python", ".ci/bare_example.py", str(Path(session.create_tmp()) / "bare"))


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on every package's src/."""
    _install(session, "mypy>=1.10", *HF_DEPS, LIGHTNING)
    # _zeroshard_lightning: the engine's module beside the package (its .pth line's).
    session.run("mypy", *(f"-p=zeroshard.{p}" for p in PACKAGES), "-m", "_zeroshard_lightning")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def package(session: nox.Session) -> None:
    """Build every wheel and sdist, then check their metadata and LICENSE (.ci/check_dists.py)."""
    session.install("build>=1.2", "hatchling>=1.27")
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for src in [".", *(f"packages/{p}" for p in PACKAGES)]:
        # No isolation: hatchling is installed here once, not in a fresh env per build.
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), src)
    session.run("python", ".ci/check_dists.py", str(dist))


@nox.session(venv_backend="none")
@nox.parametrize("world", [1, 2, 4, 8])
def gpu(session: nox.Session, world: int) -> None:
    """The test matrix (tests/integration/test_matrix.py) at `world` ranks on NCCL, in this
    interpreter, which must see CUDA; `world=1` also runs every other test marked `gpu`.

    `nox -s gpu` runs every world; a world larger than the visible GPUs is skipped (nox
    reports it as skipped, not as passed). docs/testing.md keeps the results.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        session.skip("gpu: torch is not installed in this interpreter")
    import torch

    if not torch.cuda.is_available():
        session.skip("gpu: no CUDA device here")
    visible = torch.cuda.device_count()
    if world > visible:
        session.skip(f"gpu: world {world} needs {world} GPUs, {visible} visible")
    selected = f"world{world}-" + (" or not test_matrix" if world == 1 else "")
    env = {"PYTHONPATH": ":".join(f"packages/{p}/src" for p in PACKAGES)}
    args = session.posargs or ["-q", "-rs"]
    session.run(
        "python", "-m", "pytest", "-m", "gpu", "--device", "cuda", "-k", selected, *args, env=env
    )


@nox.session
def demo(session: nox.Session) -> None:
    """Train the small GPT of examples/ on 2 CPU ranks (gloo) and print the loss falling."""
    _install(session)
    args = session.posargs or ["--stage", "2", "--steps", "300"]
    session.run("torchrun", "--standalone", "--nproc-per-node=2", "examples/train_gpt.py", *args)


@nox.session(name="demo-hf")
def demo_hf(session: nox.Session) -> None:
    """Train a small transformers Llama (from a config) with zeroshard stage 3 on 2 CPU ranks.

    Checkpoints every 20 steps, consolidates into demo-hf-out/hf (from_pretrained loads it).
    """
    _install(session, *HF_DEPS)
    args = session.posargs or ["--config", "llama", "--stage", "3", "--steps", "300"]
    session.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "examples/hf_causal_lm.py",
        "--output-dir",
        "demo-hf-out",
        *args,
        env={"OMP_NUM_THREADS": "1"},
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Smoke-run every benchmark in benchmarks/ at CPU sizes (real figures come from GPUs)."""
    _install(session, "numpy", "matplotlib", LIGHTNING)
    session.install(TORCHAO)
    for script in ("flatten", "leaf_fetch", "lightning", "float8_loss", "snapshots"):
        session.run("python", "-m", f"benchmarks.{script}", "--smoke", *session.posargs)
    session.run("python", "-m", "benchmarks.consolidate", "--source", "dcp", "--smoke")
    session.run(
        "torchrun", "--standalone", "--nproc-per-node=2", "-m", "benchmarks.train_step", "--smoke"
    )


@nox.session
def peers(session: nox.Session) -> None:
    """Install DeepSpeed 0.19.8 (CPU, no prebuilt ops), remake its fixtures, smoke its bench.

    Writes tests/ckpt/fixtures/deepspeed/ (commit the result) and bench-out/consolidate.md.
    """
    _install(session, "huggingface_hub", "numpy")
    session.install(DEEPSPEED, env={"DS_BUILD_OPS": "0"})
    session.run("python", "tests/ckpt/fixtures/deepspeed/make_fixtures.py", *session.posargs)
    session.run("python", "-m", "benchmarks.consolidate", "--smoke")
