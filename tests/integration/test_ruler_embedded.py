"""A RULER task through lm-evaluation-harness on the real embedded SmolLM2-135M, on the CPU, small:
lm-eval builds and scores the samples, generation runs through ``CompressedCache``, every recipe
sees full precision's prompts, each run's rows reach the caller as it finishes, and lm-eval's own
files are written, with kvcalib's digest as their task hash and the rows readable back from them; and
the samples depend on the seed alone, not on the process that built them."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.embedded, pytest.mark.usefixtures("one_thread_when_busy")]
pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (pip install 'kvcalib[eval]')")


def test_niah_single_1_through_a_compressed_cache(tmp_path, monkeypatch):
    from kvcalib.eval.tasks import TaskConfig, results_from_output, run_tasks
    from kvcalib.models import load_model
    from kvcalib.runtime import cache as cache_mod

    built = []
    original = cache_mod.CompressedCache.from_recipe.__func__

    def counting(cls, model, recipe, **kw):
        built.append(recipe.name if hasattr(recipe, "name") else recipe)
        return original(cls, model, recipe, **kw)

    monkeypatch.setattr(cache_mod.CompressedCache, "from_recipe", classmethod(counting))
    loaded = load_model("smollm2-135m", device="cpu")
    # 384 tokens: a prompt of ~250 tokens (RULER keeps 128 for the answer), longer than KIVI's 128-token
    # window, so the compressed cache holds packed blocks when the answer is generated
    config = TaskConfig(model="smollm2-135m", recipes=["kivi-2"], tasks=("niah_single_1",), context=384, limit=2,
                        max_gen_toks=10, output_path=tmp_path / "lm-eval")
    calls = []
    rows = run_tasks(config, loaded, on_rows=lambda rs: calls.append([r.name for r in rs]))
    assert calls == [["full precision"], ["kivi-2"]]  # one call per run, full precision first
    assert [(r.task, r.name) for r in rows] == [("niah_single_1", "full precision"), ("niah_single_1", "kivi-2")]
    fp, kivi = rows
    assert fp.n == kivi.n == 2 and fp.metric == kivi.metric == "384,none"
    assert fp.prompts_sha256 == kivi.prompts_sha256  # the same samples for both
    assert 0.0 <= kivi.score <= 1.0 and kivi.score_fp == fp.score
    assert fp.effective_bits == 16.0 and kivi.effective_bits < 16.0
    assert built and set(built) == {"kivi-2"}  # every kivi-2 generation built a compressed cache; full precision none
    results = list((tmp_path / "lm-eval").rglob("results_*.json"))
    samples = list((tmp_path / "lm-eval").rglob("samples_niah_single_1_*.jsonl"))
    assert len(results) == 2 and len(samples) == 2, sorted(p.name for p in (tmp_path / "lm-eval").rglob("*"))
    doc = json.loads(next(p for p in results if "kivi-2" in str(p)).read_text())
    assert doc["results"]["niah_single_1"]["384,none"] == pytest.approx(kivi.score)
    assert doc["task_hashes"]["niah_single_1"] == kivi.prompts_sha256  # lm-eval's own hash of the samples
    again, missing = results_from_output(config, loaded.info)
    def fields(r):
        return r.name, r.score, r.score_fp, r.n, r.prompts_sha256, r.effective_bits

    assert missing == [] and [fields(r) for r in again] == [fields(r) for r in rows]

    # The samples are a function of the seed, not of the process: RULER draws its haystacks from the
    # global generators while the task loads, so two loads after different global states must agree
    # (unseeded, they differed per process and the GPU runs' rows paired with other samples).
    import random

    import numpy as np

    from kvcalib.eval.tasks import build_tasks, task_manager, tokenizer_source

    metadata = {"max_seq_lengths": [384], "tokenizer": tokenizer_source(loaded), "pretrained": "smollm2-135m"}
    inputs = []
    for state in (1, 2):
        random.seed(state)
        np.random.seed(state)
        task = build_tasks(task_manager(["niah_single_1"], metadata), ["niah_single_1"], seed=0)["niah_single_1"]
        inputs.append([doc["input"] for doc in list(task.eval_docs)[:3]])
    assert inputs[0] == inputs[1]
