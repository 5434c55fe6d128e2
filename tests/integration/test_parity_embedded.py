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
"""

from __future__ import annotations

import pytest
import torch

from kvcalib.recipe import list_presets, load_preset
from kvcalib.runtime.state import build_codecs
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
