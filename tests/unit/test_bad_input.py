"""The bad-input table (issue 36): every command, tried as a new user would get it wrong.

Each case must end with exit code 2, exactly one line on stderr (``kvcalib: error: ...``) that
contains the case's words, no traceback, and no new file anywhere under the test's folder (the
working directory included: default run folders land there). Every refusal happens before a
model loads: a probe of the loader (``kvcalib.models``' load_model, load_tokenizer and the
one-time conversion of an embedded model) fails the case if any of them is called. The cases
tagged ``geometry`` need the model's geometry (positions, layers, the budget's floor) and run a
second time with no converted model on the machine (an empty ``KVCALIB_HOME``): kvcalib's pinned
geometry of the embedded models answers then. Grow the table with each new command and option.

``KVCALIB_TABLE_FIGURES=PATH`` writes the count of cases to PATH as JSON (for docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.layout import LayerConfig
from kvcalib.models import ModelInfo
from kvcalib.recipe import METADATA_KEY, Recipe, load_preset

SMOL = ModelInfo("smollm2-135m", "llama", 30, 9, 3, 64, 8192, (None,) * 30, "cc1cfbf31f103bfa")
QWENISH = ModelInfo("org/other-model", "qwen2", 24, 14, 2, 64, 32768, (None,) * 24, "0123456789abcdef")
HAS_CUDA = torch.cuda.is_available()


@dataclass
class Case:
    id: str
    args: list[str]
    needle: str
    skip: str | None = None  # why the case cannot run on this machine
    tags: tuple[str, ...] = field(default_factory=tuple)


def _search_json(**changes):
    doc = {"trials": [{"number": 0, "state": "COMPLETE", "kl": 0.1, "effective_bits": 3.0,
                       "point": {"group": 32, "window": 64, "sinks": 0, "k_bits": [2], "v_bits": [2]}}],
           "space": {}, "config": {"seed": 0, "data": "embedded"}, "context": 4096, "budget_bits": 3.0,
           "score_sequences": 2, "score_seq_len": 256, "study": "kvcalib-search"}
    doc.update(changes)
    return doc


def make_files(root: Path) -> None:
    """The files the cases refer to as {tmp}/NAME."""
    (root / "nonempty").mkdir()
    (root / "nonempty" / "x").write_text("keep me")
    (root / "afile").write_text("a file, not a folder")
    (root / "garbage.safetensors").write_bytes(b"\x00\x01garbage")
    (root / "empty.json").write_text("")
    (root / "badspace.json").write_text(json.dumps({"bits": [5]}))
    (root / "text.csv").write_text("a,b\n1,2\n")
    (root / "prompt.txt").write_text("The capital of France is")
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("  \n\t\n   \n")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me, na\xefve".encode("latin-1"))
    (root / "rows.jsonl").write_text(json.dumps({"content": "some text"}) + "\n")
    for name in ("stats-only", "with-study", "s-none", "s-notjson", "s-notrials", "s-nopoint", "s-context", "s-bits"):
        (root / name).mkdir()
        (root / name / "stats.safetensors").write_bytes(b"not statistics")
    (root / "with-study" / "study.db").write_bytes(b"not a database")
    (root / "s-notjson" / "search.json").write_text("{not json")
    (root / "s-notrials" / "search.json").write_text(json.dumps(_search_json(trials=None)))
    bad_trial = _search_json()
    del bad_trial["trials"][0]["point"]
    (root / "s-nopoint" / "search.json").write_text(json.dumps(bad_trial))
    (root / "s-context" / "search.json").write_text(json.dumps(_search_json(context=0)))
    (root / "s-bits" / "search.json").write_text(json.dumps(_search_json(budget_bits="three")))
    # recipes: for another model, with a clip tensor of the wrong shape, with a key missing, whose
    # groups cost more than bf16, whose model lists the sliding windows of another layer count
    Recipe(name="foreign", layers=[LayerConfig(k_bits=2, v_bits=2, window=128)] * 24, model=QWENISH).save(
        root / "foreign.safetensors")
    layers = [LayerConfig(k_bits=2, v_bits=2, window=128)] * 30
    bad_clip = Recipe(name="badclip", layers=layers, model=SMOL, tensors={"layers.0.k.clip": torch.full((4, 1), 0.9)})
    save_file({k: v for k, v in bad_clip.tensors.items()}, str(root / "badclip.safetensors"),
              metadata={METADATA_KEY: json.dumps(bad_clip.metadata())})
    doc = load_preset("kivi-2").metadata()
    del doc["default_layer"]["window"]
    (root / "missing-key.json").write_text(json.dumps(doc))
    doc = load_preset("kivi-2").metadata()
    doc["default_layer"].update(k_group=2, v_group=2, window=0)
    (root / "costly.json").write_text(json.dumps(doc))
    doc = Recipe(name="slid", layers=layers, model=SMOL).metadata()
    doc["model"]["sliding_window"] = [None] * 29
    (root / "badsliding.json").write_text(json.dumps(doc))
    # SmolLM2's 30 layers under a header naming gemma3-270m (18 layers): refused before that model
    # is fetched or converted
    Recipe(name="mislabeled", layers=layers, model=dataclasses.replace(SMOL, name="gemma3-270m")).save(
        root / "mislabeled.safetensors")
    doc = load_preset("kivi-2").metadata()
    doc["default_layer"]["sinks"] = 2**31  # a "compressed" preset that keeps every token in bf16
    (root / "sinks.json").write_text(json.dumps(doc))
    tiny = Recipe(name="tinyclip", layers=layers, model=SMOL, tensors={"layers.0.k.clip": torch.full((3, 1), 1e-30)})
    save_file(dict(tiny.tensors), str(root / "tinyclip.safetensors"), metadata={METADATA_KEY: json.dumps(tiny.metadata())})


NO_CUDA = "this machine has CUDA" if HAS_CUDA else None

CASES = [
    # ------------------------------------------------------------------ collect
    Case("collect-unknown-model", ["collect", "--model", "no-such-model", "--out", "{tmp}/o"], "unknown model alias"),
    Case("collect-samples-0", ["collect", "--samples", "0", "--out", "{tmp}/o"], "--samples"),
    Case("collect-seq-len-1", ["collect", "--seq-len", "1", "--out", "{tmp}/o"], "--seq-len"),
    Case("collect-batch-0", ["collect", "--batch-size", "0", "--out", "{tmp}/o"], "--batch-size"),
    Case("collect-reservoir-negative", ["collect", "--reservoir-blocks", "-1", "--out", "{tmp}/o"], "--reservoir-blocks"),
    Case("collect-block-len-over-seq-len", ["collect", "--block-len", "600", "--out", "{tmp}/o"], "--block-len"),
    Case("collect-missing-gguf", ["collect", "--model", "{tmp}/missing.gguf", "--out", "{tmp}/o"], "does not exist"),
    Case("collect-folder-without-config", ["collect", "--model", "{tmp}/nonempty", "--out", "{tmp}/o"], "config.json"),
    Case("collect-out-not-empty", ["collect", "--out", "{tmp}/nonempty"], "not empty"),
    Case("collect-out-is-a-file", ["collect", "--out", "{tmp}/afile"], "is a file"),
    Case("collect-out-under-a-file", ["collect", "--out", "{tmp}/afile/run"], "is a file, not a folder"),
    Case("collect-device-tpu", ["collect", "--device", "tpu", "--out", "{tmp}/o"], "not a device"),
    Case("collect-device-cuda", ["collect", "--device", "cuda", "--out", "{tmp}/o"], "no usable CUDA", NO_CUDA),
    Case("collect-dtype-fp8", ["collect", "--dtype", "fp8", "--out", "{tmp}/o"], "--dtype"),
    Case("collect-data-missing", ["collect", "--data", "{tmp}/missing.txt", "--out", "{tmp}/o"], "does not exist"),
    Case("collect-data-csv", ["collect", "--data", "{tmp}/text.csv", "--out", "{tmp}/o"], "Unsupported data file type"),
    Case("collect-text-field-embedded", ["collect", "--text-field", "x", "--out", "{tmp}/o"], "--text-field"),
    Case("collect-split-unknown", ["collect", "--split", "nope", "--out", "{tmp}/o"], "splits"),
    Case("collect-data-empty", ["collect", "--data", "{tmp}/empty.txt", "--out", "{tmp}/o"], "No non-empty texts"),
    Case("collect-data-whitespace", ["collect", "--data", "{tmp}/blank.txt", "--out", "{tmp}/o"], "No non-empty texts"),
    Case("collect-data-not-utf8", ["collect", "--data", "{tmp}/latin1.txt", "--out", "{tmp}/o"], "is not UTF-8 text"),
    Case("collect-jsonl-no-column", ["collect", "--data", "{tmp}/rows.jsonl", "--text-field", "text", "--out",
                                     "{tmp}/o"], "has no column 'text'; its columns are: content"),
    Case("collect-seq-len-over-positions", ["collect", "--seq-len", "1000000", "--out", "{tmp}/o"],
         "--seq-len 1000000 is over smollm2-135m's maximum of 8192 positions", tags=("geometry",)),
    Case("collect-samples-not-int", ["collect", "--samples", "x"], "Invalid value for '--samples'"),
    Case("collect-unknown-option", ["collect", "--sampels", "3"], "No such option: --sampels"),
    # ------------------------------------------------------------------ search
    Case("search-negative-budget", ["search", "--budget-bits", "-1", "--out", "{tmp}/o"], "--budget-bits"),
    Case("search-nan-budget", ["search", "--budget-bits", "nan", "--out", "{tmp}/o"], "--budget-bits"),
    Case("search-zero-workers", ["search", "--workers", "0", "--out", "{tmp}/o"], "--workers '0' must be auto"),
    Case("search-word-workers", ["search", "--workers", "two", "--out", "{tmp}/o"], "--workers 'two' must be auto"),
    Case("search-zero-heartbeat", ["search", "--heartbeat", "0", "--out", "{tmp}/o"], "--heartbeat must be"),
    Case("search-unknown-objective", ["search", "--objective", "best", "--out", "{tmp}/o"], "--objective 'best'"),
    Case("search-score-last-over-window", ["search", "--score-seq-len", "1024", "--score-last", "5000", "--out",
                                           "{tmp}/o"], "--score-last must be an integer in [1, 1024)"),
    Case("eval-passkey-depths-text", ["eval", "--preset", "kivi-2", "--metrics", "passkey", "--passkey-depths", "x"],
         "--passkey-depths 'x'"),
    Case("search-trials-0", ["search", "--trials", "0", "--out", "{tmp}/o"], "--trials"),
    Case("search-score-samples-0", ["search", "--score-samples", "0", "--out", "{tmp}/o"], "--score-samples"),
    Case("search-context-0", ["search", "--context", "0", "--out", "{tmp}/o"], "--context"),
    Case("search-eval-seq-len-1", ["search", "--eval-seq-len", "1", "--out", "{tmp}/o"], "--eval-seq-len"),
    Case("search-timeout-negative", ["search", "--timeout", "-5", "--out", "{tmp}/o"], "--timeout"),
    Case("search-study-empty", ["search", "--study", " ", "--out", "{tmp}/o"], "--study"),
    Case("search-finish-unknown", ["search", "--finish", "nope", "--out", "{tmp}/o"], "--finish"),
    Case("search-seq-len-quantizes-nothing", ["search", "--score-seq-len", "64", "--out", "{tmp}/o"],
         "--score-seq-len 197"),
    Case("search-space-empty", ["search", "--space", "{tmp}/empty.json", "--out", "{tmp}/o"], "empty"),
    Case("search-space-missing", ["search", "--space", "{tmp}/missing.json", "--out", "{tmp}/o"], "missing.json"),
    Case("search-space-bad-bits", ["search", "--space", "{tmp}/badspace.json", "--out", "{tmp}/o"], "not allowed"),
    Case("search-storage-not-url", ["search", "--storage", "not a url", "--out", "{tmp}/o"], "neither a database URL"),
    Case("search-storage-missing-dir", ["search", "--storage", "sqlite:///{tmp}/missing/dir/s.db", "--out", "{tmp}/o"],
         "does not exist"),
    Case("search-storage-journal-missing-dir", ["search", "--storage", "journal:{tmp}/nope/j.log", "--out", "{tmp}/o"],
         "does not exist"),
    Case("search-resume-new-folder", ["search", "--resume", "--out", "{tmp}/o"], "nothing to resume"),
    Case("search-resume-without-study", ["search", "--resume", "--out", "{tmp}/stats-only"], "no study yet"),
    Case("search-study-without-resume", ["search", "--out", "{tmp}/with-study"], "pass --resume"),
    Case("search-out-not-empty", ["search", "--out", "{tmp}/nonempty"], "not empty"),
    Case("search-out-is-a-file", ["search", "--out", "{tmp}/afile"], "is a file"),
    Case("search-unknown-model", ["search", "--model", "nope", "--out", "{tmp}/o"], "unknown model alias"),
    Case("search-data-missing", ["search", "--data", "{tmp}/missing.txt", "--out", "{tmp}/o"], "does not exist"),
    Case("search-device-tpu", ["search", "--device", "tpu", "--out", "{tmp}/o"], "not a device"),
    Case("search-device-cuda", ["search", "--device", "cuda:3", "--out", "{tmp}/o"], "no usable CUDA", NO_CUDA),
    Case("search-dtype-int4", ["search", "--dtype", "int4", "--out", "{tmp}/o"], "--dtype"),
    Case("search-budget-below-floor", ["search", "--budget-bits", "0.5", "--out", "{tmp}/o"],
         "below the floor of the search space", tags=("geometry",)),
    Case("search-data-whitespace", ["search", "--data", "{tmp}/blank.txt", "--out", "{tmp}/o"], "No non-empty texts"),
    Case("search-eval-seq-len-over-positions", ["search", "--eval-seq-len", "9000", "--out", "{tmp}/o"],
         "--eval-seq-len 9000 is over smollm2-135m's maximum of 8192", tags=("geometry",)),
    # ------------------------------------------------------------------ export
    Case("export-missing-run", ["export", "{tmp}/missing", "-o", "{tmp}/r.safetensors"], "does not exist"),
    Case("export-run-without-stats", ["export", "{tmp}/nonempty", "-o", "{tmp}/r.safetensors"], "no stats.safetensors"),
    Case("export-run-is-a-file", ["export", "{tmp}/rows.jsonl", "-o", "{tmp}/r.safetensors"],
         "is a file, not a run folder"),
    Case("export-out-exists", ["export", "{tmp}/stats-only", "-o", "{tmp}/afile"], "already exists"),
    Case("export-out-is-a-folder", ["export", "{tmp}/stats-only", "-o", "{tmp}/nonempty"], "is a folder"),
    Case("export-out-under-a-file", ["export", "{tmp}/stats-only", "-o", "{tmp}/afile/r.safetensors"], "not a folder"),
    Case("export-bad-bits", ["export", "{tmp}/stats-only", "-o", "{tmp}/r.safetensors", "--bits", "k5v2"], "--bits"),
    Case("export-bad-format", ["export", "{tmp}/stats-only", "-o", "{tmp}/r.safetensors", "--format", "onnx"], "--format"),
    Case("export-window-under-group", ["export", "{tmp}/stats-only", "-o", "{tmp}/r.safetensors", "--window", "8"],
         "window (8) is shorter than a group"),
    Case("export-outliers-negative", ["export", "{tmp}/stats-only", "-o", "{tmp}/r.safetensors", "--outliers", "-1"],
         "--outliers"),
    Case("export-schedule-unknown", ["export", "{tmp}/stats-only", "-o", "{tmp}/r.safetensors", "--bits", "k8v8",
                                     "--schedule", "nope"], "--schedule"),
    Case("export-ages-without-schedule", ["export", "{tmp}/stats-only", "-o", "{tmp}/r.safetensors",
                                          "--schedule-ages", "5"], "--schedule-ages"),
    Case("export-fp8-sub8bit", ["export", "{tmp}/stats-only", "-o", "{tmp}/ct", "--format", "compressed-tensors",
                                "--bits", "k2v2"], "cannot be expressed"),
    Case("export-corrupt-stats", ["export", "{tmp}/stats-only", "-o", "{tmp}/r.safetensors"], "corrupt or truncated"),
    Case("export-point-and-flags", ["export", "{tmp}/s-none", "-o", "{tmp}/r.safetensors", "--budget-bits", "3",
                                    "--clip"], "pass one kind or the other"),
    Case("export-budget-and-trial", ["export", "{tmp}/s-none", "-o", "{tmp}/r.safetensors", "--budget-bits", "3",
                                     "--trial", "0"], "exactly one"),
    Case("export-no-search-json", ["export", "{tmp}/s-none", "-o", "{tmp}/r.safetensors", "--budget-bits", "3"],
         "no search.json"),
    Case("export-search-json-not-json", ["export", "{tmp}/s-notjson", "-o", "{tmp}/r.safetensors", "--trial", "0"],
         "not readable JSON"),
    Case("export-search-json-no-trials", ["export", "{tmp}/s-notrials", "-o", "{tmp}/r.safetensors", "--trial", "0"],
         "field trials"),
    Case("export-search-json-no-point", ["export", "{tmp}/s-nopoint", "-o", "{tmp}/r.safetensors", "--trial", "0"],
         "trials[0].point"),
    Case("export-search-json-context-0", ["export", "{tmp}/s-context", "-o", "{tmp}/r.safetensors", "--trial", "0"],
         "field context"),
    Case("export-search-json-budget-text", ["export", "{tmp}/s-bits", "-o", "{tmp}/r.safetensors", "--trial", "0"],
         "field budget_bits"),
    Case("export-missing-out", ["export", "{tmp}/stats-only"], "Missing option '-o'"),
    # ------------------------------------------------------------------ run
    Case("run-empty-prompt", ["run", "--recipe", "kivi-2", "--prompt", "   "], "prompt is empty"),
    Case("run-no-prompt", ["run", "--recipe", "kivi-2"], "exactly one of --prompt"),
    Case("run-both-prompts", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--prompt-file", "{tmp}/prompt.txt"],
         "exactly one of --prompt"),
    Case("run-prompt-file-missing", ["run", "--recipe", "kivi-2", "--prompt-file", "{tmp}/missing.txt"], "cannot read"),
    Case("run-unknown-preset", ["run", "--recipe", "kivi-9", "--prompt", "hi"], "does not exist"),
    Case("run-max-new-tokens-0", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--max-new-tokens", "0"],
         "--max-new-tokens"),
    Case("run-cuda-graph-on-cpu", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--device", "cpu", "--cuda-graph"],
         "--cuda-graph needs a CUDA"),
    Case("run-temperature-negative", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--temperature", "-1"],
         "--temperature"),
    Case("run-top-p-over-1", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--temperature", "1", "--top-p", "2"],
         "--top-p"),
    Case("run-top-k-greedy", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--top-k", "5"], "--top-k"),
    Case("run-device-tpu", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--device", "tpu"], "not a device"),
    Case("run-device-cuda", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--device", "cuda"], "no usable CUDA",
         NO_CUDA),
    Case("run-corrupt-recipe", ["run", "--recipe", "{tmp}/garbage.safetensors", "--prompt", "hi"], "corrupt or truncated"),
    Case("run-foreign-recipe", ["run", "--recipe", "{tmp}/foreign.safetensors", "--model", "smollm2-135m", "--prompt",
                                "hi"], "was fitted for org/other-model"),
    Case("run-recipe-key-missing", ["run", "--recipe", "{tmp}/missing-key.json", "--prompt", "hi"], "lacks ['window']"),
    Case("run-recipe-bad-clip", ["run", "--recipe", "{tmp}/badclip.safetensors", "--prompt", "hi"],
         "layers.0.k.clip must have shape (H, 1) = (3, 1)"),
    Case("run-recipe-header-names-another-model", ["run", "--recipe", "{tmp}/mislabeled.safetensors", "--prompt", "hi"],
         "was fitted for gemma3-270m and does not fit this model: model.num_layers is 18, the recipe expects 30",
         tags=("geometry",)),
    Case("run-max-new-tokens-over-positions", ["run", "--recipe", "kivi-2", "--prompt", "hi", "--max-new-tokens",
                                               "100000"], "--max-new-tokens 100000 is over", tags=("geometry",)),
    Case("run-preset-sinks-beyond-positions", ["run", "--recipe", "{tmp}/sinks.json", "--prompt", "hi"],
         "sinks 2147483648 + window 128 are beyond smollm2-135m's 8192 positions", tags=("geometry",)),
    Case("run-clip-zeroes-a-channel", ["run", "--recipe", "{tmp}/tinyclip.safetensors", "--prompt", "hi"],
         "k.clip must lie in [0.000976562, 1]"),
    # ------------------------------------------------------------------ eval
    Case("eval-no-recipe", ["eval"], "no recipe to evaluate"),
    Case("eval-unknown-metric", ["eval", "--preset", "kivi-2", "--metrics", "nope"], "unknown metric"),
    Case("eval-passkey-not-ints", ["eval", "--preset", "kivi-2", "--passkey-lengths", "x"], "--passkey-lengths"),
    Case("eval-passkey-too-short", ["eval", "--preset", "kivi-2", "--passkey-lengths", "10"], "passkey_lengths"),
    Case("eval-context-0", ["eval", "--preset", "kivi-2", "--context-len", "0"], "context_len"),
    Case("eval-ppl-seq-len-1", ["eval", "--preset", "kivi-2", "--ppl-seq-len", "1"], "ppl_seq_len"),
    Case("eval-json-under-a-file", ["eval", "--preset", "kivi-2", "--json", "{tmp}/afile/out.json"], "not a folder"),
    Case("eval-json-is-a-folder", ["eval", "--preset", "kivi-2", "--json", "{tmp}/nonempty"], "is a folder"),
    Case("eval-device-tpu", ["eval", "--preset", "kivi-2", "--device", "tpu"], "not a device"),
    Case("eval-unknown-model", ["eval", "--preset", "kivi-2", "--model", "nope"], "unknown model alias"),
    Case("eval-data-missing", ["eval", "--preset", "kivi-2", "--data", "{tmp}/missing.txt"], "does not exist"),
    Case("eval-foreign-recipe", ["eval", "--preset", "kivi-2", "--recipe", "{tmp}/foreign.safetensors"],
         "was fitted for org/other-model"),
    Case("eval-unknown-preset", ["eval", "--preset", "kivi-3"], "does not exist"),
    Case("eval-data-empty", ["eval", "--preset", "kivi-2", "--data", "{tmp}/empty.txt"], "No non-empty texts"),
    Case("eval-ppl-seq-len-over-positions", ["eval", "--preset", "kivi-2", "--ppl-seq-len", "9000"],
         "--ppl-seq-len 9000 is over smollm2-135m's maximum of 8192", tags=("geometry",)),
    Case("eval-passkey-over-positions", ["eval", "--preset", "kivi-2", "--metrics", "passkey", "--passkey-lengths",
                                         "8190"], "--passkey-lengths 8190 (and 10 tokens beside it: 8200) is over",
         tags=("geometry",)),
    Case("eval-recipe-header-names-another-model", ["eval", "--recipe", "{tmp}/mislabeled.safetensors", "--model",
                                                    "gemma3-270m"], "model.num_layers is 18", tags=("geometry",)),
    # ------------------------------------------------------------------ inspect
    Case("inspect-missing", ["inspect", "{tmp}/nope.safetensors"], "does not exist"),
    Case("inspect-garbage", ["inspect", "{tmp}/garbage.safetensors"], "corrupt or truncated"),
    Case("inspect-context-0", ["inspect", "kivi-2", "--context", "0"], "--context 0"),
    Case("inspect-context-negative", ["inspect", "kivi-2", "--context", "-4096"], "--context -4096"),
    Case("inspect-unknown-model", ["inspect", "kivi-2", "--model", "nope"], "unknown model alias"),
    Case("inspect-diff-missing", ["inspect", "kivi-2", "--diff", "{tmp}/nope.safetensors"], "does not exist"),
    Case("inspect-foreign-for-model", ["inspect", "{tmp}/foreign.safetensors", "--model", "smollm2-135m"],
         "was fitted for org/other-model"),
    Case("inspect-bad-clip", ["inspect", "{tmp}/badclip.safetensors"], "k.clip must have shape"),
    Case("inspect-key-missing", ["inspect", "{tmp}/missing-key.json"], "no defaults are assumed"),
    Case("inspect-costlier-than-bf16", ["inspect", "{tmp}/costly.json"], "bf16 costs 16"),
    Case("inspect-sliding-window-length", ["inspect", "{tmp}/badsliding.json"], "sliding_window"),
    Case("inspect-sinks-beyond-positions", ["inspect", "{tmp}/sinks.json"], "are beyond smollm2-135m's 8192 positions",
         tags=("geometry",)),
    Case("inspect-clip-zeroes-a-channel", ["inspect", "{tmp}/tinyclip.safetensors"], "k.clip must lie in"),
    # ------------------------------------------------------------------ bench, and no command at all
    Case("bench-without-cuda", ["bench", "grid", "--rows", "quick"], "needs a CUDA GPU", NO_CUDA),
    Case("unknown-command", ["nope"], "No such command 'nope'"),
]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


LOADERS = ("load_model", "load_tokenizer", "ensure_embedded_folder")  # kvcalib.models: weights, tokenizer, conversion


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The loader probe: every call of a :data:`LOADERS` function is recorded and refused (the
    commands import them from ``kvcalib.models`` when they run, so the patched ones are called)."""
    import kvcalib.models

    calls: list[str] = []

    def probe(name: str):
        def refused(*args, **kwargs):
            calls.append(f"{name}{args}")
            raise RuntimeError(f"the bad-input table loaded a model: {name}{args}")
        return refused

    for name in LOADERS:
        monkeypatch.setattr(kvcalib.models, name, probe(name))
    return calls


def _check_case(case: Case, tmp_path: Path, monkeypatch, loads: list[str]) -> None:
    if case.skip:
        pytest.skip(case.skip)
    make_files(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a default run folder (artifacts/runs/...) would appear here
    before = _tree(tmp_path)
    result = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in case.args])
    assert loads == [], loads
    stderr = result.stderr
    assert result.exit_code == 2, (result.exit_code, stderr, result.stdout)
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcalib: error: "), stderr
    assert case.needle in lines[0], lines[0]
    assert "Traceback" not in result.stdout + stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert _tree(tmp_path) == before, sorted(_tree(tmp_path) ^ before)
    assert (tmp_path / "nonempty" / "x").read_text() == "keep me"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, monkeypatch, loads):
    _check_case(case, tmp_path, monkeypatch, loads)


GEOMETRY = [c for c in CASES if "geometry" in c.tags]


@pytest.mark.parametrize("case", GEOMETRY, ids=[c.id for c in GEOMETRY])
def test_bad_input_before_any_model_was_converted(case: Case, tmp_path, tmp_path_factory, monkeypatch, loads):
    """The geometry cases on a machine where no embedded model was ever converted: refused the
    same way, from the geometry kvcalib pins (nothing is fetched, converted or loaded)."""
    monkeypatch.setenv("KVCALIB_HOME", str(tmp_path_factory.mktemp("empty-home")))
    _check_case(case, tmp_path, monkeypatch, loads)


def test_table_covers_every_command():
    """Every command of the CLI has rows in the table (a new command must add its bad inputs)."""
    from typer.main import get_command

    commands = set(get_command(app).commands)  # type: ignore[attr-defined]
    covered = {c.args[0] for c in CASES}
    assert commands <= covered, sorted(commands - covered)
    if os.environ.get("KVCALIB_TABLE_FIGURES"):
        runnable = [c for c in CASES if not c.skip]
        Path(os.environ["KVCALIB_TABLE_FIGURES"]).write_text(json.dumps(
            {"cases": len(CASES), "runnable_here": len(runnable),
             "by_command": {cmd: sum(c.args[0] == cmd for c in CASES) for cmd in sorted(covered)}}, indent=2) + "\n")


# ------------------------------------------------------------------ the boundary itself
def _raise(err: BaseException):
    def fn(*args, **kwargs):
        raise err
    return fn


def test_a_bug_keeps_its_traceback_and_asks_for_a_report(monkeypatch):
    import kvcalib.inspect

    monkeypatch.setattr(kvcalib.inspect, "inspect_recipe", _raise(KeyError("layers")))
    result = CliRunner().invoke(app, ["inspect", "kivi-2"])
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "KeyError: 'layers'" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("kvcalib: error: this is a bug in kvcalib")


@pytest.mark.parametrize("err, words", [
    (OSError(28, "No space left on device", "/data/out.json"), "no space left on the device: free some space"),
    (OSError(30, "Read-only file system", "/data/out.json"), "read-only"),
    (PermissionError(13, "Permission denied", "/data/out.json"), "permission denied"),
    (FileNotFoundError(2, "No such file or directory", "/data/study.log"), "moved or deleted"),
], ids=["full-disk", "read-only", "permission", "vanished"])
def test_environment_errors_are_one_line(monkeypatch, err, words):
    import kvcalib.inspect

    monkeypatch.setattr(kvcalib.inspect, "inspect_recipe", _raise(err))
    result = CliRunner().invoke(app, ["inspect", "kivi-2"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1 and words in result.stderr and err.filename in result.stderr
    assert "Traceback" not in result.stderr


class OutOfMemoryError(RuntimeError):
    """Named as torch's (torch.OutOfMemoryError), which the boundary recognises by name."""


@pytest.mark.parametrize("err", [
    OutOfMemoryError("CUDA out of memory. Tried to allocate 55.93 GiB. GPU 0 has a total capacity of 79.18 GiB "
                     "of which 5.81 GiB is free. Including non-PyTorch memory, this process has 73.36 GiB"),
    MemoryError(),
], ids=["gpu", "host"])
def test_out_of_memory_is_one_line_naming_the_fix(monkeypatch, err):
    """A context the machine cannot hold, found only mid-run (a GPU's allocator or the host's): one
    line, exit 2, naming the options that shrink the work."""
    import kvcalib.inspect

    monkeypatch.setattr(kvcalib.inspect, "inspect_recipe", _raise(err))
    result = CliRunner().invoke(app, ["inspect", "kivi-2"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "out of memory" in result.stderr and "--ppl-seq-len" in result.stderr
    assert "Traceback" not in result.stderr and "Including non-PyTorch" not in result.stderr
    if isinstance(err, OutOfMemoryError):
        assert "Tried to allocate 55.93 GiB" in result.stderr


def _raised_from(driver_error: BaseException) -> RuntimeError:
    """A wrapper raised from a database driver's error, as Optuna's storage raises one."""
    try:
        try:
            raise driver_error
        except type(driver_error) as inner:
            raise RuntimeError("An exception is raised during the commit.") from inner
    except RuntimeError as outer:
        return outer


def _inspect_failing_with(monkeypatch, err: BaseException):
    """``kvcalib inspect kivi-2`` with ``err`` raised under it."""
    import kvcalib.inspect

    monkeypatch.setattr(kvcalib.inspect, "inspect_recipe", _raise(err))
    return CliRunner().invoke(app, ["inspect", "kivi-2"])


def test_a_storage_error_is_one_line_naming_the_drivers_words(monkeypatch):
    """A wrapper raised from sqlite3's error (as Optuna's storage raises one) is read down to the
    driver's words."""
    import sqlite3

    result = _inspect_failing_with(monkeypatch, _raised_from(sqlite3.OperationalError("database or disk is full")))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no space left on the device holding the study's database" in result.stderr


def test_a_postgresql_drivers_error_is_a_storage_failure_too(monkeypatch):
    """The command line and the search's mid-search handler share one classifier: a PostgreSQL
    driver's error (psycopg) reaching the command line is one line, not a traceback."""
    OperationalError = type("OperationalError", (Exception,), {"__module__": "psycopg.errors"})
    driver = OperationalError("connection to server at 127.0.0.1, port 5432 failed: Connection refused")
    result = _inspect_failing_with(monkeypatch, _raised_from(driver))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "the study storage failed (OperationalError: connection to server" in result.stderr


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch):
    import kvcalib.inspect

    monkeypatch.setattr(kvcalib.inspect, "inspect_recipe", _raise(KeyboardInterrupt()))
    result = CliRunner().invoke(app, ["inspect", "kivi-2"])
    assert result.exit_code == 130
    assert result.stderr.count("\n") == 1 and "interrupted" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------ the probe, the pinned geometry, informational fields
def test_the_loader_probe_sees_a_model_load(tmp_path, monkeypatch, loads):
    """The probe can fail: with the preflight's length check taken out, `collect --seq-len 1000000`
    reaches the loader (and the table would say so)."""
    import kvcalib.preflight

    monkeypatch.setattr(kvcalib.preflight, "collect_inputs", lambda *args, **kwargs: None)
    CliRunner().invoke(app, ["collect", "--seq-len", "1000000", "--out", str(tmp_path / "o")])
    assert loads and loads[0].startswith("load_model")


def test_the_pinned_geometry_is_the_models_own():
    """kvcalib's pinned geometry of each embedded model equals what its converted config says
    (where it was converted on this machine) and what the recipes shipped for it record."""
    from kvcalib.preflight import EMBEDDED_GEOMETRY, model_info_offline
    from kvcalib.recipe import Recipe

    root = Path(__file__).resolve().parents[2] / "recipes"
    checked = 0
    for alias, pinned in EMBEDDED_GEOMETRY.items():
        sources = [r.model for r in (Recipe.load(p) for p in sorted(root.glob(f"{alias}/**/recipe.safetensors")))]
        sources.append(model_info_offline(alias))
        for info in filter(None, sources):
            assert {k: getattr(info, k) for k in pinned} == pinned, alias
            checked += 1
    assert checked >= 2  # the recipes shipped for smollm2-135m and qwen2.5-coder-0.5b at least


def test_inspect_shows_informational_fields_it_cannot_read_and_sets_aside_a_context_beyond_the_model(tmp_path):
    """Provenance is informational: a method's record of another shape (a number where a list
    was written) is shown as it is, never a TypeError; a recorded context beyond the model's
    positions is not used (memory is counted at 4096, and a note says why)."""
    doc = Recipe(name="odd", layers=[LayerConfig(k_bits=2, v_bits=2, window=128)] * 30, model=SMOL,
                 provenance={"context": 4_096_000, "huffman": {"bits_per_symbol": {"v": 3.5, "k": "x"},
                                                               "uncoded": 7}}).metadata()
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0, result.stderr
    assert "(context 4096)" in result.stdout and "at 4096000" not in result.stdout
    assert "the recorded context 4,096,000 is beyond smollm2-135m's 8,192 positions" in result.stdout
    assert '"bits_per_symbol": {"k": "x", "v": 3.5}' in result.stdout
    report = json.loads(CliRunner().invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert report["context"] == 4096 and report["context_note"]
