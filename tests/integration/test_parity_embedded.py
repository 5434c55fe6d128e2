"""Decode-faithful simulation == a real token-by-token decode through CompressedCache, on the
embedded SmolLM2-135M model and real text, for every shipped preset.

Run in float64: the two paths use different matmul shapes (one teacher-forced forward vs one
token at a time), and in float32 their last-bit differences occasionally push a value across a
rounding boundary of the quantizer; such a code flip then propagates through later layers (we
measured it: per-token 4-bit on all 30 layers drifts by ~0.4 in mean logit, while any single
compressed layer agrees to 5e-5). In float64 those differences vanish below the float32 grid the
quantizer works on, so the two paths must agree exactly up to float64 noise.

Stated tolerance: max |logit difference| <= 1e-6 x max |logit|, and the preset must move the
logits by far more than that (so the test can fail).

The same holds for fitted recipes with OTT outlier pools (OTT's static rule: pool 3 from layer 2
on), PATS tiers (small ages, 32/64/128 tokens, so blocks change tiers during the 30 decode steps
and a prompt block lands several tiers down at once), and both; there the recipe must also move
the logits away from the same config without the method.
"""

from __future__ import annotations

import pytest
import torch

from kvcalib.methods.outliers import default_pool_sizes
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe, list_presets, load_preset
from kvcalib.recipe import build_codecs
from kvcalib.simulate import simulated_logits
from tests.unit.test_cache import decode_logits

pytestmark = pytest.mark.embedded
# 150-token prompt (full-precision prefill, then flushed), then 30 decode steps: by then KIVI's
# 128-token window has flushed a 32-token group and per-token presets quantize every older token
LENGTH, PROMPT = 180, 150


@pytest.fixture(scope="module")
def smol():
    from kvcalib.data import load_texts
    from kvcalib.models import load_model

    loaded = load_model("smollm2-135m", device="cpu")
    loaded.model.double()
    text = " ".join(load_texts("embedded", split="eval")[:20])
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"][:, :LENGTH]  # (1, LENGTH)
    loaded.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = loaded.model(input_ids=ids).logits  # (1, LENGTH, V) float64
    return loaded, ids, full


@pytest.mark.parametrize("preset", list_presets())
def test_simulation_matches_decode_on_smollm2(smol, preset):
    loaded, ids, full = smol
    rec = load_preset(preset)
    configs = rec.layer_configs(loaded.info.num_layers)
    dec, _ = decode_logits(loaded.model, ids, rec, prompt_len=PROMPT)  # (1, LENGTH, V)
    sim = simulated_logits(loaded.model, ids, configs, build_codecs(rec, configs), prompt_len=PROMPT)
    assert sim.dtype == torch.float64
    scale = float(dec.abs().max())
    assert float((sim - dec).abs().max()) <= 1e-6 * scale
    if preset != "fp16":
        assert float((sim - full).abs().max()) > 1e-3 * scale


# window 32: blocks flush during the prompt and the decode steps; ages 32/64/128 (the first tier
# starts at the window): by token 180 blocks sit at 8, 4 and 2 bits
TIERED = LayerConfig(k_bits=8, v_bits=8, k_group=32, v_group=32, window=32, sinks=4)
TIERS = torch.tensor([[0, 16, 16], [32, 8, 8], [64, 4, 4], [128, 2, 2]])  # (N, 3) (age, k_bits, v_bits)
KIVI_W32 = LayerConfig(k_bits=2, v_bits=2, k_group=32, v_group=32, window=32)


def _fitted(cfg: LayerConfig, n: int, outliers: bool, schedule: bool) -> Recipe:
    tensors = {}
    for i, pool in enumerate(default_pool_sizes(n)):
        if outliers:
            tensors[f"layers.{i}.kv.outlier_pool"] = torch.tensor(pool)
        if schedule:
            tensors[f"layers.{i}.kv.schedule"] = TIERS
    return Recipe(name="fitted", layers=[cfg] * n, tensors=tensors)


@pytest.mark.parametrize("case", ["outliers", "schedule", "outliers+schedule"])
def test_simulation_matches_decode_with_ott_and_pats_on_smollm2(smol, case):
    loaded, ids, full = smol
    n = loaded.info.num_layers
    cfg = KIVI_W32 if case == "outliers" else TIERED
    rec = _fitted(cfg, n, "outliers" in case, "schedule" in case)
    codecs = build_codecs(rec, rec.layers)
    dec, cache = decode_logits(loaded.model, ids, rec, prompt_len=PROMPT)  # (1, LENGTH, V)
    sim = simulated_logits(loaded.model, ids, rec.layers, codecs, prompt_len=PROMPT)
    without = simulated_logits(loaded.model, ids, rec.layers, prompt_len=PROMPT)  # same config, no method
    scale = float(dec.abs().max())
    assert float((sim - dec).abs().max()) <= 1e-6 * scale
    assert float((sim - without).abs().max()) > 1e-3 * scale
    if "schedule" in case:
        assert [s.bits["k"] for s in cache.layers[5].packed.stores if s.n] == [8, 4, 2]
