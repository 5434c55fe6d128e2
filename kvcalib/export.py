"""``kvcalib export``: a fitted recipe from collected statistics, with methods chosen by flags.

The statistics record the model they came from, so the recipe is fitted for that model (name,
geometry, config hash) and refused for any other.

Methods: ``center`` / ``reorder`` / ``clip`` (named flags), and

- ``outliers=N`` (OTT): :class:`~kvcalib.calibrate.outliers.OutlierMethod` with ``pool=N`` decides
  per layer from the statistics' reservoir: ``N`` where tracing N outlier tokens cuts the per-token
  key error by at least 5 %, else 0. This is OTT's "no outlier tokens in the first layers", found
  from data instead of by layer index (SmolLM2-135M at k2v2: pools on layers 3, 4, 6, 9 and 10,
  none on layers 0-2 nor on the 20 layers where the gain stays under 5 %), so the pools'
  full-precision bytes (35 slots per kv head and layer) are only paid where they help.
  Writes ``layers.{i}.kv.outlier_pool`` and ``layers.{i}.kv.outlier_gain``.
- ``schedule=old-heavy|middle-heavy|new-heavy`` (PATS, :mod:`kvcalib.calibrate.schedule`): the
  first quantized tier is the layer config (``bits``, ``window``), then each side's bits halve at
  each of ``schedule_ages`` (8 -> 4 -> 2; a side at 2 stays at 2, so at k2v2 no lower tier
  exists and the schedule adds only its sinks). ``middle-heavy`` keeps 4 sinks (both ends kept),
  ``old-heavy`` none (the oldest end truncated most); ``new-heavy`` stores every non-sink token at
  ``bits`` from the start (window 0, 4 sinks). Writes ``layers.{i}.kv.schedule``. Sinks and window
  default to what the preset needs; an explicit value that contradicts it is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvcalib.errors import KvcalibError
from kvcalib.recipe import LayerConfig, Recipe

EXPORT_METHODS = ("center", "reorder", "clip")  # named methods; OTT and PATS have their own settings
SCHEDULES = ("old-heavy", "middle-heavy", "new-heavy")  # = kvcalib.calibrate.schedule.PRESETS
SCHEDULE_AGES = (1024, 4096)  # ages where a schedule halves the bits (preset_schedule's)
SCHEDULE_SINKS = 4  # sinks of the presets that keep the oldest end (preset_schedule's)
DEFAULT_WINDOW = 128
_BITS = re.compile(r"^k(2|4|8|16)v(2|4|8|16)$")


def parse_bits(spec: str) -> tuple[int, int]:
    """``"k2v4"`` -> (2, 4)."""
    match = _BITS.match(spec.strip().lower())
    if not match:
        raise KvcalibError(f"--bits {spec!r} is not of the form k<bits>v<bits> with bits in 2, 4, 8, 16 (e.g. k2v2, k4v2).")
    return int(match.group(1)), int(match.group(2))


@dataclass
class ExportConfig:
    """What ``kvcalib export`` builds (validated on construction)."""

    bits: str = "k2v2"
    group: int = 32
    window: int | None = None  # None: 128, or 0 with schedule new-heavy
    sinks: int | None = None  # None: 0, or 4 with schedule middle-heavy / new-heavy
    methods: list[str] = field(default_factory=list)
    name: str | None = None
    seed: int = 0
    outliers: int | None = None  # OTT pool size (None or 0: off)
    schedule: str | None = None  # PATS preset (None: off)
    schedule_ages: tuple[int, ...] = SCHEDULE_AGES
    huffman: bool = False  # KVComp: Huffman codebooks of the quantized symbols (entropy-coding tier)

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in EXPORT_METHODS]
        if unknown:
            raise KvcalibError(f"unknown method(s) {unknown}: export supports {', '.join(EXPORT_METHODS)}, "
                               "plus --outliers N and --schedule PRESET.")
        self.k_bits, self.v_bits = parse_bits(self.bits)
        if self.outliers is not None and (isinstance(self.outliers, bool) or not isinstance(self.outliers, int)
                                          or self.outliers < 0):
            raise KvcalibError(f"--outliers {self.outliers!r} is not a pool size: pass an integer >= 0 "
                               "(3 is OTT's default, 0 turns it off).")
        self._resolve_schedule_defaults()
        try:
            self.layer = LayerConfig(k_bits=self.k_bits, v_bits=self.v_bits, k_group=self.group,
                                     v_group=self.group, window=self.window, sinks=self.sinks)
        except ValueError as err:
            raise KvcalibError(f"invalid recipe settings: {err}.") from None
        self.layer_schedule = self._build_schedule() if self.schedule is not None else None

    def _resolve_schedule_defaults(self) -> None:
        """Window and sinks: defaults, or what the schedule preset needs (a contradiction is refused)."""
        sched = self.schedule
        if sched is not None and sched not in SCHEDULES:
            raise KvcalibError(f"--schedule {sched!r} is not known: use one of {', '.join(SCHEDULES)}.")
        want_sinks = SCHEDULE_SINKS if sched in ("middle-heavy", "new-heavy") else 0
        if self.sinks is None:
            self.sinks = want_sinks
        elif sched == "old-heavy" and self.sinks:
            raise KvcalibError(f"--schedule old-heavy truncates the oldest tokens most, so it keeps no sinks, "
                               f"but --sinks is {self.sinks}: drop --sinks, or use --schedule middle-heavy.")
        elif sched in ("middle-heavy", "new-heavy") and not self.sinks:
            raise KvcalibError(f"--schedule {sched} keeps the oldest tokens (sinks) in full precision, but --sinks "
                               f"is 0: leave --sinks out ({SCHEDULE_SINKS}) or pass --sinks >= 1 (or use old-heavy).")
        if self.window is None:
            self.window = 0 if sched == "new-heavy" else DEFAULT_WINDOW
        elif sched == "new-heavy" and self.window:
            raise KvcalibError(f"--schedule new-heavy stores every non-sink token at --bits from the moment it is "
                               f"written (no full-precision window), but --window is {self.window}: leave "
                               "--window out or pass --window 0.")
        ages = tuple(self.schedule_ages)
        if sched is not None and sched != "new-heavy":
            bad = [a for a in ages if isinstance(a, bool) or not isinstance(a, int)]
            if bad or list(ages) != sorted(set(ages)) or (ages and ages[0] <= self.window):
                raise KvcalibError(f"--schedule-ages {','.join(map(str, ages))} must be strictly increasing "
                                   f"integers above the window ({self.window}), e.g. 1024,4096.")
        self.schedule_ages = ages

    def _build_schedule(self):
        """The PATS schedule of every compressed layer, checked against the layer config."""
        from kvcalib.calibrate.schedule import Schedule, Tier

        cfg = self.layer
        if not cfg.compressed:
            raise KvcalibError(f"--schedule {self.schedule} moves quantized tokens to fewer bits as they age, but "
                               f"--bits {self.bits} keeps K and V in full precision: pass --bits k8v8, k4v4, ...")
        try:
            if self.schedule == "new-heavy":
                sched = Schedule((Tier(0, cfg.k_bits, cfg.v_bits),), cfg.sinks)
            else:
                sched = Schedule.from_layer(cfg, self.schedule_ages)
        except ValueError as err:
            raise KvcalibError(f"--schedule {self.schedule}: {err}.") from None
        sched.check_layer(cfg)  # first quantized tier == --bits / --window, sinks == --sinks
        return sched


def export_recipe(run_dir: Path, out: Path, config: ExportConfig, *, force: bool = False) -> Recipe:
    """Fit ``config.methods`` on ``run_dir``'s statistics and write the recipe to ``out`` atomically."""
    from kvcalib import __version__
    from kvcalib.calibrate import fit_stats
    from kvcalib.stats import CollectedStats

    out = Path(out)
    if out.exists() and not force:
        raise KvcalibError(f"{out} already exists: pass another -o path, or --force to replace it.")
    stats = CollectedStats.load(Path(run_dir))
    try:
        config.layer.check_head_dim(stats.model.head_dim)
    except ValueError as err:
        raise KvcalibError(f"invalid recipe settings for {stats.model.name}: {err}.") from None
    configs = [config.layer] * stats.model.num_layers
    methods: list = list(config.methods)
    if config.outliers:
        from kvcalib.calibrate.outliers import OutlierMethod

        methods.append(OutlierMethod(pool=config.outliers))
    tensors = fit_stats(stats, configs, methods=methods, seed=config.seed) if methods else {}
    if config.layer_schedule is not None and config.layer.compressed:
        for i in range(len(configs)):
            tensors[f"layers.{i}.kv.schedule"] = config.layer_schedule.to_tensor()  # (N, 3) int64
    run = {}
    run_json = Path(run_dir) / "run.json"
    if run_json.is_file():
        run = json.loads(run_json.read_text()).get("config", {})
    extra = ([f"ott{config.outliers}"] if config.outliers else []) + ([config.schedule] if config.schedule else [])
    name = config.name or "-".join([f"k{config.k_bits}v{config.v_bits}", f"g{config.group}", *config.methods, *extra])
    recipe = Recipe(name=name, layers=configs, model=stats.model, tensors=tensors, provenance={
        "made_by": "kvcalib export", "kvcalib_version": __version__,
        "methods": config.methods + (["outliers"] if config.outliers else []) + (["schedule"] if config.schedule else []),
        "outliers": config.outliers or 0,
        "schedule": None if config.layer_schedule is None else {
            "preset": config.schedule, "ages": list(config.schedule_ages), **config.layer_schedule.to_dict()},
        "data": run.get("data"), "samples": run.get("samples"), "seq_len": run.get("seq_len"),
        "seed": config.seed, "statistics": str(Path(run_dir)),
    })
    if config.huffman:
        from kvcalib.calibrate.codebooks import add_codebooks

        recipe = add_codebooks(recipe, stats)
    recipe.save(out)
    return recipe


def export_search_point(run_dir: Path, out: Path, *, budget_bits: float | None = None, trial: int | None = None,
                        force: bool = False) -> tuple[Recipe, dict]:
    """Pick another point of a finished ``kvcalib search`` (``RUN_DIR/search.json``) without searching:
    the lowest-KL complete trial at or under ``budget_bits``, or trial number ``trial``. Its recipe
    tensors are refitted from ``RUN_DIR``'s statistics exactly as the search fitted them."""
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point, SearchSpace
    from kvcalib.optimize.study import choose
    from kvcalib.stats import CollectedStats

    if (budget_bits is None) == (trial is None):
        raise KvcalibError("pass exactly one of --budget-bits B or --trial N to pick a searched point.")
    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and not force:
        raise KvcalibError(f"{out} already exists: pass another -o path, or --force to replace it.")
    path = run_dir / "search.json"
    if not path.is_file():
        raise KvcalibError(f"{run_dir} holds no search.json: --budget-bits/--trial pick points of a `kvcalib search` run folder.")
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise KvcalibError(f"{path} is not readable JSON ({err}): run the search again with --resume.") from None
    record = choose(doc["trials"], budget_bits, trial)
    space = SearchSpace.from_dict(doc["space"])
    stats = CollectedStats.load(run_dir)
    p = record["point"]
    point = Point.from_dict(p, space)  # old search.json files (no schedule) read as schedule "none"
    import torch

    objective = SearchObjective(None, stats.model, stats, torch.zeros(1, 2, dtype=torch.long),
                                context=int(doc["context"]), seed=int(doc["config"]["seed"]))
    from kvcalib.optimize import search_provenance

    name = f"{stats.model.name}-search-trial{record['number']}"
    recipe = objective.recipe(point, name, provenance=search_provenance(doc, record))
    bits = recipe.memory(stats.model, int(doc["context"])).effective_bits
    if abs(bits - float(record["effective_bits"])) > 1e-6:
        raise KvcalibError(
            f"trial {record['number']} was searched at {record['effective_bits']:.6f} effective bits but its recipe "
            f"rebuilds at {bits:.6f} with this kvcalib (the memory accounting changed since the search): run the "
            "search again (kvcalib search ... --resume keeps the finished trials' settings).")
    recipe.save(out)
    return recipe, record
