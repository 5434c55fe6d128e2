"""experiments/head_sensitivity.py on a tiny llama (2 layers, 2 kv heads of 2 query heads, head_dim 16):
its hooked attention changes only the target heads' outputs, its decode positions reproduce the
decode-faithful simulation, and the run writes a row for every (layer, kv head, side)."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import head_sensitivity as hs
from kvcalib.codec import LayerCodec
from kvcalib.layout import LayerConfig
from tests.conftest import corpus_lines, tiny_loaded_model

# 96-token windows, 16 scored: prompt 80; group 16, window 16, 2 sinks: 48 keys packed at the first
# scored query, 64 at the last
CFG = LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=16, sinks=2, window=16)
T, LAST = 96, 16


@pytest.fixture(scope="module")
def loaded(tiny_tokenizer):
    return tiny_loaded_model(tiny_tokenizer, positions=128)


def _ids(loaded, n=2):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, loaded.model.config.vocab_size, (n, T), generator=g)


@pytest.mark.parametrize("side", ["k", "v"])
def test_only_the_target_heads_attention_changes(loaded, side):
    attn = loaded.model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, LAST, 16, generator=g)  # (B, Hq, C, D): the scored positions' queries
    k, v = (3 * torch.randn(2, 2, T, 16, generator=g) for _ in range(2))  # (B, H, T, D)
    mask = (torch.arange(T)[None, :] <= torch.arange(T - LAST, T)[:, None])[None, None]  # (1, 1, C, T)
    codec = LayerCodec(CFG)
    plain, _ = hs._attention(attn, q, k, v, mask)  # (B, C, Hq, D): no target set
    with hs.target(hs.Target("head", 1, (1,), (side,)), codec, T - LAST):
        got, _ = hs._attention(attn, q, k, v, mask)
    assert torch.equal(got[:, :, :2], plain[:, :, :2])  # kv head 0's query heads: SDPA's, bit for bit
    assert (got[:, :, 2:] - plain[:, :, 2:]).abs().amax() > 1e-3  # kv head 1's: its quantized side
    with hs.target(hs.Target("noise", 1, (0, 1), ()), codec, T - LAST):  # nothing quantized: SDPA's up to rounding
        same, _ = hs._attention(attn, q, k, v, mask)
    torch.testing.assert_close(same, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sides", [("k",), ("k", "v")])
def test_decode_positions_match_the_simulation(loaded, sides):
    from kvcalib.simulate import simulated_logits

    model, ids = loaded.model, _ids(loaded)
    p = T - LAST
    layer = LayerConfig(k_bits=2, v_bits=2 if "v" in sides else 16, k_group=16, v_group=16, sinks=2, window=16)
    want = simulated_logits(model, ids, [LayerConfig(), layer], prompt_len=p, logits_to_keep=LAST)  # (B, C, V)
    with hs.hooked(model):
        prefix, _ = hs.prefill(model, ids, p)
        got = hs.continuation_logits(model, ids, prefix, p, hs.Target("layer", 1, (0, 1), sides), LayerCodec(CFG))
        fp = hs.continuation_logits(model, ids, prefix, p, None, LayerCodec(CFG))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - fp).abs().amax() > 1e-3  # the quantization is seen at all
    torch.testing.assert_close(fp, model(input_ids=ids).logits[:, p:].float(), rtol=1e-4, atol=1e-4)


def test_rows_cover_every_head_and_side(loaded, tmp_path, tiny_tokenizer):
    out = tmp_path / "run"
    res = hs.main(["--context", str(T), "--windows", "2", "--score-last", str(LAST), "--group", "16",
                   "--window", "16", "--sinks", "2", "--batch", "2", "--out", str(out)],
                  loaded=loaded, texts=corpus_lines(400))
    rows = res["rows"]
    heads = {(r["layer"], r["head"], r["side"]) for r in rows if r["kind"] == "head"}
    assert heads == {(layer, h, s) for layer in (0, 1) for h in (0, 1) for s in ("k", "v")}
    assert {(r["layer"], r["side"]) for r in rows if r["kind"] == "layer"} == {(l, s) for l in (0, 1) for s in ("k", "v")}
    fp = next(r for r in rows if r["kind"] == "fp")
    assert fp["kl"] == 0.0 and fp["dppl_pct"] == 0.0 and fp["copy_dnll"] == 0.0
    assert next(r for r in rows if r["kind"] == "noise")["kl"] < 1e-9
    assert all(r["kl"] > 1e-9 and r["copy_kl_mean"] > 1e-9 for r in rows if r["kind"] in ("head", "layer"))
    assert all(len(r["ppl_kl"]) == 2 and len(r["copy_kl"]) == 2 for r in rows)
    for side in ("k", "v"):
        c = res["summary"][side]["kl"]
        assert c["heads"] == 4 and 0.0 <= c["gini"] <= 0.75 and c["top5_share"] == pytest.approx(1.0)
    saved = json.loads((out / "head_sensitivity.json").read_text())
    assert saved["meta"]["commit"] and saved["meta"]["command"].startswith("python -m experiments.head_sensitivity")
    assert "Top 10 heads, K" in (out / "head_sensitivity.md").read_text()
    assert (out / "head_sensitivity.png").stat().st_size > 1000
    (out / "head_sensitivity.png").unlink()
    hs.main(["--replot", str(out)])  # the figure again from the JSON alone
    assert (out / "head_sensitivity.png").stat().st_size > 1000


def test_gini_and_layer_parsing():
    assert hs.gini([1, 1, 1, 1]) == pytest.approx(0.0)
    assert hs.gini([0, 0, 0, 4]) == pytest.approx(0.75)
    assert hs.parse_layers("0,2-3", 5) == [0, 2, 3]
    with pytest.raises(SystemExit):
        hs.parse_layers("7", 5)
