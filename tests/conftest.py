"""Shared fixtures: tiny random models of real architectures, built from configs (no network)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("KVCALIB_QUIET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# two threads at most (CI has 2 cores), shared among pytest-xdist's workers (`make test` runs 2):
# a worker per core with one thread each, not 4 threads fighting over 2 cores
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

def _sigint_state() -> tuple:
    """SIGINT as this process handles it: Python's handler, and whether the OS ignores or blocks it
    (``/proc/self/status``: what a subprocess started now inherits)."""
    import signal

    try:
        status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
        bit = 1 << (signal.SIGINT - 1)
        os_level = (bool(int(status["SigIgn"], 16) & bit), bool(int(status["SigBlk"], 16) & bit))
    except (OSError, KeyError, ValueError):  # not Linux
        os_level = (False, False)
    return signal.getsignal(signal.SIGINT), os_level


def _put_sigint_back(when: str) -> None:
    """Python's own SIGINT set-up again (see :func:`_sigint_as_python_sets_it_up`); a warning names
    ``when`` it was found changed, unless it was kvcalib's own storage-call handler (installed by
    an in-process search; it acts as Python's outside storage calls)."""
    import signal
    import sys
    import warnings

    handler, os_level = _sigint_state()
    study = sys.modules.get("kvcalib.optimize.study")
    if study is not None:
        study._held.update(depth=0, pending=False)
    if handler is signal.default_int_handler and os_level == (False, False):
        return
    if os_level != (False, False) or handler is not getattr(study, "_on_sigint", None):
        warnings.warn(f"SIGINT found changed {when} (handler {handler!r}, ignored/blocked {os_level}); put back",
                      stacklevel=1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def pytest_configure(config):
    """Python's own SIGINT set-up from the start: a non-interactive shell starts its background jobs
    with SIGINT ignored (POSIX), which the pytest-xdist workers of a `make test &` (or a CI runner
    doing the same) inherit; the Ctrl-C tests need it handled. Silent: no test did it."""
    import signal

    if _sigint_state()[1] != (False, False):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture(autouse=True)
def _sigint_as_python_sets_it_up(request):
    """Each test starts with Ctrl-C as Python sets it up (its handler, not ignored, not blocked) and
    kvcalib's held-interrupt bookkeeping empty. Why: the Ctrl-C tests (test_faults.py) send SIGINT
    to the test process and to `kvcalib` subprocesses, which inherit an ignored or blocked SIGINT;
    under pytest-xdist a worker runs many files, and a test that leaves it changed is named in a
    warning (what the process inherited is put back in :func:`pytest_configure`)."""
    _put_sigint_back(f"before {request.node.nodeid}")
    yield
    _put_sigint_back(f"after {request.node.nodeid}")


# Files whose tests pytest-xdist may spread over its workers one test at a time (`make test` runs a
# file per worker otherwise, so a file's module fixtures are built once). Why: these hold the
# longest tests of the suite (4k-token float64 decodes of the real model, interpreter decodes of
# every padded and tiered layout), each building its own small model or sharing one whose cost is
# below a test's, so spreading them is what keeps the two workers' shares even.
SPREAD_FILES = frozenset({
    "tests/integration/test_long_context_embedded.py",
    "tests/kernels/test_graph_decode.py",
    "tests/kernels/test_layer_graphs.py",
    "tests/kernels/test_graph_padding.py",
})


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (the Makefile's), except that the tests of :data:`SPREAD_FILES` are
    scheduled one by one."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SpreadHeavyFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return nodeid if file in SPREAD_FILES else file

    return SpreadHeavyFiles(config, log)


TINY_ARCHS = ("llama", "mistral", "qwen2", "gemma3")


def tiny_config(arch: str, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                sliding_window: int = 8, positions: int = 512):
    """A 2-layer config of a real architecture; gemma3 gets one sliding and one global layer.
    ``positions``: max_position_embeddings (accounting at 4k tokens needs a model that holds them)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=positions)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "gemma3":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return Gemma3TextConfig(**common, sliding_window=sliding_window, layer_types=types,
                                query_pre_attn_scalar=head_dim)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, config=None, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or tiny_config(arch, **kw), attn_implementation="sdpa")
    # random init gives tiny keys; scale k/v projections so statistics are not all ~0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                p.mul_(20)
    return model.eval()


def tiny_search_inputs():
    """A tiny llama, its geometry, statistics collected on 4 x 32 random tokens and 2 x 40 held
    scoring tokens drawn after them: ``(model, info, stats, score_ids)`` for the search's tests."""
    from kvcalib.collection import collect_stats
    from kvcalib.models import model_info

    model = tiny_model("llama")
    info = model_info(model.config, "tiny-llama")
    g = torch.Generator().manual_seed(0)
    collect_ids = torch.randint(0, 128, (4, 32), generator=g)  # (N, T) statistics
    score_ids = torch.randint(0, 128, (2, 40), generator=g)  # (M, T) held: disjoint draws
    stats = collect_stats(model, collect_ids, reservoir_blocks=4, block_len=16, name="tiny-llama", progress=False)
    return model, info, stats, score_ids


_WORDS = ("the a river king castle old green stone walked over under quietly bright north town "
          "market people were said that with from into between seven hundred winter summer "
          "ship sailed harbour letter wrote poem play stage").split()


def corpus_lines(n_lines: int = 300, seed: int = 0) -> list[str]:
    """Seeded lines of filler text (the tiny tokenizer's training text)."""
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 20))]
        lines.append(" ".join(words).capitalize() + f" in {rng.randint(1500, 1999)}.")
    return lines


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 400-token byte-level BPE trained on :func:`corpus_lines` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(corpus_lines() + ["What is the pass key? The pass key is 12345. Remember it."], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def tiny_loaded_model(tokenizer, arch: str = "llama", **kw):
    """A :class:`kvcalib.models.LoadedModel` of :func:`tiny_model` sized to ``tokenizer``."""
    from kvcalib.models import LoadedModel, model_info

    cfg = tiny_config(arch, **kw)
    cfg.vocab_size = len(tokenizer)
    model = tiny_model(arch, config=cfg)
    return LoadedModel(model, tokenizer, model_info(cfg, f"tiny-{arch}"), source="tiny", resolved="tiny")


@pytest.fixture(params=TINY_ARCHS)
def tiny_arch_model(request):
    return request.param, tiny_model(request.param)


@pytest.fixture
def one_thread_when_busy():
    """On a shared 2-core box with other jobs running, two intra-op threads wait on each other's
    barriers (an embedded evaluation took 592 s with 2 threads vs 72 s with 1 at load ~7): use one
    thread while the machine is oversubscribed (``pytest.mark.usefixtures("one_thread_when_busy")``)."""
    n = torch.get_num_threads()
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    if busy:
        torch.set_num_threads(1)
    yield
    if busy:
        torch.set_num_threads(n)
