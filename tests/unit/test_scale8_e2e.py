"""experiments/scale8_e2e.py: its float16 pair is the shipped quantizer, its 8-bit pair stays
close to it, the bits the 8-bit pair saves are counted net of its tables and spent in whole code
bits, and a run on a tiny llama writes every allocation."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import head_bits as hb
from experiments import scale8_e2e as e2e
from kvcalib.codec import LayerCodec
from kvcalib.layout import LayerConfig
from tests.conftest import corpus_lines, tiny_loaded_model
from tests.unit.test_head_sensitivity import LAST, T

LAYOUT = dict(k_group=16, v_group=16, sinks=2, window=16)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fp16_pair_is_the_shipped_quantizer(bits):
    torch.manual_seed(bits)
    cfg = LayerConfig(k_bits=bits, v_bits=bits, k_axis="channel", **LAYOUT)
    x = torch.randn(3, 2, 16, 32) * torch.linspace(0.2, 3.0, 32)  # (B, H, G, D), channels of different range
    for side in ("k", "v"):
        want = LayerCodec(cfg).roundtrip_tiers(side, x)[0]
        got = e2e.PairCodec(cfg, "fp16", None).roundtrip_tiers(side, x)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_log8c_pair_is_close_to_fp16_with_calibrated_tables():
    torch.manual_seed(0)
    cfg = LayerConfig(k_bits=2, v_bits=2, k_axis="channel", **LAYOUT)
    scales = torch.linspace(0.2, 3.0, 32)
    calib = {(side, 2): e2e.s8.calibrate(torch.randn(2, 64, 32) * scales, side, 2, 16) for side in ("k", "v")}
    x = torch.randn(4, 2, 16, 32) * scales  # (B, H, G, D)
    for side in ("k", "v"):
        fp = e2e.PairCodec(cfg, "fp16", None).roundtrip_tiers(side, x)[0]
        l8 = e2e.PairCodec(cfg, "log8c", calib).roundtrip_tiers(side, x)[0]
        assert not torch.equal(fp, l8)  # a different pair is seen
        sub = e2e.PairCodec(cfg, "log8c", calib, heads=[1]).roundtrip_tiers(side, x[:, 1:2])[0]
        torch.testing.assert_close(sub, l8[:, 1:2], rtol=0, atol=0)  # a group of heads reads its own tables
        mse_fp, mse_l8 = (fp - x).pow(2).mean(), (l8 - x).pow(2).mean()
        assert mse_l8 < 1.05 * mse_fp, (side, float(mse_l8 / mse_fp))


def test_saved_bits_are_net_of_the_tables():
    cfg = LayerConfig(k_bits=2, v_bits=2, k_axis="channel", k_group=64, v_group=64, sinks=4, window=128)
    saved = e2e.saved_bits_per_unit(cfg, 64, 8192)
    # 16 bits a group of 64; the key tables (2 x 32 bits a channel) over ~8k quantized tokens
    assert 0.25 - 64 / 7900 < saved < 0.25 - 64 / 8192


def test_plan_spends_the_saving_in_whole_code_bits():
    kl = {(l, h, s): 0.01 * (1 + l) * (1 + h) for l in range(3) for h in range(2) for s in ("k", "v")}
    sens = {"rows": [{"kind": "head", "layer": l, "head": h, "side": s, "kl": v} for (l, h, s), v in kl.items()]}
    plans = e2e.plan(sens, [(2, 2), (4, 4), (2, 2)], kv_heads=2, saved=0.26)
    assert plans["fp16 layer-greedy"][1] == plans["log8c layer-greedy"][1]
    base = hb.code_bits(plans["fp16 layer-greedy"][1])
    budget = 2 * 3 * 2 * 2 + 8 + 3  # the recipe's code bits + floor(0.26 x 12 units)
    assert base <= budget - 3
    for name in ("log8c layer-greedy +saved", "log8c head-greedy +saved"):
        fmt, bits = plans[name]
        assert fmt == "log8c" and base < hb.code_bits(bits) <= budget


def test_run_writes_every_allocation(tiny_tokenizer, tmp_path):
    from kvcalib.recipe import Recipe

    loaded = tiny_loaded_model(tiny_tokenizer, positions=128)
    kl = {(l, h, s): 0.01 * (1 + l + h) for l in (0, 1) for h in (0, 1) for s in ("k", "v")}
    sens = tmp_path / "sens.json"
    sens.write_text(json.dumps({"rows": [{"kind": "head", "layer": l, "head": h, "side": s, "kl": v}
                                         for (l, h, s), v in kl.items()]}))
    rec = tmp_path / "r.safetensors"
    Recipe(name="t", layers=[LayerConfig(k_bits=2, v_bits=2, **LAYOUT), LayerConfig(k_bits=4, v_bits=3, **LAYOUT)]).save(rec)
    out = tmp_path / "run"
    res = e2e.main(["--context", str(T), "--windows", "2", "--score-last", str(LAST), "--group", "16", "--window", "16",
                    "--sinks", "2", "--batch", "2", "--sensitivity", str(sens), "--recipe", str(rec), "--out", str(out)],
                   loaded=loaded, texts=corpus_lines(400), calib_text=" ".join(corpus_lines(300)[::-1]))
    kinds = [r["kind"] for r in res["rows"]]
    assert kinds == ["fp", "fp16 layer-greedy", "log8c layer-greedy", "log8c layer-greedy +saved", "log8c head-greedy +saved"]
    assert all(r["kl"] > 1e-9 for r in res["rows"] if r["kind"] != "fp")
    assert (out / "scale8_e2e.md").read_text().count("| ") > 10
