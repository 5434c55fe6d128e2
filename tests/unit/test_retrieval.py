"""Issue 51 on tiny models and without the network: evaluation windows (disjoint as before, evenly
spaced when the text is short, refused past the overlap allowed), the bootstrap interval, the copy
metric (the simulation equals a real decode through CompressedCache), the held-out plays source,
the context a recipe was searched for, the search's long-context defaults, and lm-eval's bad input."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kvcalib.errors import KvcalibError
from kvcalib.eval import EvalConfig, evaluate
from kvcalib.eval.copy import build_copy_inputs, copy_decoded, copy_fp, copy_simulated
from kvcalib.eval.windows import bootstrap_delta_ci, eval_windows, token_stream
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe, beyond_searched_note, build_codecs, resolve_recipe
from tests.conftest import corpus_lines, tiny_loaded_model

LOSSY = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)  # tiny model: head_dim 16
pytestmark = pytest.mark.usefixtures("one_thread_when_busy")



@pytest.fixture(scope="module")
def texts():
    return ["\n".join(corpus_lines(60, seed=s)) for s in range(4)]  # four documents


# ------------------------------------------------------------------ windows
def test_disjoint_windows_are_pack_samples_windows(tiny_tokenizer, texts):
    from kvcalib.data import pack_samples

    win = eval_windows(texts, tiny_tokenizer, 64, 5, seed=3)
    assert torch.equal(win.ids, pack_samples(texts, tiny_tokenizer, 64, 5, seed=3))  # earlier numbers reproduce
    assert win.overlap == 0.0 and win.starts == [0, 64, 128, 192, 256]  # this tokenizer adds no BOS


def test_short_text_gives_evenly_spaced_windows_within_the_overlap_allowed(tiny_tokenizer, texts):
    total = len(token_stream(texts, tiny_tokenizer, seed=0))
    body = 256  # this tokenizer adds no BOS: a window is 256 stream tokens
    n = total // body + 2  # two more windows than fit side by side
    with pytest.raises(KvcalibError, match=r"room for \d+ disjoint window.*\(--ppl-samples\).*\(--ppl-overlap\)"):
        eval_windows(texts, tiny_tokenizer, 256, n, opts={"n": " (--ppl-samples)", "overlap": " (--ppl-overlap)"})
    win = eval_windows(texts, tiny_tokenizer, 256, n, max_overlap=0.9)
    assert win.ids.shape == (n, 256) and 0.0 < win.overlap <= 0.9
    assert win.starts[0] == 0 and win.starts[-1] == total - body  # from the start of the text to its end
    stream = token_stream(texts, tiny_tokenizer, seed=0)
    assert win.ids[-1].tolist() == stream[-body:]
    with pytest.raises(KvcalibError, match="holds .* tokens"):  # not even one window: no overlap helps
        eval_windows(texts, tiny_tokenizer, total + 10, 1, max_overlap=0.9)


def test_bootstrap_interval():
    gen = torch.Generator().manual_seed(0)
    fp = 3.0 + torch.rand(10, 50, generator=gen, dtype=torch.float64)  # (N, S)
    assert bootstrap_delta_ci(fp, fp) == (0.0, 0.0)
    lo, hi = bootstrap_delta_ci(fp + 0.1, fp)  # every token 0.1 nats worse: exactly e^0.1 - 1
    assert lo == pytest.approx(100 * (math.exp(0.1) - 1)) and hi == pytest.approx(lo)
    noisy = fp + 0.05 + 0.1 * torch.randn(10, 50, generator=gen, dtype=torch.float64)
    lo, hi = bootstrap_delta_ci(noisy, fp)
    point = 100 * (math.exp(float(noisy.mean() - fp.mean())) - 1)
    assert lo < point < hi and hi - lo < 10


# ------------------------------------------------------------------ copy
@pytest.fixture(scope="module")
def tiny64(tiny_tokenizer):
    from tests.conftest import tiny_config, tiny_model
    from kvcalib.models import LoadedModel, model_info

    cfg = tiny_config("llama")
    cfg.vocab_size = len(tiny_tokenizer)
    model = tiny_model("llama", config=cfg).double()  # float64: the simulation and a decode agree to rounding
    return LoadedModel(model, tiny_tokenizer, model_info(cfg, "tiny-llama"), source="tiny", resolved="tiny")


def test_copy_inputs_repeat_the_passage(tiny_tokenizer, texts):
    inputs = build_copy_inputs(texts, tiny_tokenizer, passage_len=40, tail=10, n=3)
    assert inputs.ids.shape == (3, 80) and inputs.offset == 0  # 2 x 40 (no BOS with this tokenizer)
    assert torch.equal(inputs.ids[:, :40], inputs.ids[:, 40:])
    assert inputs.prompt_len == 70
    assert len({tuple(r) for r in inputs.ids.tolist()}) == 3  # three different passages


def test_copy_simulation_equals_a_real_decode(tiny64, texts):
    model = tiny64.model
    inputs = build_copy_inputs(texts, tiny64.tokenizer, passage_len=48, tail=12, n=2)
    recipe = Recipe(name="tiny-2bit", default_layer=LOSSY)
    configs = recipe.layer_configs(model.config.num_hidden_layers)
    previous = model.config._attn_implementation
    sim = copy_simulated(model, inputs, configs, build_codecs(recipe, configs))  # (N, tail)
    dec = copy_decoded(model, inputs, recipe)  # (N, tail)
    model.set_attn_implementation(previous)
    fp, reference = copy_fp(model, inputs)
    assert sim.shape == dec.shape == fp.shape == reference.shape == (2, 12)
    assert torch.allclose(sim, dec, atol=1e-6), (sim - dec).abs().max()  # the simulation is the decode
    assert not torch.allclose(sim, fp, atol=1e-3)  # and the 2-bit cache changed something
    lossless = resolve_recipe("fp16")
    dec_fp = copy_decoded(model, inputs, lossless)
    model.set_attn_implementation(previous)
    assert torch.allclose(dec_fp, fp, atol=1e-6)  # an uncompressed cache decodes full precision's numbers


def test_evaluate_ppl_interval_and_copy(tiny_tokenizer, tmp_path):
    loaded = tiny_loaded_model(tiny_tokenizer)
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(corpus_lines(300, seed=2)))
    cfg = EvalConfig(model="tiny", recipes=["fp16", Recipe(name="tiny-2bit", default_layer=LOSSY)], data=str(text),
                     metrics="ppl,copy", ppl_samples=4, ppl_seq_len=48, copy_len=40, copy_tail=8, copy_samples=2,
                     copy_decode=True, context_len=256, batch_size=2)
    fp, lossy = evaluate(cfg, loaded)
    assert fp.ppl_windows == lossy.ppl_windows == 4 and lossy.ppl_overlap == 0.0
    assert fp.ppl_ci_low == fp.ppl_ci_high == 0.0
    assert lossy.ppl_ci_low <= lossy.ppl_delta_pct <= lossy.ppl_ci_high
    assert fp.copy_nll == fp.copy_nll_fp == lossy.copy_nll_fp and fp.copy_passages == 2 and fp.copy_tail == 8
    assert lossy.copy_nll != lossy.copy_nll_fp and lossy.copy_nll_reference == fp.copy_nll_reference
    assert lossy.copy_nll_decode == pytest.approx(lossy.copy_nll, rel=1e-3)  # float32: rounding only
    with pytest.raises(KvcalibError, match=r"--ppl-samples.*--ppl-seq-len.*--data"):
        evaluate(EvalConfig(model="tiny", recipes=["fp16"], data=str(text), metrics="ppl", ppl_samples=500,
                            ppl_seq_len=48), loaded)


# ------------------------------------------------------------------ texts, recipes, search defaults
def test_plays_are_held_out_only():
    from kvcalib.data import resolve_text_source

    assert resolve_text_source("plays", "eval").kind == "plays"
    with pytest.raises(KvcalibError, match="held-out text only"):
        resolve_text_source("plays", "calib")


def test_recipe_records_the_context_it_was_searched_for():
    searched = Recipe(name="s", default_layer=LOSSY, provenance={"made_by": "kvcalib search", "seq_len": 256})
    assert searched.searched_context == 256  # a search from before the field: its scoring windows
    newer = Recipe(name="n", default_layer=LOSSY, provenance={"made_by": "kvcalib search", "seq_len": 8192,
                                                              "searched_context": 8192})
    assert newer.searched_context == 8192
    assert resolve_recipe("kivi-2").searched_context is None
    assert beyond_searched_note(searched, 512) is None  # 2x is fine
    note = beyond_searched_note(searched, 8192)
    assert "256-token" in note and "kvcalib search --context 8192" in note
    assert beyond_searched_note(resolve_recipe("kivi-2"), 10**6) is None


def test_search_scores_at_the_deployed_context_by_default(tmp_path):
    from kvcalib.optimize import LONG_CONTEXT, SearchConfig, long_context_default, search_provenance

    assert long_context_default(None) == LONG_CONTEXT == 8192 and long_context_default(2048) == 2048
    cfg = SearchConfig(out=tmp_path / "r", context=None, score_at_context=True, eval_seq_len=None)
    assert cfg.context is None  # resolved with the model
    cfg.resolve_context(32768)
    assert (cfg.context, cfg.scoring_length, cfg.score_last, cfg.eval_seq_len) == (8192, 8192, 1024, 8192)
    short = SearchConfig(out=tmp_path / "r", context=None, score_at_context=True, eval_seq_len=None)
    short.resolve_context(4096)  # a model whose maximum is below 8192
    assert (short.context, short.scoring_length, short.score_last) == (4096, 4096, 512)
    given = SearchConfig(out=tmp_path / "r", context=2048, score_at_context=True, score_seq_len=256)
    assert given.scoring_length == 256 and given.score_last is None  # an explicit window is scored whole
    assert SearchConfig(out=tmp_path / "r").scoring_length == 256  # the library default is unchanged
    doc = {"config": {"data": "embedded", "seed": 0}, "score_sequences": 2, "score_seq_len": 8192, "trials": [],
           "budget_bits": 3.0, "context": 8192, "study": "s", "score_last": 1024}
    prov = search_provenance(doc, {"kl": 0.1, "effective_bits": 2.9, "number": 0})
    assert prov["searched_context"] == 8192 and prov["score_last"] == 1024


# ------------------------------------------------------------------ lm-eval's bad input
def test_lm_eval_missing_names_the_install(monkeypatch):
    from kvcalib.eval.tasks import require_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    with pytest.raises(KvcalibError, match=r'pip install "kvcalib\[eval\]"'):
        require_lm_eval()


def test_unknown_task_and_cli_refusals(tmp_path):
    pytest.importorskip("lm_eval")
    from typer.testing import CliRunner

    from kvcalib.cli import app
    from kvcalib.eval.tasks import check_tasks

    with pytest.raises(KvcalibError, match=r"'niah_singel_1' \(closest: niah_single_1"):
        check_tasks(["niah_singel_1"])
    runner = CliRunner()
    for args, words in ((["eval", "--preset", "kivi-2", "--tasks", "niah_singel_1"], "closest: niah_single_1"),
                        (["eval", "--preset", "kivi-2", "--tasks", "niah_single_1", "--metrics", "ppl"], "two commands"),
                        (["eval", "--preset", "kivi-2", "--tasks", "niah_single_1", "--limit", "0"], "--limit")):
        res = runner.invoke(app, args)
        lines = res.stderr.splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], (res.exit_code, res.stderr)


def test_lm_eval_command_line_gets_the_tokenizer_folder(monkeypatch, tmp_path):
    pytest.importorskip("lm_eval")
    from kvcalib.eval import tasks

    monkeypatch.setattr(tasks, "prepare_nltk_data", lambda: tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    argv = tasks.prepare_lm_eval_argv(["lm_eval", "--model", "kvcalib", "--model_args", f"pretrained={folder}"])
    assert argv[-1] == f"pretrained={folder},tokenizer={folder}"
    kept = ["lm_eval", "--model", "kvcalib", "--model_args", "pretrained=x/y,tokenizer=z"]
    assert tasks.prepare_lm_eval_argv(list(kept)) == kept


def test_lm_eval_command_line_saves_a_gguf_tokenizer_once(monkeypatch, tmp_path, tiny_tokenizer):
    """RULER loads its tokenizer by a name, and a .gguf's is read only with gguf_file=: the command
    line gets a folder under KVCALIB_HOME holding the GGUF's tokenizer, saved the first time."""
    pytest.importorskip("lm_eval")
    import kvcalib.models
    from kvcalib.eval import tasks

    monkeypatch.setenv("KVCALIB_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tasks, "prepare_nltk_data", lambda: tmp_path)
    loads = []
    monkeypatch.setattr(kvcalib.models, "load_tokenizer", lambda model: loads.append(model) or tiny_tokenizer)
    gguf = tmp_path / "m-Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    for _ in range(2):
        argv = tasks.prepare_lm_eval_argv(["lm_eval", "--model", "kvcalib", "--model_args", f"pretrained={gguf}"])
        folder = tmp_path / "home" / "tokenizers" / "m-Q8_0"
        assert argv[-1] == f"pretrained={gguf},tokenizer={folder}"
        assert (folder / "tokenizer_config.json").is_file()
    assert loads == [str(gguf)]  # saved once, then reused


# ------------------------------------------------------------------ benchmark files
def test_benchmark_rows_merge_and_tables(tmp_path):
    from benchmarks import long_context, ruler

    base = {"model": "m", "context": 8192, "machine": "x", "command": "c"}
    rows = [{**base, "recipe": r, "effective_bits": b, "task": t, "metric": "8192,none", "score": s, "score_fp": 1.0,
             "n": 50} for r, b, t, s in (("full precision", 16.0, "niah_single_1", 1.0), ("kivi-2", 3.2, "niah_single_1", 0.5),
                                          ("kivi-2", 3.2, "ruler_vt", 0.25))]
    path = tmp_path / "ruler.json"
    ruler.merge(rows, path)
    merged = ruler.merge([{**rows[1], "score": 0.75}], path)  # a rerun replaces its row
    assert len(merged) == 3 and [r["score"] for r in merged if r["recipe"] == "kivi-2" and r["task"] == "niah_single_1"] == [0.75]
    table = ruler.markdown(merged)
    # full precision lacks ruler_vt: the mean over the task both have, then the mean over all for kivi-2 alone
    assert "| recipe | eff. bits | niah_single_1 | ruler_vt | mean (1 common) | mean (all 2) |" in table
    assert "| kivi-2 | 3.200 | 0.750 | 0.250 | 0.750 | 0.500 |" in table
    assert "| full precision | 16.000 | 1.000 |  | 1.000 |  |" in table
    assert "| recipe | eff. bits | niah_single_1 | mean |" in ruler.markdown([r for r in merged if r["task"] == "niah_single_1"])
    old = {**base, "recipe": "kivi-2", "effective_bits": 3.2, "metric": "ppl", "ppl": 23.0, "ppl_fp": 20.0,
           "delta_pct": 15.0}  # a row from before --text: a Britannica row without an interval
    new = [{**old, "text": "plays", "ci_low": 10.0, "ci_high": 20.0, "windows": 8, "overlap": 0.0},
           {**base, "recipe": "kivi-2", "effective_bits": 3.2, "metric": "copy", "text": "plays", "nll": 2.0,
            "nll_fp": 0.2, "nll_decode": None, "nll_reference": 3.3, "passages": 4, "tail": 256}]
    lc = tmp_path / "long_context.json"
    long_context.merge([old], lc)
    merged = long_context.merge(new, lc)
    assert len(merged) == 3  # the plays row sits beside the Britannica one
    md = long_context.markdown(merged)
    assert "| m | 8192 | plays | kivi-2 | 3.200 | 23.000 | 20.000 | +15.00% | [+10.00, +20.00] | 8 | x |" in md
    assert "| m | 8192 | longtext | kivi-2 |" in md and "| 2.000 |  | 0.200 | 3.300 | 4 x 256 |" in md


def test_cli_refuses_a_context_beyond_the_model_and_a_text_too_short(tiny_tokenizer, tmp_path):
    """Each one line, exit code 2, nothing written; the context checks run before the model loads."""
    from typer.testing import CliRunner

    from kvcalib.cli import app
    from tests.conftest import tiny_config, tiny_model

    folder = tmp_path / "model"  # max_position_embeddings 512; head_dim 64 for the presets' groups
    cfg = tiny_config("llama", head_dim=64)
    cfg.vocab_size = len(tiny_tokenizer)
    tiny_model("llama", config=cfg).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    short = tmp_path / "short.txt"
    short.write_text("\n".join(corpus_lines(20, seed=3)))
    out = tmp_path / "out.json"
    cases = [(["search", "--model", str(folder), "--context", "1024", "--out", str(tmp_path / "run")],
              "--context 1024 is beyond model's maximum of 512"),
             (["eval", "--model", str(folder), "--preset", "kivi-2", "--metrics", "ppl", "--ppl-seq-len", "1024"],
              "model's maximum of 512"),  # (the preflight's words: "--ppl-seq-len 1024 is over ...")
             (["eval", "--model", str(folder), "--preset", "kivi-2", "--tasks", "niah_single_1", "--context-len", "1024"],
              "maximum of 512"),
             (["eval", "--model", str(folder), "--preset", "kivi-2", "--data", str(short), "--metrics", "ppl",
               "--ppl-samples", "50", "--ppl-seq-len", "64", "--device", "cpu", "--json", str(out)], "(--ppl-samples)")]
    runner = CliRunner()
    for args, words in cases:
        if "--tasks" in args and not _has_lm_eval():
            continue
        res = runner.invoke(app, args)
        # transformers' own weight-loading bar may come first (the text check runs once the model is loaded)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "Loading weights" not in ln]
        assert res.exit_code == 2 and len(lines) == 1 and words in lines[0], (args, res.exit_code, res.stderr)
    assert not out.exists() and not (tmp_path / "run").exists()


def _has_lm_eval() -> bool:
    import importlib.util

    return importlib.util.find_spec("lm_eval") is not None
