"""``kvcalib eval``: several recipes, one model, identical inputs, one table.

:func:`evaluate` builds every input once (perplexity windows, agreement prompts, passkey
prompts, GSM8K prompts), computes the full-precision numbers once, then scores each recipe on
exactly those inputs. Per recipe:

- ``ppl``: decode-faithful perplexity (:mod:`kvcalib.eval.perplexity`) on windows packed from the
  *evaluation* split of ``data`` (never the calibration split; checked in :func:`eval_texts`);
  ``ppl_fp`` is the plain forward's perplexity on the same windows and
  ``ppl_delta_pct = 100 * (ppl / ppl_fp - 1)``. A recipe that compresses no layer scores exactly
  what the plain forward scores (the simulation's attention is then exact attention, equal to
  1e-4 relative in ``tests/unit/test_eval.py``), so it reuses the baseline: its delta is 0.
- ``agreement`` / ``first_divergence``: :mod:`kvcalib.eval.agreement`.
  Windows are cut side by side from the held-out stream (:mod:`kvcalib.eval.windows`; with
  ``ppl_overlap`` > 0 a short text may give overlapping windows, recorded in ``ppl_overlap``);
  ``ppl_ci_low``/``ppl_ci_high`` bound ``ppl_delta_pct`` (95% paired bootstrap over windows).
- ``copy``: :mod:`kvcalib.eval.copy` (a passage repeated; NLL of the second copy's tail through the
  simulation, and with ``copy_decode`` through a real decode; ``copy_nll_fp`` full precision).
- ``passkey``: :mod:`kvcalib.eval.passkey` (``passkey_fp`` = full precision on the same prompts).
- ``gsm8k``: :mod:`kvcalib.eval.gsm8k`, only when asked (``gsm8k_fp`` likewise).
- ``effective_bits`` and ``kv_bytes``: ``Recipe.memory(info, context_len)``, i.e. the accounted
  bytes of K and V for **one sequence** at ``context_len`` tokens (DESIGN.md, memory
  accounting; bf16 = 16.0 bits on every model: a sliding-window layer counts the tokens it holds),
  independent of the lengths used for the quality metrics; ``compression_ratio`` against the
  model's own bf16 cache beside it, and ``accounting`` naming how the bits were counted.

Randomness: ``torch.manual_seed(seed)`` once; data seeds derive from ``seed`` (windows ``seed``,
agreement prompts ``seed + 1``, passkey ``seed + 2``, copy passages ``seed + 3``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvcalib.errors import KvcalibError
from kvcalib.layout import ACCOUNTING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvcalib.models import LoadedModel
    from kvcalib.recipe import Recipe

log = logging.getLogger(__name__)

METRICS = ("ppl", "agreement", "passkey", "copy", "gsm8k")
DEFAULT_METRICS = ("ppl", "agreement", "passkey")
PASSKEY_MODES = ("split", "prefill")
EVAL_SPLIT = "eval"


class EvalConfigError(KvcalibError, ValueError):
    """An invalid evaluation setting (a KvcalibError for the CLI, a ValueError for library code)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class EvalConfig:
    """What ``kvcalib eval`` runs. Lengths are in tokens; counts are per recipe."""

    model: str = "smollm2-135m"
    recipes: list = field(default_factory=list)  # recipe paths, preset names or Recipe objects
    data: str = "embedded"  # --data source; only its evaluation split is read
    text_field: str | None = None
    metrics: tuple[str, ...] = DEFAULT_METRICS
    context_len: int = 4096  # T for effective bits / KV bytes
    ppl_samples: int = 16
    ppl_seq_len: int = 1024
    ppl_overlap: float = 0.0  # the most a ppl window may share with its neighbour when the text is short
    ppl_allow_fewer: bool = False  # a text short of ppl_samples windows gives those it holds (else refused)
    agreement_prompts: int = 8
    agreement_prompt_len: int = 512  # longer than KIVI's 128-token window, so compression matters
    agreement_tokens: int = 64
    passkey_lengths: tuple[int, ...] = (512, 1024, 2048)
    passkey_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    passkey_trials: int = 4  # per (length, depth): 20 per length
    passkey_mode: str = "split"
    passkey_chunk: int = 0  # split mode: context chunk size (0 = one forward)
    passkey_filler: str = "longtext"  # --data source of the filler text
    passkey_new_tokens: int = 10
    copy_len: int = 3000  # tokens per passage (the sequence holds it twice)
    copy_tail: int = 256  # scored tokens at the end of the second copy
    copy_samples: int = 4  # passages
    copy_allow_fewer: bool = False  # a text short of copy_samples passages gives those it holds (else refused)
    copy_decode: bool = False  # also score the copy through a real token-by-token decode
    gsm8k_limit: int = 100
    gsm8k_shots: int = 4
    gsm8k_new_tokens: int = 256
    seed: int = 0
    batch_size: int = 2
    device: str | None = None  # model loading only (None: cuda if available, else cpu)
    dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.recipes, (str, Path)):
            self.recipes = [self.recipes]
        self.recipes = list(self.recipes or [])
        if not self.recipes:
            raise EvalConfigError("no recipe to evaluate: pass --recipe FILE or --preset NAME (e.g. --preset fp16 --preset kivi-2)")
        from kvcalib.recipe import Recipe

        for r in self.recipes:
            if not isinstance(r, (str, Path, Recipe)) or (isinstance(r, str) and not r.strip()):
                raise EvalConfigError(f"recipe {r!r} is neither a recipe file, a preset name nor a Recipe")
        metrics = self.metrics.split(",") if isinstance(self.metrics, str) else list(self.metrics)
        metrics = [str(m).strip().lower() for m in metrics if str(m).strip()]
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise EvalConfigError(f"unknown metric(s) {', '.join(map(repr, unknown))}: use a comma-separated subset of {','.join(METRICS)}")
        if not metrics:
            raise EvalConfigError(f"no metric selected: use a comma-separated subset of {','.join(METRICS)}")
        self.metrics = tuple(dict.fromkeys(metrics))
        for name, low in (("context_len", 1), ("ppl_samples", 1), ("ppl_seq_len", 2),
                          ("agreement_prompts", 1), ("agreement_prompt_len", 1), ("agreement_tokens", 1),
                          ("passkey_trials", 1), ("passkey_new_tokens", 1), ("gsm8k_limit", 1),
                          ("gsm8k_new_tokens", 1), ("batch_size", 1), ("passkey_chunk", 0),
                          ("gsm8k_shots", 0), ("seed", 0), ("copy_len", 2), ("copy_tail", 1),
                          ("copy_samples", 1)):
            val = getattr(self, name)
            if not _is_int(val) or val < low:
                raise EvalConfigError(f"{name} must be an integer >= {low}, got {val!r}")
        if self.copy_tail > self.copy_len:
            raise EvalConfigError(f"copy_tail ({self.copy_tail}) must not exceed copy_len ({self.copy_len}): the scored "
                                  "tokens are the end of the second copy")
        if isinstance(self.ppl_overlap, bool) or not isinstance(self.ppl_overlap, (int, float)) \
                or not 0.0 <= self.ppl_overlap < 1.0:
            raise EvalConfigError(f"ppl_overlap must be a fraction in [0, 1), got {self.ppl_overlap!r}")
        if self.gsm8k_shots >= 100:
            raise EvalConfigError(f"gsm8k_shots must be below 100 (the shots come from the 100 problems), got {self.gsm8k_shots}")
        self.passkey_lengths = tuple(self.passkey_lengths)
        self.passkey_depths = tuple(self.passkey_depths)
        if not self.passkey_lengths or any(not _is_int(n) or n < 64 for n in self.passkey_lengths):
            raise EvalConfigError(f"passkey_lengths must be integers >= 64 tokens, got {list(self.passkey_lengths)}")
        if not self.passkey_depths or any(isinstance(d, bool) or not isinstance(d, (int, float))
                                          or not 0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise EvalConfigError(f"passkey_depths must be numbers in [0, 1], got {list(self.passkey_depths)}")
        self.passkey_depths = tuple(float(d) for d in self.passkey_depths)
        if self.passkey_mode not in PASSKEY_MODES:
            raise EvalConfigError(f"passkey_mode must be one of {', '.join(PASSKEY_MODES)}, got {self.passkey_mode!r}")
        for name in ("model", "data", "passkey_filler"):
            val = getattr(self, name)
            if not isinstance(val, str) or not val.strip():
                raise EvalConfigError(f"{name} must be a non-empty string, got {val!r}")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["recipes"] = [_spec(r) for r in self.recipes]
        out["metrics"] = list(self.metrics)
        out["passkey_lengths"] = list(self.passkey_lengths)
        out["passkey_depths"] = list(self.passkey_depths)
        return out

    def max_tokens(self) -> int:
        """The longest sequence any selected metric feeds the model (gsm8k excluded: its prompts
        are a few hundred tokens)."""
        need = 0
        if "ppl" in self.metrics:
            need = max(need, self.ppl_seq_len)
        if "agreement" in self.metrics:
            need = max(need, self.agreement_prompt_len + self.agreement_tokens)
        if "passkey" in self.metrics:
            need = max(need, max(self.passkey_lengths) + self.passkey_new_tokens)
        if "copy" in self.metrics:
            need = max(need, 2 * self.copy_len + 1)
        return need


def _spec(r: Any) -> str:
    from kvcalib.recipe import Recipe

    return r.name if isinstance(r, Recipe) else str(r)


@dataclass
class EvalResult:
    """One recipe's row. Metrics that were not run are None (null in JSON)."""

    name: str
    recipe: str  # as given: a path, a preset name
    context_len: int
    effective_bits: float  # at context_len, per sequence
    kv_bytes: float  # K and V bytes of one sequence at context_len
    compression_ratio: float | None = None  # the model's bf16 cache bytes / kv_bytes, at context_len
    accounting: str = ACCOUNTING  # how effective_bits was counted (kvcalib.layout.ACCOUNTINGS)
    ppl: float | None = None
    ppl_fp: float | None = None
    ppl_delta_pct: float | None = None
    ppl_tokens: int | None = None  # scored tokens
    ppl_windows: int | None = None
    ppl_overlap: float | None = None  # fraction of a window shared with its neighbour (0: disjoint)
    ppl_ci_low: float | None = None  # 95% paired bootstrap interval over windows of ppl_delta_pct
    ppl_ci_high: float | None = None
    # NLL by token position (equal-width buckets over the window): [{"start", "end", "tokens", "nll",
    # "nll_fp", "ppl", "ppl_fp", "delta_pct"}]: where in a long context the compressed cache costs
    ppl_by_position: list[dict[str, Any]] | None = None
    agreement: float | None = None
    first_divergence: float | None = None
    agreement_tokens: int | None = None  # generated tokens per prompt
    copy_nll: float | None = None  # nats/token, the second copy's tail, decode-faithful simulation
    copy_nll_decode: float | None = None  # the same through a real CompressedCache decode (copy_decode)
    copy_nll_fp: float | None = None  # full precision, same tokens
    copy_nll_reference: float | None = None  # full precision, same tokens of the first copy (nothing to copy)
    copy_passages: int | None = None
    copy_tail: int | None = None
    passkey: float | None = None
    passkey_fp: float | None = None
    passkey_cells: dict[str, float] | None = None  # "length@depth" -> accuracy
    gsm8k: float | None = None
    gsm8k_fp: float | None = None
    gsm8k_problems: int | None = None
    seconds: float = 0.0  # wall time of this recipe's metrics (the shared baseline excluded)
    seconds_by_metric: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ inputs
def eval_texts(data: str, text_field: str | None = None) -> list[str]:
    """The texts of ``data``'s evaluation split, never its calibration split.

    For ``embedded`` and ``longtext`` data this is verified (no text of the calibration split is
    returned). Local files and ``gsm8k-100`` are used whole whatever the split: a warning says so,
    since calibrating on the same source would leak.
    """
    from kvcalib.data import load_texts, resolve_text_source

    source = resolve_text_source(data, EVAL_SPLIT, text_field)
    if source.split != EVAL_SPLIT:  # pragma: no cover - guards against a future change in data.py
        raise RuntimeError(f"kvcalib bug: evaluation text resolved to split {source.split!r}")
    texts = source.load()
    if source.kind in ("embedded", "longtext"):
        if set(texts) & set(load_texts(data, "calib")):
            raise RuntimeError("kvcalib bug: evaluation texts overlap the calibration split")
    elif source.kind not in ("hub", "plays"):  # plays: held-out text only, it has no calibration split
        log.warning("--data %s has no separate evaluation split: it is used whole; do not calibrate on it", data)
    return texts


@dataclass
class _Inputs:
    """Everything the metrics feed the model, built once and shared by all recipes."""

    ppl_ids: "torch.Tensor | None" = None  # (N, L)
    ppl_overlap: float = 0.0
    copy: Any = None  # kvcalib.eval.copy.CopyInputs
    prompts: "torch.Tensor | None" = None  # (N, P) agreement prompts
    passkey: list | None = None  # list[PasskeyPrompt]


def _build_inputs(config: EvalConfig, tokenizer) -> _Inputs:
    from kvcalib.data import pack_samples

    inputs = _Inputs()
    if {"ppl", "agreement", "copy"} & set(config.metrics):
        texts = eval_texts(config.data, config.text_field)
        what = f"the evaluation split of --data {config.data}"
        if "ppl" in config.metrics:
            from kvcalib.eval.windows import eval_windows

            win = eval_windows(texts, tokenizer, config.ppl_seq_len, config.ppl_samples, config.seed,
                               config.ppl_overlap, what,
                               {"n": " (--ppl-samples)", "seq_len": " (--ppl-seq-len)", "text": " (--data)",
                                "overlap": " (--ppl-overlap)"}, allow_fewer=config.ppl_allow_fewer)
            inputs.ppl_ids, inputs.ppl_overlap = win.ids, win.overlap
        if "agreement" in config.metrics:
            inputs.prompts = pack_samples(texts, tokenizer, config.agreement_prompt_len,
                                          config.agreement_prompts, config.seed + 1)
        if "copy" in config.metrics:
            from kvcalib.eval.copy import build_copy_inputs

            inputs.copy = build_copy_inputs(texts, tokenizer, config.copy_len, config.copy_tail, config.copy_samples,
                                            config.seed + 3, what, {"n": " (--copy-samples)", "seq_len": " (--copy-len)",
                                                                    "text": " (--data)"},
                                            allow_fewer=config.copy_allow_fewer)
    if "passkey" in config.metrics:
        from kvcalib.eval.passkey import build_passkey_prompts

        from kvcalib.data import load_texts

        filler = "\n\n".join(load_texts(config.passkey_filler, EVAL_SPLIT))
        try:
            inputs.passkey = build_passkey_prompts(tokenizer, filler, config.passkey_lengths,
                                                   config.passkey_depths, config.passkey_trials, config.seed + 2)
        except ValueError as err:
            raise EvalConfigError(str(err)) from None
    return inputs


# ------------------------------------------------------------------ the run
class _Steps:
    """Advances a ProgressBar by whole (run x metric) steps, in fractions per unit of work."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def unit(self, label: str, n_units: int) -> Callable[[int], None]:
        self.bar.update(info=label)
        return lambda n: self.bar.advance(n / max(n_units, 1))


def evaluate(config: EvalConfig, loaded: "LoadedModel | None" = None,
             on_result: "Callable[[EvalResult], None] | None" = None) -> list[EvalResult]:
    """Score every recipe of ``config`` on identical inputs; one :class:`EvalResult` per recipe,
    in the order given.

    ``loaded``: an already loaded model (``config.model``/``device``/``dtype`` are then unused).
    ``on_result``: called with each recipe's result as soon as it is scored (a long run can save
    what finished before a time limit stops it).
    Every recipe is checked against the model before any compute. The model's attention
    implementation is restored on return (building a CompressedCache switches it).
    Raises :class:`EvalConfigError` when an input is longer than the model supports.
    """
    import torch

    from kvcalib.models import load_model
    from kvcalib.progress import ProgressBar
    from kvcalib.recipe import resolve_recipe
    from kvcalib.recipe import build_codecs

    if loaded is None:
        loaded = load_model(config.model, device=config.device, dtype=config.dtype)
    model, tok, info = loaded.model, loaded.tokenizer, loaded.info
    if info.max_positions and config.max_tokens() > info.max_positions:
        raise EvalConfigError(f"the evaluation feeds {config.max_tokens()} tokens but {info.name} supports "
                              f"{info.max_positions}: lower ppl_seq_len / copy_len / passkey lengths / agreement lengths")
    torch.manual_seed(config.seed)

    recipes: list[Recipe] = [resolve_recipe(r) for r in config.recipes]
    for r in recipes:
        r.check_model(info)  # refuse another model's recipe before any compute
    if "ppl" in config.metrics:
        _check_memory(config, model, info, recipes)
    names = _unique_names([r.name for r in recipes])
    inputs = _build_inputs(config, tok)

    runs = 1 + len(recipes)  # full precision once, then each recipe
    previous_attn = model.config._attn_implementation
    results: list[EvalResult] = []
    try:
        with ProgressBar(runs * len(config.metrics), "eval", unit="steps") as bar:
            steps = _Steps(bar)
            fp = _full_precision(config, model, tok, inputs, steps)
            for name, spec, recipe in zip(names, config.recipes, recipes):
                t0 = time.perf_counter()
                mem = recipe.memory(info, config.context_len)
                res = EvalResult(name=name, recipe=_spec(spec), context_len=config.context_len,
                                 effective_bits=mem.effective_bits, kv_bytes=mem.total_bytes,
                                 compression_ratio=mem.compression_ratio)
                configs = recipe.layer_configs(info.num_layers)
                codecs = build_codecs(recipe, configs)
                _score_recipe(config, model, tok, inputs, fp, recipe, configs, codecs, res, steps, name)
                res.seconds = time.perf_counter() - t0
                results.append(res)
                if on_result is not None:
                    on_result(res)
    finally:
        if model.config._attn_implementation != previous_attn:
            model.set_attn_implementation(previous_attn)  # CompressedCache.from_recipe switched it
    return results


def _check_memory(config: EvalConfig, model, info, recipes: Sequence[Recipe]) -> None:
    """Refuse a perplexity window the machine cannot hold, before any compute (one clear line)."""
    from kvcalib.eval.perplexity import free_memory_bytes, simulation_bytes

    device = next(model.parameters()).device
    free = free_memory_bytes(device)
    if free is None:
        return
    tiers = max([len(c.tiers) for r in recipes for c in r.codecs(info)] or [1])
    param_bytes = next(model.parameters()).element_size()
    need = simulation_bytes(model.config, config.ppl_seq_len, config.batch_size, tiers, param_bytes)
    if need > 0.9 * free:
        raise EvalConfigError(
            f"a decode-faithful forward of {config.batch_size} x {config.ppl_seq_len} tokens needs about "
            f"{need / 2**30:.1f} GiB of working memory and {device} has {free / 2**30:.1f} GiB free: lower "
            "--ppl-seq-len or --batch-size, or evaluate on a machine with more memory (a GPU)")


def _unique_names(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        name, k = n, 1
        while name in out:
            k += 1
            name = f"{n}#{k}"
        out.append(name)
    return out


def _full_precision(config: EvalConfig, model, tok, inputs: _Inputs, steps: _Steps) -> dict[str, Any]:
    """The baseline numbers, computed once: ppl (sum NLL, tokens), greedy tokens, passkey, gsm8k."""
    from kvcalib.eval.agreement import greedy_generate
    from kvcalib.eval.gsm8k import gsm8k_accuracy
    from kvcalib.eval.passkey import run_passkey
    from kvcalib.eval.perplexity import position_nll_windows

    fp: dict[str, Any] = {}
    label = "full precision"
    if inputs.ppl_ids is not None:
        fp["per_position"] = position_nll_windows(model, inputs.ppl_ids, None, None, 1, config.batch_size,
                                                  steps.unit(f"{label}: ppl", inputs.ppl_ids.shape[0]))  # (N, S)
    if inputs.prompts is not None:
        fp["tokens"] = greedy_generate(model, inputs.prompts, config.agreement_tokens, None, config.batch_size,
                                       steps.unit(f"{label}: agreement", inputs.prompts.shape[0]))  # (N, T)
    if inputs.copy is not None:
        from kvcalib.eval.copy import copy_fp

        fp["copy"], fp["copy_reference"] = copy_fp(model, inputs.copy, config.batch_size,
                                                   steps.unit(f"{label}: copy", inputs.copy.ids.shape[0]))  # (N, tail) x 2
    if inputs.passkey is not None:
        fp["passkey"] = run_passkey(model, tok, inputs.passkey, None, config.passkey_mode, config.passkey_chunk,
                                    config.passkey_new_tokens, config.batch_size,
                                    steps.unit(f"{label}: passkey", len(inputs.passkey)))
    if "gsm8k" in config.metrics:
        n = min(config.gsm8k_limit, 100 - config.gsm8k_shots)
        fp["gsm8k"] = gsm8k_accuracy(model, tok, None, config.gsm8k_limit, config.gsm8k_shots,
                                     config.gsm8k_new_tokens, steps.unit(f"{label}: gsm8k", n))
    return fp


def _score_recipe(config: EvalConfig, model, tok, inputs: _Inputs, fp: dict[str, Any], recipe, configs,
                  codecs, res: EvalResult, steps: _Steps, name: str) -> None:
    from kvcalib.eval.agreement import agreement_stats, greedy_generate
    from kvcalib.eval.gsm8k import gsm8k_accuracy
    from kvcalib.eval.passkey import run_passkey
    from kvcalib.eval.perplexity import position_nll_windows

    lossless = not any(c.compressed for c in configs)
    clock = time.perf_counter()

    def lap(metric: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        res.seconds_by_metric[metric] = round(now - clock, 3)
        clock = now

    if inputs.ppl_ids is not None:
        fp_per = fp["per_position"]  # (N, S)
        done = steps.unit(f"{name}: ppl", inputs.ppl_ids.shape[0])
        if lossless:  # exact attention: the plain forward's numbers (see module docstring)
            per = fp_per
            done(inputs.ppl_ids.shape[0])
        else:
            per = position_nll_windows(model, inputs.ppl_ids, configs, codecs, 1, config.batch_size, done)  # (N, S)
            assert per.shape == fp_per.shape, "recipes must be scored on the same tokens"
        n_tok = per.numel()
        res.ppl, res.ppl_fp = math.exp(float(per.sum()) / n_tok), math.exp(float(fp_per.sum()) / n_tok)
        res.ppl_delta_pct = 100.0 * (res.ppl / res.ppl_fp - 1.0)
        res.ppl_tokens = n_tok
        res.ppl_by_position = position_table(per, fp_per, inputs.ppl_ids.shape[1])
        res.ppl_windows, res.ppl_overlap = int(per.shape[0]), inputs.ppl_overlap
        if per.shape[0] > 1:
            from kvcalib.eval.windows import bootstrap_delta_ci

            res.ppl_ci_low, res.ppl_ci_high = bootstrap_delta_ci(per, fp_per, seed=config.seed)
        lap("ppl")
    if inputs.copy is not None:
        _score_copy(config, model, inputs.copy, fp, recipe, configs, codecs, lossless, res, steps, name)
        lap("copy")
    if inputs.prompts is not None:
        cand = greedy_generate(model, inputs.prompts, config.agreement_tokens, recipe, config.batch_size,
                               steps.unit(f"{name}: agreement", inputs.prompts.shape[0]))  # (N, T)
        stats = agreement_stats(fp["tokens"], cand)
        res.agreement, res.first_divergence, res.agreement_tokens = stats.agreement, stats.first_divergence, stats.n_tokens
        lap("agreement")
    if inputs.passkey is not None:
        pk = run_passkey(model, tok, inputs.passkey, recipe, config.passkey_mode, config.passkey_chunk,
                         config.passkey_new_tokens, config.batch_size,
                         steps.unit(f"{name}: passkey", len(inputs.passkey)))
        res.passkey, res.passkey_fp, res.passkey_cells = pk.accuracy, fp["passkey"].accuracy, pk.by_cell
        lap("passkey")
    if "gsm8k" in config.metrics:
        g = gsm8k_accuracy(model, tok, recipe, config.gsm8k_limit, config.gsm8k_shots, config.gsm8k_new_tokens,
                           steps.unit(f"{name}: gsm8k", fp["gsm8k"].n_problems))
        res.gsm8k, res.gsm8k_fp, res.gsm8k_problems = g.accuracy, fp["gsm8k"].accuracy, g.n_problems
        lap("gsm8k")


def _score_copy(config: EvalConfig, model, copy_inputs, fp: dict[str, Any], recipe, configs, codecs, lossless: bool,
                res: EvalResult, steps: _Steps, name: str) -> None:
    """The copy metric of one recipe (simulated; and decoded with ``config.copy_decode``)."""
    from kvcalib.eval.copy import copy_decoded, copy_simulated

    n = copy_inputs.ids.shape[0]
    done = steps.unit(f"{name}: copy", n * (2 if config.copy_decode else 1))
    if lossless:  # exact attention: the plain forward's numbers, as for ppl
        sim = fp["copy"]
        done(n)
    else:
        sim = copy_simulated(model, copy_inputs, configs, codecs, config.batch_size, done)  # (N, tail)
    res.copy_nll, res.copy_nll_fp = float(sim.mean()), float(fp["copy"].mean())
    res.copy_nll_reference = float(fp["copy_reference"].mean())
    res.copy_passages, res.copy_tail = n, copy_inputs.tail
    if config.copy_decode:
        res.copy_nll_decode = float(copy_decoded(model, copy_inputs, recipe, config.batch_size, done).mean())


POSITION_BUCKETS = 16  # equal-width position buckets of a perplexity window


def position_table(per: "torch.Tensor", fp_per: "torch.Tensor", seq_len: int) -> list[dict[str, Any]]:
    """NLL by position of a recipe beside full precision: ``per``/``fp_per`` (N, S) NLL of tokens
    1..L-1 of each window (scored from the first prediction on), in :data:`POSITION_BUCKETS`
    equal-width buckets of token positions."""
    from kvcalib.eval.perplexity import position_buckets

    step = max(1, -(-seq_len // POSITION_BUCKETS))
    edges = list(range(0, seq_len, step)) + [seq_len]
    rows = []
    for mine, base in zip(position_buckets(per, 0, edges), position_buckets(fp_per, 0, edges)):
        rows.append({"start": mine["start"], "end": mine["end"], "tokens": mine["tokens"], "nll": mine["nll"],
                     "nll_fp": base["nll"], "ppl": mine["ppl"], "ppl_fp": base["ppl"],
                     "delta_pct": 100.0 * (mine["ppl"] / base["ppl"] - 1.0)})
    return rows


def plot_positions(results: Sequence[EvalResult], path: Path | str, title: str = "") -> None:
    """PNG: perplexity change vs full precision (%) by token position, one line per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvcalib.io import atomic_path

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in results:
        rows = r.ppl_by_position or []
        if rows:
            xs = [(b["start"] + b["end"]) / 2 for b in rows]
            ax.plot(xs, [b["delta_pct"] for b in rows], marker=".", label=f"{r.name} ({r.effective_bits:.2f} b)")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("token position in the window")
    ax.set_ylabel("perplexity vs full precision (%)")
    ax.set_title(title or "where the compressed cache costs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ output
def write_json(results: Sequence[EvalResult], path: Path | str, config: EvalConfig | None = None) -> None:
    """Write one object per recipe as a JSON list, atomically; with ``config``, the resolved
    configuration goes beside it as ``<stem>.config.json`` (how the numbers were made)."""
    from kvcalib.io import write_json_atomic

    path = Path(path)
    write_json_atomic(path, [r.to_dict() for r in results])
    if config is not None:
        write_json_atomic(path.with_name(f"{path.stem}.config.json"), config.to_dict())


_COLUMNS: tuple[tuple[str, str, Callable[[EvalResult], Any]], ...] = (
    # (header, metric it belongs to or "" for always, cell)
    ("name", "", lambda r: r.name),
    ("eff. bits", "", lambda r: round(r.effective_bits, 3)),
    ("KV MiB/seq", "", lambda r: round(r.kv_bytes / 2**20, 2)),
    ("T", "", lambda r: r.context_len),
    ("ppl", "ppl", lambda r: r.ppl),
    ("ppl fp", "ppl", lambda r: r.ppl_fp),
    ("Δppl %", "ppl", lambda r: None if r.ppl_delta_pct is None else round(r.ppl_delta_pct, 3)),
    ("95% CI", "ppl", lambda r: None if r.ppl_ci_low is None else f"[{r.ppl_ci_low:+.2f}, {r.ppl_ci_high:+.2f}]"),
    ("copy nll", "copy", lambda r: r.copy_nll),
    ("copy decode", "copy", lambda r: r.copy_nll_decode),
    ("copy fp", "copy", lambda r: r.copy_nll_fp),
    ("agreement", "agreement", lambda r: r.agreement),
    ("1st diverg.", "agreement", lambda r: r.first_divergence),
    ("passkey", "passkey", lambda r: r.passkey),
    ("passkey fp", "passkey", lambda r: r.passkey_fp),
    ("gsm8k", "gsm8k", lambda r: r.gsm8k),
    ("gsm8k fp", "gsm8k", lambda r: r.gsm8k_fp),
)


def _shown(results: Sequence[EvalResult]) -> list[tuple[str, str, Callable[[EvalResult], Any]]]:
    """Columns whose metric was run (a metric not run is None for every result)."""
    return [c for c in _COLUMNS if not c[1] or any(c[2](r) is not None for r in results)]


def results_table_columns(results: Sequence[EvalResult]) -> list[str]:
    return [c[0] for c in _shown(results)]


def results_table_rows(results: Sequence[EvalResult]) -> list[list[Any]]:
    """One row per recipe, aligned with :func:`results_table_columns` (``-`` for a missing cell)."""
    cols = _shown(results)
    return [["-" if (v := c[2](r)) is None else v for c in cols] for r in results]


__all__ = ["DEFAULT_METRICS", "METRICS", "EvalConfig", "EvalConfigError", "EvalResult", "eval_texts",
           "evaluate", "plot_positions", "position_table", "results_table_columns", "results_table_rows",
           "write_json"]
