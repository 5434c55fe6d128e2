"""``kvcalib search``: Optuna per-layer {2,3,4,8}-bit search for the best recipe under a memory budget.

Phases, all into one run folder (never overwritten; ``resume`` continues it):

1. collect: statistics on the first ``samples`` calibration windows (skipped when the folder
   already holds ``stats.safetensors``, e.g. from ``kvcalib collect``);
2. objective: the next ``score_samples`` windows of the same packing (disjoint from 1), cut to
   ``seq_len`` tokens; with ``score_last`` and ``copy_weight`` > 0 also a copy window of each, its
   tail a copy of its start (:func:`kvcalib.eval.copy.copy_windows`); full-precision log-probs
   cached (:mod:`.objective`);
3. warm start + study (:mod:`.study`): sensitivity sweep, greedy points, TPE with the budget as
   a constraint, Pareto pruning, SQLite/journal storage; ``resume`` first re-enqueues the
   points of trials an interrupted run left FAIL or RUNNING (:func:`.study.recover_interrupted`);
4. outputs: ``search.json`` (every trial), ``recipe.safetensors`` (lowest KL at or under the
   budget), ``pareto.png``, ``bits_per_layer.png``, ``report.md`` (:mod:`.report`); they record
   the run folder and storage without machine paths, and the command line (:mod:`.provenance`);
   ``search.json`` (version 2) names its memory accounting (``kvcalib.layout.ACCOUNTING``: bf16 is
   16 bits on every model, so a budget means the same compression, 16 / budget, everywhere);
   :func:`current_accounting` reads a version-1 file's numbers in today's accounting;
5. held-out proof: :func:`kvcalib.eval.harness.evaluate` of the chosen recipe and the presets on
   the evaluation split: ppl, and the copy NLL on passages half a proof window long
   (:func:`proof_copy_settings`).

Import cost: this package imports neither optuna nor matplotlib until a search runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kvcalib.errors import KvcalibError
from kvcalib.optimize.space import Point, SearchSpace, SpaceError

__all__ = ["SearchConfig", "SearchResult", "SearchSpace", "Point", "SpaceError", "current_accounting", "search",
           "search_with"]

SEARCH_VERSION = 2  # 2: the "accounting" field (issue 38); 1: every layer counted at the full context

PRESETS = ("kivi-2", "kivi-4", "pertoken-4")
LONG_CONTEXT = 8192  # `kvcalib search`'s default --context: min(this, the model's maximum)
DECODE_FRACTION = 8  # at long context the last context // 8 positions of a scoring window are decode steps
COPY_WEIGHT = 0.5  # the copy windows' weight in the objective where they are scored (copy_weight unset)
# the rotation kind the space's rotate switch fitted before --rotate existed (search.json files
# without config.rotate read as it); the rotate method's default, and `auto`'s choice on a CPU
ROTATE_DEFAULT = "hadamard"
# `auto` (the default) on a CUDA device: the fitted (D, D) rotation won the 3-bit pick on both
# models' held-out texts (SmolLM2 at 8k: +1.54% / +1.34% against the Hadamard pick's +2.68% /
# +2.34%; Qwen2.5-Coder-0.5B at 16k, plays: +1.65% against +2.08%; docs/results.md) for about twice
# the search time on a GPU (221 s against 103 s); on a CPU its fits (~1.5 s a side, for every width
# a trial asks for) would turn a minutes-long search into much longer, so auto keeps the seed there
ROTATE_ON_GPU = "learned"


def copy_room(scoring_length: int) -> int:
    """The most scored positions a copy window of ``scoring_length`` tokens can hold: its copy may
    not overlap its source (:func:`kvcalib.eval.copy.copy_windows`), and a BOS may open the window."""
    return (scoring_length - 1) // 2


def long_context_default(max_positions: int | None) -> int:
    """The context ``kvcalib search`` targets unless told: :data:`LONG_CONTEXT` tokens, or the
    model's maximum where that is shorter (0 / None: unknown, so :data:`LONG_CONTEXT`)."""
    return min(LONG_CONTEXT, max_positions) if max_positions else LONG_CONTEXT


@dataclass
class SearchConfig:
    """What ``kvcalib search`` runs (validated on construction)."""

    model: str = "smollm2-135m"
    data: str = "embedded"
    text_field: str | None = None
    out: Path | None = None  # run folder (default artifacts/runs/search-<time>)
    samples: int = 8  # collection windows
    seq_len: int = 256  # tokens per window (collection, and scoring unless score_seq_len is set)
    score_samples: int = 2  # held calibration windows scored by the objective
    # long-context scoring: windows of score_seq_len tokens whose last score_last tokens are decode
    # steps after a compressed prompt (None: seq_len, every position after the first)
    score_seq_len: int | None = None
    score_last: int | None = None
    # the copy windows' weight w in the objective, KL ** (1 - w) * (KL of copy windows) ** w (objective.py):
    # in [0, 1), 0 = none; None: COPY_WEIGHT where the scoring windows end in score_last decode steps
    # that a copy fits (score_last <= copy_room), else 0 (resolved with the scoring window)
    copy_weight: float | None = None
    trials: int = 30  # finished trials the study should hold
    budget_bits: float = 3.0
    # effective bits accounted at this context length; None: long_context_default(the model's maximum),
    # resolved once the model's geometry is known (resolve_context)
    context: int | None = 4096
    # score at the deployed context: unless score_seq_len / score_last / eval_seq_len are given, score
    # windows of `context` tokens whose last context // DECODE_FRACTION are decode steps, and prove on
    # held-out windows of `context` tokens (`kvcalib search` sets it; the library default scores seq_len)
    score_at_context: bool = False
    space: SearchSpace | str | Path | None = None
    storage: str | None = None  # default sqlite:///RUN_DIR/study.db
    study: str = "kvcalib-search"
    resume: bool = False
    sweep: bool = True
    timeout: float | None = None  # seconds for the trial phase
    seed: int = 0
    eval: bool = True
    eval_samples: int = 4
    eval_seq_len: int | None = 512  # None: context (with score_at_context)
    presets: tuple[str, ...] = PRESETS
    device: str | None = None
    dtype: str | None = None
    reservoir_blocks: int = 8
    block_len: int = 128
    command: str | None = None  # the command line that started the search (recorded; the CLI sets it)
    # methods applied to the chosen recipe only (``Method.search == "chosen"``; default: all of them,
    # today Huffman codebooks where coding shrinks a side); () = none
    chosen_methods: tuple[str, ...] | None = None
    # "budget": the lowest KL under budget_bits (constrained TPE); "pareto": the whole (KL, effective
    # bits) front in one study (multi-objective TPE), budget_bits picking the recipe written
    objective: str = "budget"
    # worker processes sharing the study from this one command ("auto": one per visible GPU, 1 on CPU);
    # each pinned to one device, loading the model once (:mod:`.workers`)
    workers: int | str = 1
    heartbeat: int = 60  # seconds between a running trial's heartbeats (RDB storages; :mod:`.study`)
    # an earlier run's search.json (or its folder): its finished trials' points are scored first, in
    # its trial order (e.g. a short-context search's points re-scored at long context; the same
    # trials for every worker count in scripts/search_scale.py)
    points_from: str | None = None
    # the kind of rotation the space's rotate switch fits (a kind of kvcalib.methods.rotate: hadamard,
    # learned...; the objective's method_overrides, objective.rotation_overrides); the trials' bits
    # count what it stores (a learned rotation's matrices), and export rebuilds a trial with it.
    # "auto": ROTATE_ON_GPU where the search runs on CUDA and the space switches rotation, else
    # ROTATE_DEFAULT; resolved in __post_init__, so the run records the kind it fitted
    rotate: str = "auto"

    def __post_init__(self) -> None:
        for name, low in (("samples", 1), ("seq_len", 2), ("score_samples", 1), ("trials", 1), ("context", 1),
                          ("eval_samples", 1), ("eval_seq_len", 2), ("reservoir_blocks", 0), ("block_len", 1)):
            val = getattr(self, name)
            if val is None and name in ("context", "eval_seq_len"):
                continue  # resolved with the model's geometry (resolve_context)
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise KvcalibError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {val!r}.")
        if not isinstance(self.budget_bits, (int, float)) or not math.isfinite(self.budget_bits) or self.budget_bits <= 0:
            raise KvcalibError(f"--budget-bits must be a positive number, got {self.budget_bits!r}.")
        if self.timeout is not None and self.timeout <= 0:
            raise KvcalibError(f"--timeout must be positive seconds, got {self.timeout!r}.")
        if not self.study or not str(self.study).strip():
            raise KvcalibError("--study must be a non-empty name.")
        if self.objective not in ("budget", "pareto"):
            raise KvcalibError(f"--objective {self.objective!r} is not known: use budget (the best recipe under "
                               "--budget-bits) or pareto (the whole quality/memory front in one study).")
        if not (self.workers == "auto" or (isinstance(self.workers, int) and not isinstance(self.workers, bool)
                                           and self.workers >= 1)):
            raise KvcalibError(f"--workers must be auto or an integer >= 1, got {self.workers!r}.")
        if not isinstance(self.heartbeat, int) or isinstance(self.heartbeat, bool) or self.heartbeat < 1:
            raise KvcalibError(f"--heartbeat must be an integer number of seconds >= 1, got {self.heartbeat!r}.")
        if self.block_len > self.seq_len:
            self.block_len = self.seq_len
        if self.score_seq_len is not None and (not isinstance(self.score_seq_len, int) or self.score_seq_len < 2):
            raise KvcalibError(f"--score-seq-len must be an integer >= 2, got {self.score_seq_len!r}.")
        if self.copy_weight is not None and (isinstance(self.copy_weight, bool)
                                             or not isinstance(self.copy_weight, (int, float))
                                             or not 0.0 <= self.copy_weight < 1.0):
            raise KvcalibError(f"--copy-weight must be a number in [0, 1), got {self.copy_weight!r}: the copy windows' "
                               "weight in the objective (0 scores none; 1 would drop the ordinary KL). Pass e.g. "
                               f"--copy-weight {COPY_WEIGHT:g} or --copy-weight 0.")
        if self.space is None:
            self.space = SearchSpace()
        elif isinstance(self.space, (str, Path)):
            self.space = SearchSpace.from_file(self.space)
        elif isinstance(self.space, dict):
            self.space = SearchSpace.from_dict(self.space)
        self.presets = tuple(self.presets)
        self._check_rotate()
        if self.points_from is not None:  # read and checked against the space before any work
            from kvcalib.optimize.study import replay_points

            self.points_from = str(Path(self.points_from).resolve())
            replay_points(self.points_from, self.space)
        if self.out is not None:
            self.out = Path(self.out)
        if self.context is not None:
            self.resolve_context(None)  # the defaults that follow the context, and their checks, before any model loads
        elif self.score_seq_len is not None or not self.score_at_context:
            self._check_scoring()  # the window is known without the context: checked now all the same
        if self.chosen_methods is not None:
            from kvcalib.methods import registry

            self.chosen_methods = tuple(self.chosen_methods)
            allowed = [name for name, m in registry().items() if m.search == "chosen"]
            bad = [m for m in self.chosen_methods if m not in allowed]
            if bad:
                raise KvcalibError(f"--finish {','.join(bad)}: not a method applied to the chosen recipe; use "
                                   f"{', '.join(allowed) or 'none'} (or 'none').")

    def _check_rotate(self) -> None:
        """``rotate``: ``auto`` resolved (:data:`ROTATE_ON_GPU` on a CUDA device where the space
        switches rotation, else :data:`ROTATE_DEFAULT`), then a kind of the rotate method and, where
        it is not the default, a space that switches the rotation (else the kind would be fitted
        nowhere)."""
        from kvcalib.optimize.objective import rotation_overrides

        if self.rotate == "auto":
            from kvcalib.models import default_device

            on_gpu = str(self.device or default_device()).startswith("cuda")
            switches = "rotate" in self.space.layer_methods  # type: ignore[union-attr]
            self.rotate = ROTATE_ON_GPU if on_gpu and switches else ROTATE_DEFAULT
        rotation_overrides(self.rotate)  # a KvcalibError naming the kinds
        if self.rotate != ROTATE_DEFAULT and "rotate" not in self.space.layer_methods:  # type: ignore[union-attr]
            raise KvcalibError(f"--rotate {self.rotate}: the search space switches no rotation (its layer_methods "
                               f"lack rotate): add rotate to the --space file's layer_methods, or leave --rotate out.")

    @property
    def scoring_length(self) -> int:
        """Tokens per scoring window: ``score_seq_len``, else ``context`` (``score_at_context``), else
        ``seq_len``."""
        if self.score_seq_len:
            return self.score_seq_len
        if self.score_at_context:
            if self.context is None:
                raise RuntimeError("kvcalib bug: the scoring length of an unresolved context (call resolve_context)")
            return self.context
        return self.seq_len

    def resolve_context(self, max_positions: int | None) -> None:
        """Fix ``context`` (None: :func:`long_context_default` of ``max_positions``) and, with
        ``score_at_context``, the scoring window, its decode steps and the held-out windows that
        follow it; then check them against the search space. Idempotent."""
        if self.context is None:
            self.context = long_context_default(max_positions)
        if self.score_at_context:
            if self.score_seq_len is None and self.score_last is None:
                self.score_last = max(1, self.context // DECODE_FRACTION)
            if self.eval_seq_len is None:
                self.eval_seq_len = self.context
        elif self.eval_seq_len is None:
            self.eval_seq_len = 512
        self._check_scoring()

    def _check_scoring(self) -> None:
        """The scoring window against --score-last and the search space (the schedules' check once
        the context is known)."""
        if self.score_last is not None and (isinstance(self.score_last, bool) or not isinstance(self.score_last, int)
                                            or not 1 <= self.score_last < self.scoring_length):
            raise KvcalibError(f"--score-last must be an integer in [1, {self.scoring_length}) (the scored decode steps "
                               f"at the end of each {self.scoring_length}-token scoring window), got {self.score_last!r}.")
        self._resolve_copy_weight()
        if self.context is not None:
            from kvcalib.optimize.space import check_scored_schedules

            check_scored_schedules(self.space, self.scoring_length, self.context)  # before any model is loaded
        from kvcalib.optimize.guards import check_quantized_scoring

        check_quantized_scoring(self.space, self.scoring_length,
                                "--score-seq-len" if self.score_seq_len or self.score_at_context else "--seq-len")

    def _resolve_copy_weight(self) -> None:
        """``copy_weight`` once the scoring window is known: None becomes :data:`COPY_WEIGHT` where a
        copy fits the scored decode steps, else 0; a weight given for windows that cannot hold a copy
        is refused, naming the fix."""
        room = copy_room(self.scoring_length)
        fits = self.score_last is not None and self.score_last <= room
        if self.copy_weight is None:
            self.copy_weight = COPY_WEIGHT if fits else 0.0
            return
        self.copy_weight = float(self.copy_weight)
        if self.copy_weight == 0.0 or fits:
            return
        if self.score_last is None:
            raise KvcalibError(f"--copy-weight {self.copy_weight:g} needs scoring windows that end in decode steps: a "
                               "copy window's scored positions are its last --score-last N, a copy of the window's "
                               f"start. Pass --score-last N (at most {room} for {self.scoring_length}-token windows), "
                               "or --copy-weight 0.")
        raise KvcalibError(f"--copy-weight {self.copy_weight:g}: a copy window of {self.scoring_length} tokens holds "
                           f"at most {room} scored positions (the copy may not overlap its source), not --score-last "
                           f"{self.score_last}. Pass --score-last {room} or less, a longer --score-seq-len, or "
                           "--copy-weight 0.")

    def finishers(self) -> tuple[str, ...]:
        """The methods applied to the chosen recipe (:attr:`chosen_methods`, or every registered
        method whose ``search`` is ``"chosen"``)."""
        from kvcalib.methods import registry

        if self.chosen_methods is not None:
            return tuple(self.chosen_methods)
        return tuple(name for name, m in registry().items() if m.search == "chosen")

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as recorded in ``search.json``: the run folder and storage without
        machine paths (:mod:`.provenance`)."""
        from kvcalib.optimize.provenance import describe_storage, display_path

        out = asdict(self)
        out["space"] = self.space.to_dict()  # type: ignore[union-attr]
        out["out"] = display_path(self.out) if self.out else None
        out["storage"] = describe_storage(self.storage) if self.storage else None
        out["presets"] = list(self.presets)
        out["points_from"] = display_path(Path(self.points_from)) if self.points_from else None
        return out


@dataclass
class SearchResult:
    run_dir: Path
    recipe_path: Path | None
    chosen_trial: int | None
    kl: float | None
    effective_bits: float | None
    floor_bits: float
    n_trials: int
    pareto: list[int]
    held_out: list[dict[str, Any]] = field(default_factory=list)
    table: str = ""  # the held-out table (markdown)
    report_path: Path | None = None
    seconds: float = 0.0
    kl_ordinary: float | None = None  # the chosen trial's KL on the ordinary scoring windows
    kl_copy: float | None = None  # ... and on the copy windows (None: the search scored none)


# ------------------------------------------------------------------ data
def scoring_sequences(run: dict[str, Any], tokenizer, n: int, seq_len: int):
    """``(n, seq_len)`` windows following the ones the statistics were collected on (same packing)."""
    from kvcalib.data import load_texts, pack_samples

    cfg = run.get("config", {})
    used = int(run.get("samples_packed", cfg.get("samples", 0)))
    c_len = int(cfg.get("seq_len", seq_len))
    if cfg.get("split", "calib") != "calib":
        raise KvcalibError("the run folder's statistics were not collected on the calib split: collect again with --split calib.")
    texts = load_texts(cfg.get("data", "embedded"), split="calib", text_field=cfg.get("text_field"))
    length = max(c_len, seq_len)
    # same seed and window length as collection: the first `used` windows are the collected ones
    windows = pack_samples(texts, tokenizer, c_len, used + n * math.ceil(length / c_len), int(cfg.get("seed", 0)))
    rest = windows[used:]
    if rest.shape[0] == 0:
        raise KvcalibError(f"the calibration text holds no window beyond the {used} collected ones: "
                           "collect fewer --samples or use more text (--data).")
    stream = rest.reshape(-1)
    k = min(n, stream.numel() // seq_len)
    if k < 1:
        raise KvcalibError(f"not enough held calibration text for one {seq_len}-token scoring sequence: lower --seq-len.")
    return stream[: k * seq_len].reshape(k, seq_len)


# ------------------------------------------------------------------ the search
def search_copy_windows(config: SearchConfig, score_ids, window_offset: int = 0):
    """The copy windows of ``score_ids`` (M, T) the search scores (:func:`kvcalib.eval.copy.copy_windows`,
    one per scoring window, from the same calibration text), or None where ``config.copy_weight`` is 0.
    ``window_offset``: 1 where each window starts with a BOS the tokenizer adds (it is not copied)."""
    if not config.copy_weight:
        return None
    from kvcalib.eval.copy import copy_windows

    return copy_windows(score_ids, int(config.score_last), window_offset)  # ids (M, T)


def search_with(config: SearchConfig, model, info, stats, score_ids, run_dir: Path, *, progress: bool = True,
                extra: dict[str, Any] | None = None, window_offset: int = 0) -> dict[str, Any]:
    """The study over a loaded model, statistics and scoring ids (M, T); returns the ``search.json``
    document (also written to ``run_dir``), with ``recipe.safetensors``, plots and ``report.md``.
    ``window_offset``: 1 where each scoring window starts with a BOS (:func:`search_copy_windows`)."""
    from kvcalib import __version__
    from kvcalib.io import write_json_atomic
    from kvcalib.layout import ACCOUNTING, legacy_bits_factor
    from kvcalib.optimize import guards, report, study as st
    from kvcalib.optimize.objective import SearchObjective, rotation_overrides
    from kvcalib.optimize.provenance import describe_storage, display_path
    from kvcalib.optimize.space import check_scored_schedules
    from kvcalib.recipe import load_preset

    t0 = time.perf_counter()
    space: SearchSpace = config.space  # type: ignore[assignment]
    run_dir = Path(run_dir)
    n = info.num_layers
    for g in space.groups:  # value groups run along channels: they must divide head_dim
        if info.head_dim % g:
            raise SpaceError(f"search space group {g} does not divide head_dim {info.head_dim} of {info.name}")
    check_scored_schedules(space, int(score_ids.shape[1]), config.context)
    guards.check_quantized_scoring(space, int(score_ids.shape[1]), "the scoring length")
    replayed = st.replay_points(config.points_from, space, n) if config.points_from else []  # before the study
    copies = search_copy_windows(config, score_ids, window_offset)
    objective = SearchObjective(model, info, stats, score_ids, context=config.context, seed=config.seed,
                                score_last=config.score_last, copy_ids=None if copies is None else copies.ids,
                                copy_weight=config.copy_weight or 0.0,
                                method_overrides=rotation_overrides(config.rotate))
    floor_bits = st.floor_bits(objective, space)
    check_budget(config, space, floor_bits, objective)
    url = st.storage_url(config.storage, run_dir)
    default_storage = config.storage is None
    if default_storage and (run_dir / "study.db").exists() and not config.resume:
        raise KvcalibError(f"{run_dir} already holds a study (study.db): pass --resume to continue it, or another --out.")
    if config.resume and default_storage and not (run_dir / "study.db").exists():  # opening would create it
        raise KvcalibError(f"nothing to resume in {run_dir}: it holds no study yet: run without --resume.")
    warm_n = 5
    pareto = config.objective == "pareto"
    study = st.open_study(url, config.study, space, n,
                          sampler=st.make_sampler(config.seed, config.budget_bits, warm_n, config.objective),
                          pruner=None if pareto else st.make_pruner(objective.n_sequences),
                          must_exist=config.resume and default_storage,
                          legacy_same=legacy_bits_factor(config.context, info.sliding_window) == 1.0,
                          objective=config.objective, heartbeat=config.heartbeat)
    guards.record_objective(study, config, str(run_dir) if default_storage else url)  # or refuse another one
    # an interrupted run's unfinished trials run again; RUNNING ones only in a study we own (in a
    # shared one, the heartbeats find a dead worker's trials)
    if default_storage:
        recovered = st.recover_interrupted(study, running=True) if config.resume else []
    else:
        recovered = st.recover_shared(study, config.heartbeat)
    with _bar(progress, None, "search: warm start", "") as bar:
        for m in range(objective.n_sequences):
            objective.reference(m)
        lock = st.claim_warm_start(study, not default_storage, config.heartbeat,
                                   on_wait=lambda: bar.update(info="another worker runs the warm start"))
        sensitivity = study.user_attrs.get("sensitivity")
        if lock is not None:
            with lock.held():  # released on a failure too: a waiting worker takes the warm start over
                if config.sweep and sensitivity is None:
                    bar.update(total=n)
                    sensitivity = st.sensitivity_sweep(objective, space, on_layer=lambda i: bar.advance(1, info=f"layer {i}"))
                    study.set_user_attr("sensitivity", sensitivity)
                if not sensitivity:
                    pts = [space.floor_point(n)]
                elif pareto:
                    pts = st.front_warm_start_points(objective, space, sensitivity, floor_bits,
                                                     front_top(config.budget_bits, floor_bits))
                else:
                    pts = st.warm_start_points(objective, space, sensitivity, config.budget_bits)
                if config.points_from:  # first in the queue: Optuna runs the oldest waiting trial first
                    st.enqueue(study, replayed, space,
                               attrs={"replayed_from": display_path(Path(config.points_from))})
                st.enqueue(study, pts, space)
                study.set_user_attr(st.ATTR_WARM_DONE, True)
    line = TrialProgress(config.trials, config.budget_bits, st.finished_count(study), timeout=config.timeout)
    fn = st.make_objective_fn(objective, space, config.budget_bits, config.objective)
    local = st.make_local_callback(objective, space, config.budget_bits, config.seed, pareto=pareto)
    with _bar(progress, config.trials, "search", "trials") as bar:
        bar.advance(line.done_at_start)
        plain = progress and not _quiet() and not sys.stderr.isatty()  # a log file gets one line per trial

        def on_trial(study_, trial) -> None:
            trials = study_.get_trials(deepcopy=False)  # one read of the study per trial: it is between every two trials
            text = line.update(st.finished_count(study_, trials), trials)
            bar.update(completed=line.done, info=text)
            if plain:
                print(f"search: {line.done}/{config.trials} trials | {text}", file=sys.stderr, flush=True)

        st.run_trials(study, fn, config.trials, timeout=config.timeout, on_trial=on_trial, extra_callbacks=(local,))
        # the other workers' last trials (and the retries of any that died): every run folder then
        # reports the same study
        st.drain(study, fn, callbacks=(local, on_trial), settle=0.0 if default_storage else 1.0,
                 on_wait=lambda k: bar.update(info=f"waiting for {k} trial(s) of other workers"))
    records = st.trial_records(study, space, n, config.budget_bits)
    params_by_number = {t.number: t.params for t in study.get_trials(deepcopy=False)}

    # presets on the same objective (for the plot and the report)
    presets = []
    for name in config.presets:
        rec = load_preset(name)
        parts = objective.parts_recipe(rec)
        presets.append({"name": name, "effective_bits": rec.memory(info, config.context).effective_bits,
                        "kl": parts.value, "kl_ordinary": parts.ordinary, "kl_copy": parts.copy})
    front = st.pareto_front(records)
    chosen = None
    try:
        chosen = st.choose(records, config.budget_bits)
    except KvcalibError:
        chosen = None

    doc: dict[str, Any] = {
        "format": "kvcalib-search", "version": SEARCH_VERSION, "accounting": ACCOUNTING, "kvcalib_version": __version__,
        "run_dir": display_path(run_dir), "command": config.command,
        "config": config.to_dict(), "model": info.to_dict(), "space": space.to_dict(),
        "study": config.study, "storage": describe_storage(config.storage), "budget_bits": config.budget_bits,
        "objective": config.objective,
        "context": config.context,
        "floor_bits": floor_bits, "score_sequences": objective.n_ordinary, "score_seq_len": int(score_ids.shape[1]),
        "score_last": config.score_last,
        # copy windows: how many, the copied span, and their weight in the objective (0: none scored)
        "copy_sequences": objective.n_copy, "copy_span": copies.passage_len if copies is not None else None,
        "copy_weight": objective.copy_weight,
        "stats_samples": (extra or {}).get("stats_samples"), "sensitivity": sensitivity, "presets": presets,
        "trials": records, "pareto": front, "chosen": chosen["number"] if chosen else None,
        "recovered": recovered, "recipe": None, "recipe_name": None, "seconds": round(time.perf_counter() - t0, 1),
    }
    doc.update(extra or {})
    if chosen is not None:
        point = Point.from_params(params_by_number[chosen["number"]], space, n)
        name = f"{info.name}-search-{config.budget_bits:g}b"
        recipe = objective.recipe(point, name, provenance=search_provenance(doc, chosen))
        if objective.stats is not None:
            from kvcalib.calibrate import build_methods

            for method in build_methods(config.finishers()):
                try:
                    recipe = method.finish(recipe, objective.stats)
                    doc[method.name] = recipe.provenance.get(method.name)
                except KvcalibError as err:  # e.g. all 16-bit, or PATS tiers (one codebook per tier is not built)
                    doc[method.name] = {"skipped": str(err)}
        recipe.save(run_dir / "recipe.safetensors")
        doc["recipe"], doc["recipe_name"] = "recipe.safetensors", name
        from kvcalib.runtime.triton_path import decode_paths

        doc["decode_paths"] = decode_paths(recipe, info)  # per layer: None = the fused kernel on a GPU
        report.plot_bits_per_layer(chosen["point"], sensitivity, run_dir / "bits_per_layer.png")
    report.plot_pareto(records, front, presets, config.budget_bits, doc["chosen"], run_dir / "pareto.png",
                       context=config.context, copy_weight=doc.get("copy_weight") or 0.0)
    write_json_atomic(run_dir / "search.json", doc)
    report.write_report(doc, run_dir / "report.md")
    return doc


def front_top(budget: float, floor_bits: float) -> float:
    """The top of the bits range the Pareto mode's warm start covers: twice the budget (a budget
    of 3 bits: up to 6, past KIVI-4's 5.3), at least 2 bits above the floor."""
    return max(2.0 * budget, floor_bits + 2.0)


def check_budget(config: SearchConfig, space: SearchSpace, floor_bits: float, objective: Any = None) -> None:
    """Refuse a budget below the cheapest point of the space (nothing could satisfy it), and (given
    the ``objective`` that counts bits) a budget so close to it that no layer can take more bits:
    every trial would then be the cheapest point again, and the search would choose nothing.
    A Pareto search is not held to the second (its budget only picks the recipe it writes)."""
    if config.budget_bits < floor_bits - 1e-9:
        raise KvcalibError(f"--budget-bits {config.budget_bits:g} is below the floor of the search space: every layer at "
                           f"{min(space.bits)} bits (group {max(space.groups)}, window {min(space.windows)}) already takes "
                           f"{floor_bits:.3f} effective bits at context {config.context}. Pass --budget-bits {math.ceil(floor_bits * 100) / 100:.2f} or more.")
    levels = sorted(set(space.bits))
    if objective is None or len(levels) < 2 or getattr(config, "objective", "budget") == "pareto":
        return
    import dataclasses

    from kvcalib.optimize.study import floor_points

    # one layer's values a level up, from each candidate floor (every schedule, byte-saving switches)
    step_bits = min(objective.effective_bits(dataclasses.replace(p, v_bits=(levels[1],) + p.v_bits[1:]),
                                             with_tensors="layers")
                    for p in floor_points(objective.info.num_layers, space))
    if config.budget_bits < step_bits - 1e-9:
        raise KvcalibError(f"--budget-bits {config.budget_bits:g} leaves no room to search: the cheapest point takes "
                           f"{floor_bits:.3f} effective bits and raising a single layer's values to {levels[1]} bits "
                           f"already takes {step_bits:.3f}, so every trial would be the cheapest point. Pass "
                           f"--budget-bits {math.ceil(step_bits * 100) / 100:.2f} or more (well above it lets the "
                           f"search place bits where they matter).")


def _quiet() -> bool:
    from kvcalib.progress import _quiet as quiet

    return quiet()


def _bar(progress: bool, total, description: str, unit: str):
    from kvcalib.progress import ProgressBar, _NullBar

    if not progress:
        return contextlib.nullcontext(_NullBar())
    return ProgressBar(total, description, unit)


class TrialProgress:
    """The live line of the trial phase: trials done, the best KL at or under the budget, and the
    time left, from the rate of trials finished since this process started (a resumed study's
    earlier trials and other workers' trials before that do not inflate the rate)."""

    def __init__(self, total: int, budget: float, done_at_start: int, timeout: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.budget, self.timeout, self.clock = total, budget, timeout, clock
        self.done_at_start = self.done = done_at_start
        self.start = clock()

    def seconds_left(self) -> float | None:
        """None until a trial has finished in this process."""
        elapsed = self.clock() - self.start
        new = self.done - self.done_at_start
        if new <= 0:
            return None
        left = max(0, self.total - self.done) * elapsed / new
        if self.timeout is not None:
            left = min(left, max(0.0, self.timeout - elapsed))
        return left

    def update(self, done: int, trials: Sequence[Any]) -> str:
        """The line after a trial; ``trials``: the study's frozen trials."""
        self.done = done
        feasible = [t for t in trials if t.values is not None
                    and t.user_attrs.get("effective_bits", math.inf) <= self.budget + 1e-9]
        best = min(feasible, key=lambda t: t.values[0], default=None)
        left = self.seconds_left()
        best_s = "-" if best is None else f"{best.values[0]:.4g} (trial {best.number}, {best.user_attrs['effective_bits']:.3f} bits)"
        left_s = "?" if left is None else _duration(left)
        return f"best KL at <= {self.budget:g} bits: {best_s} | ~{left_s} left"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def current_accounting(doc: dict[str, Any], sliding_window: Sequence[int | None] | None = None) -> dict[str, Any]:
    """``doc`` (a ``search.json`` document) with every effective-bits number in today's accounting
    (``kvcalib.layout.ACCOUNTING``). A version-1 file counted every layer at the full context; its
    bytes are the same, so its numbers convert exactly by ``legacy_bits_factor`` (1.0, and ``doc``
    unchanged but for the field, on a model without sliding-window layers). ``sliding_window``:
    the model's per-layer windows (default: the document's ``model``). A converted copy says so in
    ``accounting_converted``."""
    import copy

    from kvcalib.layout import ACCOUNTING, ACCOUNTINGS, LEGACY_ACCOUNTING, legacy_bits_factor

    accounting = doc.get("accounting", LEGACY_ACCOUNTING)
    if accounting == ACCOUNTING:
        return doc
    if accounting not in ACCOUNTINGS:
        raise KvcalibError(f"search.json names accounting {accounting!r}, which this kvcalib does not know "
                           f"({', '.join(ACCOUNTINGS)}): use the kvcalib that wrote it, or search again.")
    windows = sliding_window if sliding_window is not None else (doc.get("model") or {}).get("sliding_window")
    if windows is None:
        raise KvcalibError("search.json records no model geometry to convert its effective bits: search again.")
    factor = legacy_bits_factor(int(doc["context"]), windows)
    out = copy.deepcopy(doc)
    out["accounting"] = ACCOUNTING
    if factor == 1.0:
        return out

    def scale(v: Any) -> Any:
        return v * factor if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    for key in ("budget_bits", "floor_bits"):
        out[key] = scale(out.get(key))
    for rows in (out.get("trials") or [], out.get("presets") or [], out.get("held_out") or []):
        for row in rows:
            row["effective_bits"] = scale(row.get("effective_bits"))
    out["accounting_converted"] = {"from": accounting, "factor": factor}
    return out


def search_provenance(doc: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """What a searched recipe records about its origin (also for ``kvcalib export --trial``;
    ``doc`` may be a ``search.json`` written before ``run_dir``/``command`` existed)."""
    from kvcalib import __version__
    from kvcalib.optimize.provenance import describe_storage

    cfg = doc["config"]
    storage = doc.get("storage")
    if isinstance(storage, str):  # idempotent; an older search.json recorded absolute paths
        storage = describe_storage(storage)
    return {"made_by": "kvcalib search", "kvcalib_version": __version__, "data": cfg["data"],
            "samples": doc.get("stats_samples"), "score_samples": doc["score_sequences"],
            "seq_len": doc["score_seq_len"], "seed": cfg["seed"],
            "objective": "decode-faithful KL" + (" with copy windows" if doc.get("copy_weight") else ""),
            "objective_value": chosen["kl"], "effective_bits": chosen["effective_bits"], "trial": chosen["number"],
            # the objective's two parts (a search that scored copy windows)
            **({"copy_weight": doc["copy_weight"], "kl_ordinary": chosen.get("kl_ordinary"),
                "kl_copy": chosen.get("kl_copy")} if doc.get("copy_weight") else {}),
            "trials": len(doc["trials"]), "budget_bits": doc["budget_bits"], "context": doc["context"],
            "searched_context": doc["score_seq_len"], "score_last": doc.get("score_last"),
            "study": doc["study"], "storage": storage, "run": doc.get("run_dir"), "command": doc.get("command"),
            "schedule": (chosen.get("point") or {}).get("schedule", "none"),
            # the kind the rotate switch fitted (export rebuilds the point with it)
            "rotate": cfg.get("rotate", ROTATE_DEFAULT),
            **({"accounting_converted": doc["accounting_converted"]} if doc.get("accounting_converted") else {})}


def search(config: SearchConfig, *, loaded=None, progress: bool = True) -> SearchResult:
    """The whole ``kvcalib search`` job (see the module docstring)."""
    import torch

    from kvcalib.collection import CollectConfig, collect
    from kvcalib.models import load_model
    from kvcalib.optimize import report
    from kvcalib.stats import CollectedStats

    if config.workers != 1:  # the launcher imports this module, so it is not imported from here
        raise KvcalibError(f"search() runs one worker; workers={config.workers!r} runs through "
                           "kvcalib.optimize.workers.search_any(config), which starts the processes.")
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    if config.out is None:
        from kvcalib.paths import default_run_dir

        config.out = default_run_dir("search")
    run_dir = Path(config.out)
    has_stats = (run_dir / "stats.safetensors").is_file()
    if config.resume and not has_stats:
        raise KvcalibError(f"nothing to resume in {run_dir}: it holds no stats.safetensors / study.")
    if config.storage:  # an unreachable shared storage fails before any model loading or collection
        from kvcalib.optimize.study import probed_storage

        with probed_storage(config.storage):
            pass
    from kvcalib.optimize import guards

    if config.context is None:  # the model's maximum from its config on this machine, where it is (else after loading)
        from kvcalib.models import model_info_offline

        known = model_info_offline(config.model)
        if known is not None:
            config.resolve_context(known.max_positions)
    guards.check_study_before_work(config)  # a study to resume, with this objective: before any model loads
    guards.check_stats_before_work(run_dir)
    space: SearchSpace = config.space  # type: ignore[assignment]
    loaded = loaded or load_model(config.model, device=config.device, dtype=config.dtype)
    info = loaded.info
    config.resolve_context(info.max_positions)
    longest = max(config.scoring_length, config.eval_seq_len if config.eval else 0, config.context)
    if info.max_positions and longest > info.max_positions:
        raise KvcalibError(f"the search targets, scores or evaluates {longest}-token windows but {info.name} supports "
                           f"{info.max_positions} positions: pass --context {info.max_positions} or less (and lower "
                           "--score-seq-len / --eval-seq-len).")
    if config.scoring_length > 2048 and progress and next(loaded.model.parameters()).device.type == "cpu":
        print(f"note: the search scores {config.scoring_length}-token windows (--context {config.context}); on a CPU "
              "that takes hours (minutes on a GPU): pass --context 1024 for a quick CPU run", file=sys.stderr)
    config.presets = guards.presets_for(config.presets, info)  # found now, not after the trials
    # the floor check runs before any work, so a bad budget costs nothing and touches nothing
    from kvcalib.optimize.objective import SearchObjective, rotation_overrides
    from kvcalib.optimize.study import floor_bits

    counter = SearchObjective(loaded.model, info, None, torch.zeros(1, 2, dtype=torch.long), context=config.context,
                              method_overrides=rotation_overrides(config.rotate))
    check_budget(config, space, floor_bits(counter, space), counter)
    if not has_stats:
        collect(CollectConfig(model=config.model, data=config.data, split="calib", text_field=config.text_field,
                              samples=config.samples, seq_len=config.seq_len, batch_size=4,
                              reservoir_blocks=config.reservoir_blocks, block_len=min(config.block_len, config.seq_len),
                              seed=config.seed, device=config.device, dtype=config.dtype), run_dir, loaded=loaded)
    stats = CollectedStats.load(run_dir)
    if stats.model.config_hash != info.config_hash or stats.model.num_layers != info.num_layers:
        raise KvcalibError(f"the statistics in {run_dir} are from {stats.model.name}, not {info.name}: pass --model {stats.model.name} or another --out.")
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    score_ids = scoring_sequences(run, loaded.tokenizer, config.score_samples, config.scoring_length)
    from kvcalib.eval.windows import leading_bos

    window_offset = 1 if leading_bos(loaded.tokenizer) is not None else 0  # pack_samples opened each window with it
    stats_samples = int(run.get("samples_packed", run.get("config", {}).get("samples", 0)) or 0)
    from kvcalib.optimize.study import storage_errors, storage_url

    again = "run the same command again" + (" with --resume" if config.storage is None and not config.resume else "")
    # a start that fails before its first trial leaves no study.db; a storage that fails mid-search: one line
    with guards.no_empty_study(config), storage_errors(storage_url(config.storage, run_dir), again):
        doc = search_with(config, loaded.model, info, stats, score_ids, run_dir, progress=progress,
                          extra={"stats_samples": stats_samples}, window_offset=window_offset)
    held: list[dict[str, Any]] = []
    if config.eval and doc.get("recipe"):
        from kvcalib.eval.harness import EvalConfig, evaluate

        copy_len, copy_tail, copy_samples = proof_copy_settings(config.eval_seq_len, config.eval_samples)
        ecfg = EvalConfig(model=config.model, recipes=[str(run_dir / "recipe.safetensors"), *config.presets],
                          data=config.data, text_field=config.text_field, metrics="ppl,copy", context_len=config.context,
                          ppl_samples=config.eval_samples, ppl_seq_len=config.eval_seq_len, seed=config.seed,
                          copy_len=copy_len, copy_tail=copy_tail, copy_samples=copy_samples,
                          # after the trials, a short text is no reason to fail
                          ppl_allow_fewer=True, copy_allow_fewer=True)
        results = evaluate(ecfg, loaded)
        held = [r.to_dict() for r in results]
        for h in held:  # the searched recipe by its path relative to the run folder, not the machine's
            if h["recipe"] == str(run_dir / "recipe.safetensors"):
                h["recipe"] = "recipe.safetensors"
        doc["held_out"] = held
        doc["held_out_config"] = {"ppl_samples": config.eval_samples, "ppl_seq_len": config.eval_seq_len, "data": config.data,
                                  "copy_len": copy_len, "copy_tail": copy_tail, "copy_samples": copy_samples}
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    from kvcalib.io import write_json_atomic

    write_json_atomic(run_dir / "search.json", doc)
    report.write_report(doc, run_dir / "report.md")
    return result_from_doc(doc, run_dir)


def proof_copy_settings(eval_seq_len: int, eval_samples: int) -> tuple[int, int, int]:
    """The held-out proof's copy metric: (passage tokens, scored tail, passages). A passage is half a
    proof window, so a repeated passage is as long as one perplexity window and its copy reaches as
    far back as the proof's context; half as many passages as perplexity windows, each scoring its
    last quarter (at most :data:`~kvcalib.eval.copy.COPY_TAIL` tokens) as decode steps after an
    SDPA prompt, cost under half the perplexity proof (whose every row is a decode step)."""
    from kvcalib.eval.copy import COPY_TAIL

    passage = max(2, (eval_seq_len - 1) // 2)  # [BOS] P P fits a proof window (2: the metric's least)
    return passage, max(1, min(COPY_TAIL, passage // 4)), max(1, eval_samples // 2)


def result_from_doc(doc: dict[str, Any], run_dir: Path) -> SearchResult:
    """The :class:`SearchResult` of a run folder's ``search.json`` document."""
    from kvcalib.optimize.report import held_out_table

    table = held_out_table(doc)
    chosen = next((r for r in doc["trials"] if r["number"] == doc["chosen"]), None)
    return SearchResult(run_dir=run_dir, recipe_path=run_dir / "recipe.safetensors" if doc.get("recipe") else None,
                        chosen_trial=doc["chosen"], kl=chosen["kl"] if chosen else None,
                        effective_bits=chosen["effective_bits"] if chosen else None, floor_bits=doc["floor_bits"],
                        n_trials=len(doc["trials"]), pareto=doc["pareto"], held_out=doc.get("held_out", []),
                        table=table, report_path=run_dir / "report.md", seconds=doc["seconds"],
                        kl_ordinary=chosen.get("kl_ordinary") if chosen else None,
                        kl_copy=chosen.get("kl_copy") if chosen else None)
