"""``evaluate`` on the real embedded SmolLM2-135M with small sizes: the baselines order as they
must (fp16 < KIVI-4 < KIVI-2 in perplexity, the reverse in bits) on held-out text."""

from __future__ import annotations

import math

import pytest

from kvcalib.eval import EvalConfig, evaluate, results_table_columns, results_table_rows
from kvcalib.eval.harness import eval_texts

pytestmark = [pytest.mark.embedded, pytest.mark.usefixtures("one_thread_when_busy")]  # see tests/conftest.py


@pytest.fixture(scope="module")
def smollm2():
    from kvcalib.models import load_model

    return load_model("smollm2-135m", device="cpu")


def test_eval_texts_are_the_held_out_split():
    from kvcalib.data import load_texts

    held_out = eval_texts("embedded")
    assert held_out == load_texts("embedded", "eval")
    assert not set(held_out) & set(load_texts("embedded", "calib"))


def test_baselines_on_smollm2(smollm2):
    # sequences longer than KIVI's 128-token window + one 32-token group, so KIVI compresses
    cfg = EvalConfig(recipes=["fp16", "kivi-4", "kivi-2"], ppl_samples=2, ppl_seq_len=256,
                     agreement_prompts=2, agreement_prompt_len=192, agreement_tokens=16,
                     passkey_lengths=(512,), passkey_depths=(0.1, 0.5), passkey_trials=1, batch_size=2)
    fp16, kivi4, kivi2 = evaluate(cfg, smollm2)

    assert fp16.ppl_delta_pct == 0.0 and fp16.ppl == fp16.ppl_fp
    assert math.isfinite(fp16.ppl) and 5 < fp16.ppl < 200
    assert fp16.ppl < kivi4.ppl < kivi2.ppl
    assert kivi2.ppl_delta_pct > kivi4.ppl_delta_pct > 0
    assert fp16.ppl_tokens == kivi4.ppl_tokens == kivi2.ppl_tokens == 2 * 255

    assert fp16.effective_bits == 16.0
    assert kivi2.effective_bits < kivi4.effective_bits < 16.0
    assert kivi2.kv_bytes < kivi4.kv_bytes < fp16.kv_bytes
    assert {r.context_len for r in (fp16, kivi4, kivi2)} == {4096}

    assert fp16.agreement == 1.0 and fp16.first_divergence == 16.0
    for r in (kivi4, kivi2):
        assert 0.0 <= r.agreement <= 1.0 and 0.0 <= r.first_divergence <= 16.0
        assert r.passkey_fp == fp16.passkey_fp
        assert set(r.passkey_cells) == {"512@0.1", "512@0.5"}
    assert fp16.passkey == fp16.passkey_fp  # the fp16 preset through the runtime cache = full precision

    cols, rows = results_table_columns([fp16, kivi4, kivi2]), results_table_rows([fp16, kivi4, kivi2])
    assert [r[0] for r in rows] == ["fp16", "kivi-4", "kivi-2"] and all(len(r) == len(cols) for r in rows)
    print("\n" + "\n".join(" | ".join(str(c) for c in row) for row in [cols, *rows]))
