"""--model resolution: aliases, folders, .gguf files, hub ids (offline: one clear error)."""

from __future__ import annotations

import time

import pytest

from kvcalib import hub
from kvcalib.errors import KvcalibError, OfflineError
from kvcalib.models import HUB_ALIASES, load_model, model_info, resolve_model_source
from tests.conftest import tiny_config, tiny_model


def test_resolution_kinds(tmp_path):
    assert resolve_model_source("smollm2-135m")[0] == "embedded"
    assert resolve_model_source("mistral-7b") == ("hub", HUB_ALIASES["mistral-7b"], {})
    assert resolve_model_source("org/some-model") == ("hub", "org/some-model", {})
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path / "m"))[0] == "folder"
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source(str(gguf)) == ("gguf", str(tmp_path), {"gguf_file": "x.gguf"})


@pytest.mark.parametrize("bad, needle", [("smollm-9000", "unknown model alias"), ("", "empty"),
                                          ("./missing/folder", "does not exist")])
def test_bad_model_names(bad, needle):
    with pytest.raises(KvcalibError, match=needle):
        resolve_model_source(bad)


@pytest.fixture
def no_network(monkeypatch):
    """The hub unreachable, deterministically: no HF_HUB_OFFLINE, and the probe answers "no
    network (test)" at once; transformers' loaders fail the test if anything reaches them."""
    import transformers

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "probe", lambda url, timeout: "no network (test)")
    hub._unreachable.cache_clear()
    reached: list[str] = []

    def ask_hub(where, **kwargs):  # what transformers would do: retry the hub for ~25 s, then fail
        reached.append(f"{where} local_files_only={kwargs.get('local_files_only')}")
        raise OSError("We couldn't connect to 'https://huggingface.co' (test)")

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", ask_hub)
    yield reached
    hub._unreachable.cache_clear()


def test_search_of_a_hub_model_offline_fails_in_one_line_at_once(no_network, monkeypatch, tmp_path):
    """Issue 52: `kvcalib search --model mistral-7b --data hotpotqa` with no network took 29 s (six
    hub retries) to its error; the probe answers first, and nothing is asked of the hub."""
    from typer.testing import CliRunner

    from kvcalib.cli import app

    monkeypatch.setattr(hub, "cached", lambda repo_id, filename="config.json": False)  # an empty HF cache
    t0 = time.monotonic()
    result = CliRunner().invoke(app, ["search", "--model", "mistral-7b", "--data", "hotpotqa",
                                      "--out", str(tmp_path / "s")])
    elapsed = time.monotonic() - t0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, result.output
    assert "mistralai/Mistral-7B-v0.1" in lines[0] and "no network (test)" in lines[0] and "smollm2-135m" in lines[0]
    assert no_network == []  # transformers never asked the hub
    assert not (tmp_path / "s").exists()
    assert elapsed < 5


def test_hub_model_in_the_cache_loads_from_it_while_the_hub_is_unreachable(no_network, monkeypatch):
    monkeypatch.setattr(hub, "cached", lambda repo_id, filename="config.json": True)
    with pytest.raises(OfflineError, match="mistralai/Mistral-7B-v0.1"):
        load_model("mistral-7b", device="cpu")
    assert no_network == ["mistralai/Mistral-7B-v0.1 local_files_only=True"]  # the cache only: no retries


def test_hub_id_offline_is_one_clear_error(monkeypatch):
    """HF_HUB_OFFLINE=1 (set for the whole suite by conftest): transformers reads its cache
    without retrying, so no probe is made."""
    monkeypatch.setattr(hub, "probe", lambda url, timeout: pytest.fail("probed although HF_HUB_OFFLINE is set"))
    t0 = time.perf_counter()
    with pytest.raises(OfflineError) as err:
        load_model("mistral-7b", device="cpu")
    msg = str(err.value)
    assert "mistralai/Mistral-7B-v0.1" in msg and "local folder" in msg and "HF_HOME" in msg
    assert "smollm2-135m" in msg
    assert time.perf_counter() - t0 < 60


def test_local_folder_loads_in_fp32_on_cpu(tmp_path):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    vocab = {f"w{i}": i for i in range(128)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w1").save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.model.dtype == torch.float32
    assert loaded.info.num_kv_heads == 2 and loaded.info.head_dim == 16
    assert loaded.tokenizer.pad_token is not None


def test_geometry_and_fingerprint():
    info = model_info(tiny_config("gemma3"), "g")
    assert info.sliding_window == (8, None)
    assert info.num_q_heads == 4 and info.num_kv_heads == 2
    assert model_info(tiny_config("llama"), "a").config_hash != info.config_hash
    assert model_info(tiny_config("llama"), "a").config_hash == model_info(tiny_config("llama"), "b").config_hash
