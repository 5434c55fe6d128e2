"""--model resolution: aliases, folders, .gguf files, hub ids (offline: one clear error)."""

from __future__ import annotations

import time

import pytest

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


def test_hub_id_offline_is_one_clear_error():
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
