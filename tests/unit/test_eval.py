"""Evaluation harness on tiny random models (no network): perplexity positions and baselines,
agreement, passkey prompt construction, GSM8K answer extraction, EvalConfig validation, and an
end-to-end ``evaluate`` with a tokenizer trained here on generated text."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvcalib.errors import KvcalibError
from kvcalib.eval import EvalConfig, EvalConfigError, EvalResult, evaluate, results_table_columns, results_table_rows, write_json
from kvcalib.eval.agreement import agreement, agreement_stats, greedy_decode, greedy_generate
from kvcalib.eval.gsm8k import build_gsm8k_prompt, extract_answer, is_correct, normalize_number
from kvcalib.eval.passkey import NEEDLE, build_passkey_prompt, build_passkey_prompts, extract_passkey, run_passkey
from kvcalib.eval.perplexity import decode_faithful_nll, perplexity, scored_slice
from kvcalib.layout import LayerConfig, quantized_token_count
from kvcalib.recipe import Recipe, resolve_recipe
from kvcalib.runtime.cache import CompressedCache
from tests.conftest import TINY_ARCHS, corpus_lines as _corpus, tiny_loaded_model, tiny_model

LOSSY = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)  # tiny model: head_dim 16
pytestmark = pytest.mark.usefixtures("one_thread_when_busy")  # see tests/conftest.py



def lossy_recipe() -> Recipe:
    return Recipe(name="tiny-2bit", default_layer=LOSSY)


def fp16_configs(model) -> list[LayerConfig]:
    return resolve_recipe("fp16").layer_configs(model.config.num_hidden_layers)


@torch.no_grad()
def sample_from(model, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """(n, length) token ids sampled from the model itself at temperature 1 (ancestral)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (n, 1), generator=gen)  # (n, 1)
    for _ in range(length - 1):
        probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), -1)  # (n, V)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
    return ids


# ------------------------------------------------------------------ perplexity
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fp16_preset_ppl_equals_plain_forward(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0))  # (N, L)
    sim = perplexity(model, ids, fp16_configs(model), batch_size=2)
    plain = perplexity(model, ids, None, batch_size=3)
    assert math.isclose(sim, plain, rel_tol=1e-4)
    # independent check of the scored positions: standard causal-LM perplexity
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()  # (N, L, V)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    assert math.isclose(plain, math.exp(float(ref)), rel_tol=1e-5)


@pytest.mark.parametrize("prompt_len,expected", [(0, 39), (1, 39), (2, 38), (25, 15)])
def test_scored_token_count(prompt_len, expected):
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    _, n = decode_faithful_nll(model, ids, [LOSSY] * 2, prompt_len=prompt_len)
    assert n == 2 * expected
    assert scored_slice(40, prompt_len) == slice(max(prompt_len, 1) - 1, 39)


def test_scored_slice_rejects_nothing_to_score():
    with pytest.raises(ValueError):
        scored_slice(10, 10)
    with pytest.raises(ValueError):
        scored_slice(1)


def test_2bit_recipe_raises_ppl():
    """On text sampled from the model itself, expected NLL under any other distribution is at
    least the model's own (Gibbs' inequality): a lossy cache must raise perplexity. The LM head is
    sharpened so the random model is far from uniform (its ratio over seeds 0-9: 1.003-1.018)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    ids = sample_from(model, 16, 64)  # (16, 64)
    fp = perplexity(model, ids, None, batch_size=8)
    q = perplexity(model, ids, [LOSSY] * 2, batch_size=8)
    assert q > fp * 1.001, (q, fp)


# ------------------------------------------------------------------ agreement
def test_agreement_stats_definition():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    cand = torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8]])
    s = agreement_stats(ref, cand)
    assert s.agreement == 7 / 8  # position-wise, counting the match after the divergence
    assert s.first_divergence == (2 + 4) / 2
    assert (s.n_prompts, s.n_tokens) == (2, 4)
    with pytest.raises(ValueError):
        agreement_stats(ref, cand[:, :3])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fp16_preset_agreement_is_exactly_one(arch):
    model = tiny_model(arch)
    prompts = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(2))  # (N, P)
    res = agreement(model, prompts, resolve_recipe("fp16"), max_new_tokens=12, batch_size=2)
    assert res.agreement == 1.0
    assert res.first_divergence == 12.0


def test_greedy_decode_matches_generate():
    model = tiny_model("qwen2")
    prompts = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = greedy_generate(model, prompts, 8, None)  # (2, 8)
    assert torch.equal(greedy_decode(model, [prompts[:, :10], prompts[:, 10:]], 8), ref)
    lossy = greedy_generate(model, prompts, 8, lossy_recipe())
    cache = CompressedCache.from_recipe(model, lossy_recipe())
    assert torch.equal(greedy_decode(model, [prompts], 8, cache), lossy)


def test_split_context_is_compressed_before_the_question():
    """The premise of passkey's split mode: after the context forward, the cache holds all of
    the context but the window in packed storage, so the question reads it compressed."""
    model = tiny_model("llama")
    ctx = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache.from_recipe(model, lossy_recipe())
    with torch.no_grad():
        model(input_ids=ctx, past_key_values=cache)
    for layer in cache.layers:  # no sinks: packed = cached - pending (full-precision window)
        assert layer.n_seen - layer.pend_k.shape[-2] == quantized_token_count(LOSSY, 45) == 32


# ------------------------------------------------------------------ tiny model (tokenizer: tests/conftest.py)
@pytest.fixture(scope="module")
def tiny_loaded(tiny_tokenizer):
    return tiny_loaded_model(tiny_tokenizer)


# ------------------------------------------------------------------ passkey
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_prompt_puts_key_at_depth(tiny_tokenizer, depth):
    tok = tiny_tokenizer
    filler = tok(" ".join(_corpus(40)), add_special_tokens=False)["input_ids"]
    p = build_passkey_prompt(tok, filler, 300, depth, "48213", offset=17)
    ids = p.ids.tolist()
    assert len(ids) == 300 == p.length
    needle = tok(NEEDLE.format(key="48213"), add_special_tokens=False)["input_ids"]
    assert ids[p.needle_start:p.needle_start + p.needle_tokens] == needle
    head = p.context_tokens - p.filler_tokens - p.needle_tokens  # BOS + intro
    assert p.needle_start - head == round(depth * p.filler_tokens)  # filler tokens before the needle
    assert abs((p.needle_start - head) / p.filler_tokens - depth) <= 0.5 / p.filler_tokens
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[p.context_tokens:]).endswith("The pass key is")
    assert "48213" in tok.decode(ids[:p.context_tokens])
    assert ids[head:p.needle_start] == filler[17:17 + p.needle_start - head]


def test_passkey_prompts_are_seeded(tiny_tokenizer):
    text = " ".join(_corpus(40))
    a = build_passkey_prompts(tiny_tokenizer, text, [250, 300], [0.2, 0.8], 2, seed=5)
    b = build_passkey_prompts(tiny_tokenizer, text, [250, 300], [0.2, 0.8], 2, seed=5)
    assert len(a) == 8 and [p.key for p in a] == [p.key for p in b]
    assert all(torch.equal(x.ids, y.ids) for x, y in zip(a, b))
    assert all(len(p.key) == 5 and p.key.isdigit() for p in a)
    assert [p.length for p in a] == [250] * 4 + [300] * 4
    with pytest.raises(ValueError, match="too short"):
        build_passkey_prompt(tiny_tokenizer, [1, 2, 3], 20, 0.5, "12345")


@pytest.mark.parametrize("text,expected", [
    (" 48213. Remember it.", "48213"),
    ("48213", "48213"),
    (" is 4821 and 48213", "4821"),  # the first number is the answer
    (" the key", None),
    (" 482130", "482130"),
])
def test_extract_passkey(text, expected):
    assert extract_passkey(text) == expected


def test_run_passkey_modes_and_cells(tiny_loaded):
    lm = tiny_loaded
    prompts = build_passkey_prompts(lm.tokenizer, " ".join(_corpus(40)), [240, 256], [0.5], 2, seed=1)
    res = {mode: run_passkey(lm.model, lm.tokenizer, prompts, lossy_recipe(), mode=mode, max_new_tokens=4,
                             batch_size=3) for mode in ("split", "prefill")}
    for r in res.values():
        assert r.n_trials == 4 and len(r.outputs) == 4
        assert set(r.by_cell) == {"240@0.5", "256@0.5"}
        assert 0.0 <= r.accuracy <= 1.0
    chunked = run_passkey(lm.model, lm.tokenizer, prompts, lossy_recipe(), chunk_tokens=16, max_new_tokens=4)
    assert chunked.n_trials == 4
    with pytest.raises(ValueError):
        run_passkey(lm.model, lm.tokenizer, prompts, None, mode="nope")


# ------------------------------------------------------------------ gsm8k
@pytest.mark.parametrize("text,expected", [
    (" She sells 16 - 3 - 4 = 9 eggs.\n#### 18\n", "18"),
    (" 5 + 7 = 12 apples, so the answer is 12.", "12"),
    (" It costs $1,234.", "1234"),
    (" The price is 3.50 dollars", "3.5"),
    (" 18.0", "18"),
    (" She owes -4 dollars", "-4"),
    (" #### 7\n\nQuestion: Tom has 3 cats", "7"),
    (" 4 apples.\n\nQuestion: how many are 99?", "4"),  # text after the next question is ignored
    (" 2 + 2 = 4 #### 5 more words 6", "5"),  # after the last ####
    (" I do not know.", None),
])
def test_gsm8k_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_gsm8k_correctness_and_prompt():
    assert is_correct("18", "18") and is_correct(normalize_number("18.00"), "18")
    assert is_correct("1234", "1,234")
    assert not is_correct(None, "18") and not is_correct("17", "18")
    assert normalize_number("abc") is None
    prompt = build_gsm8k_prompt("How many?", [("Q1?", "2 * 3 = <<2*3=6>>6 eggs.\n#### 6")])
    assert prompt == "Question: Q1?\nAnswer: 2 * 3 = 6 eggs.\n#### 6\n\nQuestion: How many?\nAnswer:"


# ------------------------------------------------------------------ EvalConfig
@pytest.mark.parametrize("kwargs,field", [
    ({"recipes": []}, "recipe"),
    ({"metrics": "ppl,bleu"}, "bleu"),
    ({"metrics": ""}, "metric"),
    ({"ppl_samples": 0}, "ppl_samples"),
    ({"ppl_seq_len": 1}, "ppl_seq_len"),
    ({"agreement_tokens": -1}, "agreement_tokens"),
    ({"batch_size": True}, "batch_size"),
    ({"seed": -1}, "seed"),
    ({"context_len": 1.5}, "context_len"),
    ({"passkey_depths": (0.5, 1.5)}, "passkey_depths"),
    ({"passkey_depths": ()}, "passkey_depths"),
    ({"passkey_lengths": (512, 10)}, "passkey_lengths"),
    ({"passkey_mode": "stream"}, "passkey_mode"),
    ({"gsm8k_shots": 100}, "gsm8k_shots"),
    ({"data": " "}, "data"),
    ({"recipes": ["fp16", 3]}, "recipe"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_eval_config_validation(kwargs, field):
    base = {"recipes": ["fp16"]}
    with pytest.raises(EvalConfigError, match=field) as err:
        EvalConfig(**{**base, **kwargs})
    assert isinstance(err.value, KvcalibError) and isinstance(err.value, ValueError)


def test_eval_config_normalises_metrics():
    cfg = EvalConfig(recipes="kivi-2", metrics=" PPL, agreement,ppl")
    assert cfg.metrics == ("ppl", "agreement") and cfg.recipes == ["kivi-2"]
    assert json.loads(json.dumps(cfg.to_dict()))["metrics"] == ["ppl", "agreement"]


# ------------------------------------------------------------------ evaluate end to end
def test_evaluate_tiny_end_to_end(tiny_loaded, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(_corpus(400, seed=1)))
    cfg = EvalConfig(model="tiny", recipes=["fp16", lossy_recipe()], data=str(text), passkey_filler=str(text),
                     ppl_samples=3, ppl_seq_len=48, agreement_prompts=3, agreement_prompt_len=24,
                     agreement_tokens=8, passkey_lengths=(256,), passkey_depths=(0.2, 0.8), passkey_trials=1,
                     passkey_new_tokens=4, context_len=256, batch_size=2)
    tiny_loaded.model.set_attn_implementation("sdpa")  # other tests switch it to kvcalib's
    handed = []  # on_result: each recipe's result as soon as it is scored (long runs save as they go)
    results = evaluate(cfg, tiny_loaded, on_result=lambda r: handed.append((r.name, r.ppl is not None)))
    fp, lossy = results
    assert [r.name for r in results] == ["fp16", "tiny-2bit"]
    assert handed == [("fp16", True), ("tiny-2bit", True)]
    assert fp.ppl_delta_pct == 0.0 and fp.ppl == fp.ppl_fp
    assert lossy.ppl_fp == fp.ppl_fp and lossy.ppl_tokens == fp.ppl_tokens == 3 * 47  # same inputs
    assert fp.agreement == 1.0 and fp.first_divergence == 8.0
    assert lossy.passkey_fp == fp.passkey_fp and set(lossy.passkey_cells) == {"256@0.2", "256@0.8"}
    assert fp.effective_bits == 16.0 and lossy.effective_bits < 16.0
    info = tiny_loaded.info
    assert fp.kv_bytes == 2 * info.num_layers * info.num_kv_heads * info.head_dim * 256 * 2  # bf16, one sequence
    assert fp.gsm8k is None
    assert lossy.ppl != fp.ppl  # the lossy recipe compressed something
    assert set(lossy.seconds_by_metric) == {"ppl", "agreement", "passkey"}
    assert tiny_loaded.model.config._attn_implementation == "sdpa"  # restored

    cols, rows = results_table_columns(results), results_table_rows(results)
    assert "gsm8k" not in cols and all(len(r) == len(cols) for r in rows)
    assert rows[0][cols.index("name")] == "fp16"

    out = tmp_path / "res" / "eval.json"
    write_json(results, out, cfg)
    data = json.loads(out.read_text())
    for key in ("name", "ppl", "ppl_fp", "ppl_delta_pct", "agreement", "effective_bits", "kv_bytes", "context_len"):
        assert key in data[0] and key in data[1]
    # result files say how their bits were counted, with the compression against the model's bf16 cache
    assert data[0]["accounting"] == data[1]["accounting"] == "held-tokens"
    assert data[0]["compression_ratio"] == 1.0 and data[1]["compression_ratio"] == pytest.approx(16.0 / lossy.effective_bits)
    assert json.loads((out.parent / "eval.config.json").read_text())["recipes"] == ["fp16", "tiny-2bit"]


def test_evaluate_refuses_too_long_inputs(tiny_loaded):
    cfg = EvalConfig(recipes=["fp16"], metrics="ppl", ppl_seq_len=4096)
    with pytest.raises(EvalConfigError, match="512"):
        evaluate(cfg, tiny_loaded)


def test_results_table_with_missing_metrics():
    rows = [EvalResult(name="a", recipe="a", context_len=4096, effective_bits=16.0, kv_bytes=2.0**20, ppl=10.0,
                       ppl_fp=10.0, ppl_delta_pct=0.0)]
    assert results_table_columns(rows) == ["name", "eff. bits", "KV MiB/seq", "T", "ppl", "ppl fp", "Δppl %"]
    assert results_table_rows(rows) == [["a", 16.0, 1.0, 4096, 10.0, 10.0, 0.0]]
