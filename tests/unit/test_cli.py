"""The CLI: bad input gives one clear line, exit code 2, no traceback, nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvcalib.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_help_lists_every_command_with_examples():
    code, out = run("--help")
    assert code == 0
    for cmd in ("collect", "search", "export", "run", "eval", "inspect", "bench"):
        assert cmd in out
    for cmd in ("collect", "run", "inspect"):
        code, out = run(cmd, "--help")
        assert code == 0 and "Example" in out


@pytest.mark.parametrize("args, needle", [
    (["collect", "--model", "no-such-model", "--out", "{tmp}/o"], "unknown model alias"),
    (["collect", "--samples", "0", "--out", "{tmp}/o"], "--samples"),
    (["collect", "--seq-len", "1", "--out", "{tmp}/o"], "--seq-len"),
    (["collect", "--model", "{tmp}/missing.gguf", "--out", "{tmp}/o"], "does not exist"),
    (["collect", "--model", "{tmp}", "--out", "{tmp}/o"], "config.json"),
    (["collect", "--out", "{tmp}/nonempty"], "not empty"),
    (["inspect", "{tmp}/nope.safetensors"], "does not exist"),
    (["inspect", "{tmp}/garbage.safetensors"], "corrupt or truncated"),
    (["run", "--recipe", "kivi-2", "--prompt", "   "], "prompt is empty"),
    (["run", "--recipe", "kivi-9", "--prompt", "hi"], "does not exist"),
    (["run", "--recipe", "kivi-2", "--prompt", "hi", "--device", "cpu", "--cuda-graph"], "--cuda-graph needs a CUDA"),
])
def test_bad_input_exit_2_one_line(tmp_path, args, needle):
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "x").write_text("keep me")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00\x01garbage")
    code, out = run(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert code == 2, out
    assert needle in out
    assert "Traceback" not in out
    assert (tmp_path / "nonempty" / "x").read_text() == "keep me"
    assert not (tmp_path / "o").exists()


def test_bench_without_cuda_says_what_to_do():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    code, out = run("bench", "grid", "--rows", "quick")
    assert code == 2 and "CUDA" in out


def test_inspect_json_preset():
    code, out = run("inspect", "kivi-4", "--json", "--model", "smollm2-135m")
    assert code == 0
    report = json.loads(out)
    assert report["name"] == "kivi-4" and len(report["layers"]) == 30
    assert 5.0 < report["memory"]["effective_bits"] < 5.5


def test_import_is_light():
    """`import kvcalib` pulls no triton/optuna/sklearn and initialises no CUDA."""
    code = ("import sys, kvcalib, kvcalib.cli, kvcalib.recipe, kvcalib.runtime.cache, kvcalib_kernels;"
            "bad=[m for m in ('triton','optuna','sklearn') if m in sys.modules];"
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
