"""The built wheel is complete: ``pip wheel`` of the source (no editable install) installed into a
fresh virtual environment runs the CLI from outside the source tree.

The fresh environment reuses this one's dependencies (torch, transformers, ...) through a ``.pth``
line pointing at this environment's site-packages (``venv --system-site-packages`` would reach the
interpreter's base, not this venv); a line of a ``.pth`` file only extends ``sys.path``, so this
environment's own ``.pth`` files (the editable install's finder) do not run there, and its
``kvcalib`` is only what the wheel installed. The source is copied before the build so that a
stale ``build/`` folder of the checkout cannot leak into the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SOURCE = ("pyproject.toml", "setup.py", "README.md", "kvcalib", "kernels", "recipes/presets")


def _run(cmd, cwd, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _packages(root: Path, prefix: str) -> set[str]:
    """Import names of the packages (folders with ``__init__.py``) under ``root``."""
    return {".".join([prefix, *p.parent.relative_to(root).parts]) for p in root.rglob("__init__.py")
            if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(the wheel, the fresh environment's bin folder, an environment for its processes, a cwd
    outside the source tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCE:
        if not (REPO / name).exists():
            continue
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, src / name)
    built = _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "--no-index",
                  "-q", "-w", tmp / "dist"], cwd=tmp)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("kvcalib-*.whl")

    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_this_env_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    # --ignore-installed: this environment's kvcalib (an editable install) is visible through the
    # .pth; install beside it into the fresh environment, never touching it
    installed = _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel], cwd=tmp)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    work = tmp / "work"
    work.mkdir()
    return wheel, venv / "bin", env, work


def test_wheel_holds_every_package_and_nothing_else(wheel_env):
    """Every package of kvcalib/ and kernels/ (found in the source, so a new one needs no edit
    here), the presets' JSON; no benchmarks, experiments or tests."""
    wheel, *_ = wheel_env
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    want = _packages(REPO / "kvcalib", "kvcalib") | _packages(REPO / "kernels", "kvcalib_kernels") | {"kvcalib.presets"}
    assert want <= packages, sorted(want - packages)
    assert {"kvcalib.optimize", "kvcalib_kernels.decode"} <= packages
    assert any(n.startswith("kvcalib/presets/") and n.endswith(".json") for n in names)
    assert not [n for n in names if n.split("/")[0] in ("benchmarks", "experiments", "tests", "scripts")
                or n.startswith("kvcalib_kernels/bench")]


def test_installed_cli_runs_outside_the_source(wheel_env, tmp_path):
    """``kvcalib --help``, ``search --help``, ``export --help`` and a tiny ``export`` (statistics
    of a tiny random model) from the wheel; the modules it imports are the installed ones."""
    from kvcalib.collection import collect_stats
    from tests.conftest import tiny_model

    _, bin_dir, env, work = wheel_env
    kvcalib = bin_dir / "kvcalib"
    where = _run([bin_dir / "python", "-c", "import kvcalib, kvcalib.optimize, kvcalib_kernels.decode_attention as d; "
                  "print(kvcalib.__file__); print(d.__file__)"], cwd=work, env=env)
    assert where.returncode == 0, where.stderr[-3000:]
    assert all(line.startswith(str(bin_dir.parent)) for line in where.stdout.split()), where.stdout
    for args, needle in (((), "export"), (("search", "--help"), "--budget-bits"), (("export", "--help"), "--bits")):
        done = _run([kvcalib, *args, *(() if args else ("--help",))], cwd=work, env=env)
        assert done.returncode == 0 and needle in done.stdout, (args, done.stdout[-2000:], done.stderr[-2000:])

    model = tiny_model("llama", heads=8, kv_heads=4)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (64,), generator=g) for _ in range(4)]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    collect_stats(model, seqs, reservoir_blocks=4, block_len=32, name="tiny", progress=False).save(
        run_dir / "stats.safetensors")
    recipe = tmp_path / "r.safetensors"
    done = _run([kvcalib, "export", run_dir, "-o", recipe, "--bits", "k4v2", "--group", "8", "--window", "8",
                 "--reorder", "--center"], cwd=work, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    from kvcalib.recipe import Recipe

    back = Recipe.load(recipe)
    assert back.model.name == "tiny" and any(k.endswith(".perm") for k in back.tensors)

    # the benchmarks are not installed: `kvcalib bench` says so in one line
    done = _run([kvcalib, "bench", "report"], cwd=work, env=env)
    assert done.returncode == 2 and "repository root" in done.stderr + done.stdout and "Traceback" not in done.stderr
