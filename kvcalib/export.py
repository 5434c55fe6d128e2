"""``kvcalib export``: a fitted recipe from collected statistics, with methods chosen by flags.

The statistics record the model they came from, so the recipe is fitted for that model (name,
geometry, config hash) and refused for any other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvcalib.errors import KvcalibError
from kvcalib.recipe import LayerConfig, Recipe

EXPORT_METHODS = ("center", "reorder", "clip")  # the methods the runtime applies today
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
    window: int = 128
    sinks: int = 0
    methods: list[str] = field(default_factory=list)
    name: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in EXPORT_METHODS]
        if unknown:
            raise KvcalibError(f"unknown method(s) {unknown}: export supports {', '.join(EXPORT_METHODS)}.")
        self.k_bits, self.v_bits = parse_bits(self.bits)
        try:
            self.layer = LayerConfig(k_bits=self.k_bits, v_bits=self.v_bits, k_group=self.group,
                                     v_group=self.group, window=self.window, sinks=self.sinks)
        except ValueError as err:
            raise KvcalibError(f"invalid recipe settings: {err}.") from None


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
    tensors = fit_stats(stats, configs, methods=config.methods, seed=config.seed) if config.methods else {}
    run = {}
    run_json = Path(run_dir) / "run.json"
    if run_json.is_file():
        run = json.loads(run_json.read_text()).get("config", {})
    name = config.name or "-".join([f"k{config.k_bits}v{config.v_bits}", f"g{config.group}", *config.methods])
    recipe = Recipe(name=name, layers=configs, model=stats.model, tensors=tensors, provenance={
        "made_by": "kvcalib export", "kvcalib_version": __version__, "methods": config.methods,
        "data": run.get("data"), "samples": run.get("samples"), "seq_len": run.get("seq_len"),
        "seed": config.seed, "statistics": str(Path(run_dir)),
    })
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
    point = Point(p["group"], p["window"], p["sinks"], tuple(p["k_bits"]), tuple(p["v_bits"]),
                  tuple(tuple(m) for m in p["methods"]), p.get("k_axis", space.k_axis))
    import torch

    objective = SearchObjective(None, stats.model, stats, torch.zeros(1, 2, dtype=torch.long),
                                context=int(doc["context"]), seed=int(doc["config"]["seed"]))
    from kvcalib.optimize import search_provenance

    name = f"{stats.model.name}-search-trial{record['number']}"
    recipe = objective.recipe(point, name, provenance=search_provenance(doc, record))
    recipe.save(out)
    return recipe, record
