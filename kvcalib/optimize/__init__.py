"""``kvcalib search``: Optuna per-layer {2,4,8}-bit search for the best recipe under a memory budget.

Phases, all into one run folder (never overwritten; ``resume`` continues it):

1. collect: statistics on the first ``samples`` calibration windows (skipped when the folder
   already holds ``stats.safetensors``, e.g. from ``kvcalib collect``);
2. objective: the next ``score_samples`` windows of the same packing (disjoint from 1), cut to
   ``seq_len`` tokens; full-precision log-probs cached (:mod:`.objective`);
3. warm start + study (:mod:`.study`): sensitivity sweep, greedy points, TPE with the budget as
   a constraint, Pareto pruning, SQLite/journal storage;
4. outputs: ``search.json`` (every trial), ``recipe.safetensors`` (lowest KL at or under the
   budget), ``pareto.png``, ``bits_per_layer.png``, ``report.md`` (:mod:`.report`);
5. held-out proof: :func:`kvcalib.eval.harness.evaluate` (ppl) of the chosen recipe and the
   presets on the evaluation split.

Import cost: this package imports neither optuna nor matplotlib until a search runs.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.errors import KvcalibError
from kvcalib.optimize.space import Point, SearchSpace, SpaceError

__all__ = ["SearchConfig", "SearchResult", "SearchSpace", "Point", "SpaceError", "search", "search_with"]

PRESETS = ("kivi-2", "kivi-4", "pertoken-4")


@dataclass
class SearchConfig:
    """What ``kvcalib search`` runs (validated on construction)."""

    model: str = "smollm2-135m"
    data: str = "embedded"
    text_field: str | None = None
    out: Path | None = None  # run folder (default artifacts/runs/search-<time>)
    samples: int = 8  # collection windows
    seq_len: int = 256  # tokens per window (collection and scoring)
    score_samples: int = 2  # held calibration windows scored by the objective
    trials: int = 30  # finished trials the study should hold
    budget_bits: float = 3.0
    context: int = 4096  # effective bits accounted at this context length
    space: SearchSpace | str | Path | None = None
    storage: str | None = None  # default sqlite:///RUN_DIR/study.db
    study: str = "kvcalib-search"
    resume: bool = False
    sweep: bool = True
    timeout: float | None = None  # seconds for the trial phase
    seed: int = 0
    eval: bool = True
    eval_samples: int = 4
    eval_seq_len: int = 512
    presets: tuple[str, ...] = PRESETS
    device: str | None = None
    dtype: str | None = None
    reservoir_blocks: int = 8
    block_len: int = 128

    def __post_init__(self) -> None:
        for name, low in (("samples", 1), ("seq_len", 2), ("score_samples", 1), ("trials", 1), ("context", 1),
                          ("eval_samples", 1), ("eval_seq_len", 2), ("reservoir_blocks", 0), ("block_len", 1)):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise KvcalibError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {val!r}.")
        if not isinstance(self.budget_bits, (int, float)) or not math.isfinite(self.budget_bits) or self.budget_bits <= 0:
            raise KvcalibError(f"--budget-bits must be a positive number, got {self.budget_bits!r}.")
        if self.timeout is not None and self.timeout <= 0:
            raise KvcalibError(f"--timeout must be positive seconds, got {self.timeout!r}.")
        if not self.study or not str(self.study).strip():
            raise KvcalibError("--study must be a non-empty name.")
        if self.block_len > self.seq_len:
            self.block_len = self.seq_len
        if self.space is None:
            self.space = SearchSpace()
        elif isinstance(self.space, (str, Path)):
            self.space = SearchSpace.from_file(self.space)
        elif isinstance(self.space, dict):
            self.space = SearchSpace.from_dict(self.space)
        self.presets = tuple(self.presets)
        if self.out is not None:
            self.out = Path(self.out)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["space"] = self.space.to_dict()  # type: ignore[union-attr]
        out["out"] = str(self.out) if self.out else None
        out["presets"] = list(self.presets)
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
def search_with(config: SearchConfig, model, info, stats, score_ids, run_dir: Path, *, progress: bool = True,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The study over a loaded model, statistics and scoring ids (M, T); returns the ``search.json``
    document (also written to ``run_dir``), with ``recipe.safetensors``, plots and ``report.md``."""
    from kvcalib import __version__
    from kvcalib.io import write_json_atomic
    from kvcalib.optimize import report, study as st
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.progress import ProgressBar
    from kvcalib.recipe import load_preset

    t0 = time.perf_counter()
    space: SearchSpace = config.space  # type: ignore[assignment]
    run_dir = Path(run_dir)
    n = info.num_layers
    for g in space.groups:  # value groups run along channels: they must divide head_dim
        if info.head_dim % g:
            raise SpaceError(f"search space group {g} does not divide head_dim {info.head_dim} of {info.name}")
    objective = SearchObjective(model, info, stats, score_ids, context=config.context, seed=config.seed)
    floor_bits = objective.effective_bits(space.floor_point(n), with_tensors=False)
    if config.budget_bits < floor_bits - 1e-9:
        raise KvcalibError(f"--budget-bits {config.budget_bits:g} is below the floor of the search space: every layer at "
                           f"{min(space.bits)} bits (group {max(space.groups)}, window {min(space.windows)}) already takes "
                           f"{floor_bits:.3f} effective bits at context {config.context}. Pass --budget-bits {math.ceil(floor_bits * 100) / 100:.2f} or more.")
    url = st.storage_url(config.storage, run_dir)
    default_storage = config.storage is None
    if default_storage and (run_dir / "study.db").exists() and not config.resume:
        raise KvcalibError(f"{run_dir} already holds a study (study.db): pass --resume to continue it, or another --out.")
    warm_n = 5
    study = st.open_study(url, config.study, space, n, sampler=st.make_sampler(config.seed, config.budget_bits, warm_n),
                          pruner=st.make_pruner(objective.n_sequences),
                          must_exist=config.resume and default_storage)
    if config.resume and default_storage:
        st.recover_interrupted(study)
    sensitivity = study.user_attrs.get("sensitivity")
    new_study = len(study.trials) == 0
    with ProgressBar(None, "search: warm start", "") as bar:
        for m in range(objective.n_sequences):
            objective.reference(m)
        if new_study and config.sweep:
            bar.update(total=n)
            sensitivity = st.sensitivity_sweep(objective, space, on_layer=lambda i: bar.advance(1, info=f"layer {i}"))
            study.set_user_attr("sensitivity", sensitivity)
        if new_study:
            pts = (st.warm_start_points(objective, space, sensitivity, config.budget_bits) if sensitivity
                   else [space.floor_point(n)])
            st.enqueue(study, pts, space)
    with ProgressBar(config.trials, "search", "trials") as bar:
        bar.advance(st.finished_count(study))
        start = time.perf_counter()

        def on_trial(study_, trial) -> None:
            done = st.finished_count(study_)
            recs = [t for t in study_.get_trials(deepcopy=False) if t.value is not None
                    and t.user_attrs.get("effective_bits", math.inf) <= config.budget_bits + 1e-9]
            best = min((t.value for t in recs), default=None)
            el = time.perf_counter() - start
            left = (config.trials - done) * el / max(1, done) if done else 0
            bar.update(completed=done, info=f"best KL at <= {config.budget_bits:g} bits: "
                       f"{'-' if best is None else f'{best:.4g}'} | ~{left:.0f} s left")

        st.run_trials(study, st.make_objective_fn(objective, space, config.budget_bits), config.trials, timeout=config.timeout,
                      on_trial=on_trial,
                      extra_callbacks=(st.make_local_callback(objective, space, config.budget_bits, config.seed + len(study.trials)),))

    # presets on the same objective (for the plot and the report)
    presets = []
    for name in config.presets:
        rec = load_preset(name)
        presets.append({"name": name, "effective_bits": rec.memory(info, config.context).effective_bits,
                        "kl": objective.kl_recipe(rec)})
    records = st.trial_records(study, space, n, config.budget_bits)
    front = st.pareto_front(records)
    chosen = None
    try:
        chosen = st.choose(records, config.budget_bits)
    except KvcalibError:
        chosen = None
    doc: dict[str, Any] = {
        "format": "kvcalib-search", "version": 1, "kvcalib_version": __version__,
        "config": config.to_dict(), "model": info.to_dict(), "space": space.to_dict(),
        "study": config.study, "storage": url, "budget_bits": config.budget_bits, "context": config.context,
        "floor_bits": floor_bits, "score_sequences": objective.n_sequences, "score_seq_len": int(score_ids.shape[1]),
        "stats_samples": (extra or {}).get("stats_samples"), "sensitivity": sensitivity, "presets": presets,
        "trials": records, "pareto": front, "chosen": chosen["number"] if chosen else None,
        "recipe": None, "recipe_name": None, "seconds": round(time.perf_counter() - t0, 1),
    }
    doc.update(extra or {})
    if chosen is not None:
        point = Point.from_params(study.trials[chosen["number"]].params, space, n)
        name = f"{info.name}-search-{config.budget_bits:g}b"
        recipe = objective.recipe(point, name, provenance=search_provenance(doc, chosen))
        recipe.save(run_dir / "recipe.safetensors")
        doc["recipe"], doc["recipe_name"] = "recipe.safetensors", name
        report.plot_bits_per_layer(chosen["point"], sensitivity, run_dir / "bits_per_layer.png")
    report.plot_pareto(records, front, presets, config.budget_bits, doc["chosen"], run_dir / "pareto.png")
    write_json_atomic(run_dir / "search.json", doc)
    report.write_report(doc, run_dir / "report.md")
    return doc


def search_provenance(doc: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    from kvcalib import __version__

    cfg = doc["config"]
    return {"made_by": "kvcalib search", "kvcalib_version": __version__, "data": cfg["data"],
            "samples": doc.get("stats_samples"), "score_samples": doc["score_sequences"],
            "seq_len": doc["score_seq_len"], "seed": cfg["seed"], "objective": "decode-faithful KL",
            "objective_value": chosen["kl"], "effective_bits": chosen["effective_bits"], "trial": chosen["number"],
            "trials": len(doc["trials"]), "budget_bits": doc["budget_bits"], "context": doc["context"],
            "study": doc["study"], "storage": doc["storage"]}


def search(config: SearchConfig, *, loaded=None, progress: bool = True) -> SearchResult:
    """The whole ``kvcalib search`` job (see the module docstring)."""
    import torch

    from kvcalib.collection import CollectConfig, collect
    from kvcalib.models import load_model
    from kvcalib.optimize import report
    from kvcalib.stats import CollectedStats

    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    if config.out is None:
        from kvcalib.cli import default_run_dir

        config.out = default_run_dir("search")
    run_dir = Path(config.out)
    has_stats = (run_dir / "stats.safetensors").is_file()
    if config.resume and not has_stats:
        raise KvcalibError(f"nothing to resume in {run_dir}: it holds no stats.safetensors / study.")
    if config.storage:  # an unreachable shared storage fails before any model loading or collection
        from kvcalib.optimize.study import open_storage

        open_storage(config.storage)
    loaded = loaded or load_model(config.model, device=config.device, dtype=config.dtype)
    info = loaded.info
    space: SearchSpace = config.space  # type: ignore[assignment]
    # the floor check runs before any work, so a bad budget costs nothing and touches nothing
    from kvcalib.optimize.objective import SearchObjective

    floor_bits = SearchObjective(loaded.model, info, None, torch.zeros(1, 2, dtype=torch.long),
                                 context=config.context).effective_bits(space.floor_point(info.num_layers), with_tensors=False)
    if config.budget_bits < floor_bits - 1e-9:
        raise KvcalibError(f"--budget-bits {config.budget_bits:g} is below the floor of the search space: every layer at "
                           f"{min(space.bits)} bits (group {max(space.groups)}, window {min(space.windows)}) already takes "
                           f"{floor_bits:.3f} effective bits at context {config.context}. Pass --budget-bits {math.ceil(floor_bits * 100) / 100:.2f} or more.")
    if not has_stats:
        collect(CollectConfig(model=config.model, data=config.data, split="calib", text_field=config.text_field,
                              samples=config.samples, seq_len=config.seq_len, batch_size=4,
                              reservoir_blocks=config.reservoir_blocks, block_len=min(config.block_len, config.seq_len),
                              seed=config.seed, device=config.device, dtype=config.dtype), run_dir, loaded=loaded)
    stats = CollectedStats.load(run_dir)
    if stats.model.config_hash != info.config_hash or stats.model.num_layers != info.num_layers:
        raise KvcalibError(f"the statistics in {run_dir} are from {stats.model.name}, not {info.name}: pass --model {stats.model.name} or another --out.")
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    score_ids = scoring_sequences(run, loaded.tokenizer, config.score_samples, config.seq_len)
    stats_samples = int(run.get("samples_packed", run.get("config", {}).get("samples", 0)) or 0)
    doc = search_with(config, loaded.model, info, stats, score_ids, run_dir, progress=progress,
                      extra={"stats_samples": stats_samples})
    held: list[dict[str, Any]] = []
    if config.eval and doc.get("recipe"):
        from kvcalib.eval.harness import EvalConfig, evaluate

        ecfg = EvalConfig(model=config.model, recipes=[str(run_dir / "recipe.safetensors"), *config.presets],
                          data=config.data, text_field=config.text_field, metrics="ppl", context_len=config.context,
                          ppl_samples=config.eval_samples, ppl_seq_len=config.eval_seq_len, seed=config.seed)
        results = evaluate(ecfg, loaded)
        held = [r.to_dict() for r in results]
        doc["held_out"] = held
        doc["held_out_config"] = {"ppl_samples": config.eval_samples, "ppl_seq_len": config.eval_seq_len, "data": config.data}
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    from kvcalib.io import write_json_atomic

    write_json_atomic(run_dir / "search.json", doc)
    table = report.write_report(doc, run_dir / "report.md")
    chosen = next((r for r in doc["trials"] if r["number"] == doc["chosen"]), None)
    return SearchResult(run_dir=run_dir, recipe_path=run_dir / "recipe.safetensors" if doc.get("recipe") else None,
                        chosen_trial=doc["chosen"], kl=chosen["kl"] if chosen else None,
                        effective_bits=chosen["effective_bits"] if chosen else None, floor_bits=doc["floor_bits"],
                        n_trials=len(doc["trials"]), pareto=doc["pareto"], held_out=held, table=table,
                        report_path=run_dir / "report.md", seconds=doc["seconds"])
