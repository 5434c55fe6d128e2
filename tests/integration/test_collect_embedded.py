"""`kvcalib collect` end to end on the real embedded model and text."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.stats import CollectedStats

pytestmark = pytest.mark.embedded


def test_collect_cli_on_smollm2(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["collect", "--samples", "2", "--seq-len", "128", "--block-len", "64",
                                      "--reservoir-blocks", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "key |max|" in result.output and "stats.safetensors" in result.output
    stats = CollectedStats.load(out)
    assert stats.model.name == "smollm2-135m" and len(stats.layers) == 30
    assert int(stats.layers[5].k["count"]) == 256
    assert stats.layers[5].reservoir_k.shape == (2, 64, 3, 64)
    assert 1.0 < float(stats.layers[5].k["absmax"].max()) < 100.0  # ASSETS.md: max |key| ~20
    run = json.loads((out / "run.json").read_text())
    assert run["seed"] == 0 and run["tokens"] == 256 and "torch" in run["versions"]
    assert torch.isfinite(stats.layers[29].v["sq_mean"]).all()


def test_seq_len_over_the_model_maximum(tmp_path):
    result = CliRunner().invoke(app, ["collect", "--seq-len", "100000", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "8192" in result.output
    assert not (tmp_path / "o").exists()


def test_local_gguf_file_loads():
    from kvcalib.assets import embedded_model_gguf
    from kvcalib.models import load_model

    loaded = load_model(str(embedded_model_gguf("smollm2-135m")), device="cpu")
    assert loaded.info.num_layers == 30 and loaded.info.num_kv_heads == 3
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt")
    out = loaded.model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in loaded.tokenizer.decode(out[0])
