"""A left-padded batch on the embedded SmolLM2-135M with the searched recipe: each row's logits
are its prompt's alone (issue 33 item 4), in float64 on the reference path, within the model's
own padded-vs-alone noise (transformers' DynamicCache on the same batch: matmul rounding).

Measured on the 2-core CPU box with this test's inputs (max |logit difference|, logits' scale 33):
DynamicCache 5.0e-14; the searched recipe 5.63 before rows were anchored to their first real
token, 5.0e-14 after (kivi-2: 3.40 before, 5.0e-14 after)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_padded_batches import padded_vs_alone

pytestmark = pytest.mark.embedded
RECIPE = "recipes/smollm2-135m/short-256-3.0b/recipe.safetensors"  # 4 sinks, window 64, groups 64, a 4-bit layer, clip


def test_left_padded_rows_equal_each_prompt_alone_on_smollm2(monkeypatch):
    from kvcalib.data import load_texts
    from kvcalib.models import load_model

    monkeypatch.setenv("KVCALIB_BACKEND", "reference")
    loaded = load_model("smollm2-135m", device="cpu")
    model = loaded.model.double()
    model.set_attn_implementation("sdpa")
    ids = loaded.tokenizer(" ".join(load_texts("embedded", split="eval")[:20]), return_tensors="pt")["input_ids"][0]
    lens = (170, 141)  # > 4 sinks + 64 window + 64 block: both rows flush blocks in the prompt
    seqs = [ids[:lens[0]], ids[300:300 + lens[1]]]
    new = torch.stack([ids[200:206], ids[500:506]])  # (2, 6) teacher-forced tokens
    noise, _ = padded_vs_alone(model, None, seqs, new)
    assert noise < 1e-8
    diff, caches = padded_vs_alone(model, RECIPE, seqs, new)
    assert all(c.layers[0].n_packed == 64 for c in caches)  # a block quantized before the teacher-forced steps
    assert diff <= 4 * noise + 1e-12
