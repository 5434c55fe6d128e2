"""A left-padded batch on the embedded SmolLM2-135M with the searched recipe: each row's logits
are its prompt's alone (issue 33 item 4), in float64 on the reference path, within the model's
own padded-vs-alone noise (transformers' DynamicCache on the same batch: matmul rounding).

Measured on the 2-core CPU box with this test's inputs (max |logit difference|, logits' scale 33):
DynamicCache 5.0e-14; the searched recipe 5.63 before rows were anchored to their first real
token, 5.0e-14 after (kivi-2: 3.40 before, 5.0e-14 after)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_padded_batches import _teacher_forced

pytestmark = pytest.mark.embedded
RECIPE = "recipes/smollm2-135m/recipe.safetensors"  # 4 sinks, window 64, groups 64, a 4-bit layer, clip


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
    ids_b = torch.stack([torch.cat([torch.zeros(170 - len(s), dtype=torch.long), s]) for s in seqs])
    mask = (torch.arange(170)[None] >= torch.tensor([[0], [170 - lens[1]]])).long()

    def worst(recipe) -> float:
        batch, _ = _teacher_forced(model, recipe, ids_b, mask, new)
        diff = 0.0
        for i, s in enumerate(seqs):
            alone, cache = _teacher_forced(model, recipe, s[None], torch.ones((1, len(s)), dtype=torch.long),
                                           new[i:i + 1])
            diff = max(diff, float((batch[i] - alone[0]).abs().max()))
            if recipe is not None:
                assert cache.layers[0].n_packed == 64  # a block quantized before the teacher-forced steps
        return diff

    noise = worst(None)
    assert noise < 1e-8
    assert worst(RECIPE) <= 4 * noise + 1e-12
