"""``kvcalib export``: its three jobs, one function each, all from a run folder's statistics.

- :func:`export_recipe`: a fitted recipe, with methods chosen by flags (:class:`ExportConfig`);
- :func:`export_search_point`: the recipe of another point of a finished ``kvcalib search``
  (``--budget-bits`` / ``--trial``), refitted as the search fitted it;
- :func:`export_fp8_scales`: FP8 ``k_scale`` / ``v_scale`` for vLLM / SGLang
  (``--format compressed-tensors``, :mod:`kvcalib.serving`).

Each checks its inputs and its output path first (one clear line, nothing written), so the
command only picks the job. The statistics record the model they came from, so a recipe is fitted
for that model (name, geometry, config hash) and refused for any other.

Methods come from the registry (:mod:`kvcalib.methods`): each declares its ``kvcalib export``
flags and how their values configure it (:meth:`~kvcalib.methods.base.Method.from_flags`); a
method may also fix the window and sinks its structure needs (a PATS preset keeps 4 sinks, or
none; :meth:`~kvcalib.methods.base.Method.export_layer`). The switches today: ``--center`` (TaDA),
``--reorder`` / ``--clip`` (SKVQ), ``--outliers N`` (OTT: a pool of N tokens on the layers where
tracing them cuts the key error by >= 5 %), ``--schedule PRESET [--schedule-ages A,B]`` (PATS
tiers), ``--huffman`` (KVComp codebooks; a whole-recipe step after every layer is fitted).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig
from kvcalib.methods import Method, registry
from kvcalib.recipe import Recipe

DEFAULT_WINDOW = 128
_BITS = re.compile(r"^k(2|3|4|8|16)v(2|3|4|8|16)$")


def parse_bits(spec: str) -> tuple[int, int]:
    """``"k2v4"`` -> (2, 4)."""
    match = _BITS.match(spec.strip().lower())
    if not match:
        raise KvcalibError(f"--bits {spec!r} is not of the form k<bits>v<bits> with bits in 2, 3, 4, 8, 16 (e.g. k2v2, k4v2, k3v3).")
    return int(match.group(1)), int(match.group(2))


def method_flags() -> dict[str, tuple[str, Any]]:
    """Every export flag of every registered method: flag name -> (method name, Flag)."""
    return {flag.name: (name, flag) for name, method in registry().items() for flag in method.flags}


class ExportConfig:
    """What ``kvcalib export`` builds (validated on construction).

    ``methods``: names of methods switched on by a plain boolean flag (``["reorder", "clip"]``);
    ``**flags``: any method flag by name (``outliers=3``, ``schedule="middle-heavy"``,
    ``schedule_ages=(1024, 4096)``, ``huffman=True``). ``window``/``sinks`` None: the default
    (128 / 0), or what a method's structure needs.
    """

    def __init__(self, bits: str = "k2v2", group: int = 32, window: int | None = None, sinks: int | None = None,
                 methods: list[str] | None = None, name: str | None = None, seed: int = 0, **flags: Any) -> None:
        known = method_flags()
        unknown = sorted(set(flags) - set(known))
        if unknown:
            raise KvcalibError(f"unknown export option(s) {unknown}: methods take {', '.join(sorted(known))}.")
        values: dict[str, Any] = {name_: None for name_ in known}
        values.update(flags)
        for m in methods or []:
            flag = known.get(m)
            if flag is None or flag[1].kind is not bool:
                switches = sorted(f for f, (_, fl) in known.items() if fl.kind is bool)
                raise KvcalibError(f"unknown method(s) {[m]}: export switches {', '.join(switches)} on by name; "
                                   f"the others take a value ({', '.join(sorted(set(known) - set(switches)))}).")
            values[m] = True
        self.bits, self.group, self.name, self.seed = bits, group, name, seed
        self.k_bits, self.v_bits = parse_bits(bits)
        self.values = values
        for method in registry().values():
            window, sinks = method.export_layer(values, window, sinks)
        self.window = DEFAULT_WINDOW if window is None else window
        self.sinks = 0 if sinks is None else sinks
        try:
            self.layer = LayerConfig(k_bits=self.k_bits, v_bits=self.v_bits, k_group=group, v_group=group,
                                     window=self.window, sinks=self.sinks)
        except (ValueError, TypeError) as err:
            raise KvcalibError(f"invalid recipe settings: {err}.") from None
        self.fitted: list[Method] = []  # configured methods, pipeline order
        for method in registry().values():
            inst = method.from_flags(values, self.layer)
            if inst is not None:
                self.fitted.append(inst)

    @property
    def methods(self) -> list[str]:
        """Names of the methods this export fits, pipeline order."""
        return [m.name for m in self.fitted]

    def method(self, name: str) -> Method | None:
        """The configured method ``name``, or None when its flags leave it off."""
        return next((m for m in self.fitted if m.name == name), None)

    def recipe_name(self) -> str:
        """``k2v2-g32-clip-ott3-middle-heavy``-style name: bits, group, then each flag given."""
        parts = [f"k{self.k_bits}v{self.v_bits}", f"g{self.group}"]
        for flag, (_, spec) in method_flags().items():
            tag = spec.name_tag(self.values.get(flag))
            if tag:
                parts.append(tag)
        return "-".join(parts)


def check_run_dir(run_dir: Path) -> None:
    """``kvcalib export``'s RUN_DIR: a folder that holds statistics."""
    if run_dir.exists() and not run_dir.is_dir():
        raise KvcalibError(f"{run_dir} is a file, not a run folder: pass a folder written by `kvcalib collect` or "
                           "`kvcalib search` (it holds stats.safetensors).")
    if not run_dir.is_dir():
        raise KvcalibError(f"run folder {run_dir} does not exist: pass a folder written by `kvcalib collect` or "
                           "`kvcalib search`.")
    if not (run_dir / "stats.safetensors").is_file():
        raise KvcalibError(f"{run_dir} holds no stats.safetensors: pass a folder written by `kvcalib collect` or "
                           "`kvcalib search`.")


def _check_inputs(run_dir: Path, out: Path, force: bool) -> None:
    """A run folder with statistics and a recipe file that may be written (``-o``)."""
    from kvcalib import preflight

    check_run_dir(run_dir)
    preflight.check_output_file(out, "-o", force=force)


def export_recipe(run_dir: Path, out: Path, config: ExportConfig, *, force: bool = False) -> Recipe:
    """Fit ``config``'s methods on ``run_dir``'s statistics and write the recipe to ``out`` atomically."""
    from kvcalib import __version__
    from kvcalib.calibrate import finish_recipe, fit_stats
    from kvcalib.stats import CollectedStats

    run_dir, out = Path(run_dir), Path(out)
    _check_inputs(run_dir, out, force)
    stats = CollectedStats.load(Path(run_dir))
    try:
        config.layer.check_head_dim(stats.model.head_dim)
    except ValueError as err:
        raise KvcalibError(f"invalid recipe settings for {stats.model.name}: {err}.") from None
    configs = [config.layer] * stats.model.num_layers
    tensors = fit_stats(stats, configs, methods=config.fitted, seed=config.seed) if config.fitted else {}
    run = {}
    run_json = Path(run_dir) / "run.json"
    if run_json.is_file():
        run = json.loads(run_json.read_text()).get("config", {})
    provenance: dict[str, Any] = {
        "made_by": "kvcalib export", "kvcalib_version": __version__,
        "methods": config.methods,
        "method_config": {m.name: m.config() for m in config.fitted},
        "data": run.get("data"), "samples": run.get("samples"), "seq_len": run.get("seq_len"),
        "seed": config.seed, "statistics": str(Path(run_dir)),
    }
    provenance.update({flag: val for flag, val in config.values.items()
                       if val is not None and not isinstance(val, bool)})
    recipe = Recipe(name=config.name or config.recipe_name(), layers=configs, model=stats.model, tensors=tensors,
                    provenance=provenance)
    recipe = finish_recipe(recipe, stats, config.fitted)
    recipe.save(out)
    return recipe


def export_search_point(run_dir: Path, out: Path, *, budget_bits: float | None = None, trial: int | None = None,
                        methods: Sequence[str] = (), force: bool = False,
                        rotate: str | None = None) -> tuple[Recipe, dict]:
    """Pick another point of a finished ``kvcalib search`` (``RUN_DIR/search.json``) without searching:
    the lowest-KL complete trial at or under ``budget_bits``, or trial number ``trial``. Its recipe
    tensors are refitted from ``RUN_DIR``'s statistics exactly as the search fitted them.
    ``methods``: the method flags given with it (refused: a searched point's settings are fixed).

    The point's rotations are fitted as the search fitted them: the kind its ``search.json`` records
    (``kvcalib search --rotate KIND``; Hadamard before the flag, :func:`searched_rotation`).
    ``rotate``: the layers the point rotates are refitted with this rotation kind instead (e.g.
    ``learned`` rotations on a Hadamard search's layout). A kind other than the searched one may add
    bytes the search did not count, so with ``budget_bits`` the point is then the lowest-KL trial
    whose searched bits plus the most the refitted rotations can store (:func:`_with_refit_bits`:
    the search objective's planned side bytes) stay at or under the budget; the recipe records the
    refit (``rotate_refit``) and is not checked against the searched bits.

    ``budget_bits`` is in today's accounting (``kvcalib.layout.ACCOUNTING``); a ``search.json``
    written before it (every layer counted at the full context) is read converted
    (:func:`kvcalib.optimize.current_accounting`), so the same budget means the same memory."""
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point, SearchSpace
    from kvcalib.optimize.study import choose
    from kvcalib.stats import CollectedStats

    if methods:
        flags = ", ".join("--" + m.replace("_", "-") for m in methods)
        raise KvcalibError(f"{flags} build a recipe from statistics; --budget-bits/--trial pick a searched point "
                           "whose settings are fixed (only --rotate may refit its rotations): pass one kind or "
                           "the other.")
    from kvcalib.optimize.objective import rotation_overrides

    rotation_overrides(rotate)  # a bad kind refused first (the rotate method's flag parser names the kinds)
    if (budget_bits is None) == (trial is None):
        raise KvcalibError("pass exactly one of --budget-bits B or --trial N to pick a searched point.")
    run_dir, out = Path(run_dir), Path(out)
    _check_inputs(run_dir, out, force)
    doc = read_search_json(run_dir)
    from kvcalib.optimize import current_accounting, search_provenance

    stats = CollectedStats.load(run_dir)
    doc = current_accounting(doc, stats.model.sliding_window)
    space = SearchSpace.from_dict(doc["space"])
    import torch

    searched = searched_rotation(doc, run_dir)
    objective = SearchObjective(None, stats.model, stats, torch.zeros(1, 2, dtype=torch.long),
                                context=int(doc["context"]), seed=int(doc["config"]["seed"]),
                                method_overrides=rotation_overrides(rotate or searched))
    candidates = doc["trials"]
    if budget_bits is not None and rotate not in (None, searched):  # room for what the refit may store
        candidates = [_with_refit_bits(r, space, objective, {"rotate"}) for r in candidates]
    record = choose(candidates, budget_bits, trial)
    try:
        point = Point.from_dict(record["point"], space)  # old search.json files (no schedule) read as schedule "none"
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise KvcalibError(f"{run_dir / 'search.json'}: trial {record['number']}'s point is malformed "
                           f"({type(err).__name__}: {err}): pick another trial, or rerun the search.") from None
    name = f"{stats.model.name}-search-trial{record['number']}" + ("" if rotate is None else f"-rot-{rotate}")
    if len(point.k_bits) != stats.model.num_layers:
        raise KvcalibError(f"{run_dir / 'search.json'}: trial {record['number']} sets {len(point.k_bits)} layers, the "
                           f"statistics in {run_dir} are of {stats.model.num_layers}: the file belongs to another run.")
    try:
        recipe = objective.recipe(point, name, provenance=search_provenance(doc, record))
    except KvcalibError:
        raise
    except (KeyError, TypeError, ValueError) as err:  # a point no layer config takes (bits 3, ...)
        raise KvcalibError(f"{run_dir / 'search.json'}: trial {record['number']}'s point is malformed "
                           f"({type(err).__name__}: {err}): pick another trial, or rerun the search.") from None
    bits = recipe.memory(stats.model, int(doc["context"])).effective_bits
    if rotate is not None:
        recipe.provenance["rotate_refit"] = rotate  # the search scored its own rotations, not these
        recipe.save(out)
        return recipe, {**record, "effective_bits": bits, "searched_bits": record["effective_bits"]}
    if abs(bits - float(record["effective_bits"])) > 1e-6:
        raise KvcalibError(
            f"trial {record['number']} was searched at {record['effective_bits']:.6f} effective bits but its recipe "
            f"rebuilds at {bits:.6f} from {run_dir}: its statistics are not the ones the search fitted (a fit that "
            "keeps a rotation or not changes a few bytes), or the memory accounting changed since the search. Fix: "
            "export from the search's own run folder, refit deliberately with --rotate hadamard, or run the search "
            "again (kvcalib search ... --resume keeps the finished trials' settings).")
    recipe.save(out)
    return recipe, record


def searched_rotation(doc: dict[str, Any], run_dir: Path) -> str:
    """The rotation kind a search's rotate switch fitted (``config.rotate`` of its ``search.json``;
    a search before ``--rotate``: the default, Hadamard)."""
    from kvcalib.optimize import ROTATE_DEFAULT
    from kvcalib.optimize.objective import rotation_overrides

    kind = doc["config"].get("rotate", ROTATE_DEFAULT)
    try:
        rotation_overrides(kind)  # through the registry (the rotate method's flag parser knows the kinds)
    except KvcalibError as err:
        raise KvcalibError(f"{Path(run_dir) / 'search.json'}: field config.rotate is {kind!r} ({err}) Restore the "
                           "file, or rerun the search with --resume (it rewrites search.json from the study).") from None
    return kind


def _with_refit_bits(record: dict, space: Any, objective: Any, refit: set[str]) -> dict:
    """A trial record whose ``effective_bits`` include the most the methods ``refit`` (fitted
    otherwise than the search did, as ``objective``'s ``method_overrides`` configure them:
    ``--rotate learned`` of a Hadamard search) can store at the record's point
    (:meth:`~kvcalib.optimize.objective.SearchObjective.planned_side_bytes`), for choosing a point
    under a budget; others unchanged.

    Added to the searched bits, not put in place of the search's own tensors: a side the search's
    fit left unrotated may hold a matrix after the refit, so only the sum is an upper bound (the
    refit keeps a Hadamard seed only where the search's fit kept the same seed)."""
    from kvcalib.optimize.space import Point

    if not refit or record.get("state") != "COMPLETE" or record.get("point") is None:
        return record
    try:
        point = Point.from_dict(record["point"], space)
    except (KeyError, TypeError, ValueError, AttributeError):
        return record  # the chosen one is checked again, with its own message
    info = objective.info
    elements = Recipe(name="p", layers=point.layer_configs(), model=info).memory(info, objective.context).elements
    extra = 8.0 * objective.planned_side_bytes(point, only=refit) / elements
    return {**record, "effective_bits": record["effective_bits"] + extra}


def export_fp8_scales(run_dir: Path, out: Path, *, bits: str | None = None, methods: Sequence[str] = (),
                      searched_point: bool = False, model: str | None = None, per_head: bool = False,
                      force: bool = False) -> Path:
    """``--format compressed-tensors``: FP8 ``k_scale`` / ``v_scale`` of ``run_dir``'s statistics in
    the folder ``out``, for vLLM / SGLang (:func:`kvcalib.serving.export_compressed_tensors`).
    What that layout cannot hold is refused first: sub-8-bit ``bits``, method flags
    (``methods``), a searched point. Returns the folder written."""
    from kvcalib import preflight
    from kvcalib.serving import export_compressed_tensors

    run_dir, out = Path(run_dir), Path(out)
    if (bits is not None and min(parse_bits(bits)) < 8) or methods or searched_point:
        raise KvcalibError(
            f"--bits {bits} and recipe methods cannot be expressed in the FP8 compressed-tensors layout "
            "(vLLM/SGLang hold FP8 K/V with per-tensor or per-head scales only): export the FP8 scales from "
            f"the statistics with `kvcalib export {run_dir} --format compressed-tensors -o DIR`, and run "
            "sub-8-bit recipes with the kvcalib runtime.")
    check_run_dir(run_dir)
    preflight.check_output_dir(out, "-o", may_exist=True)
    written = export_compressed_tensors(run_dir, out, model=model, per_head=per_head, force=force)
    return out if written is None else written


# what export and the provenance of an exported point read from search.json: key -> accepted types
_SEARCH_FIELDS: dict[str, tuple[type, ...]] = {
    "trials": (list,), "space": (dict,), "config": (dict,), "context": (int,), "budget_bits": (int, float),
    "score_sequences": (int,), "score_seq_len": (int,), "study": (str,),
}
_TRIAL_FIELDS: dict[str, tuple[type, ...]] = {
    "number": (int,), "state": (str,), "kl": (int, float, type(None)), "effective_bits": (int, float, type(None)),
    "point": (dict, type(None)),
}


def read_search_json(run_dir: Path) -> dict[str, Any]:
    """``RUN_DIR/search.json`` with every field export reads present and of its type (a
    :class:`KvcalibError` naming the first that is not), so a malformed file is refused in one
    line instead of failing with a KeyError half-way."""
    path = Path(run_dir) / "search.json"
    if not path.is_file():
        raise KvcalibError(f"{run_dir} holds no search.json: --budget-bits/--trial pick points of a `kvcalib search` run folder.")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KvcalibError(f"{path} is not readable JSON ({err}): restore it, or rerun the search with --resume "
                           "(it rewrites search.json from the study).") from None
    fix = "restore the file, or rerun the search with --resume (it rewrites search.json from the study)"
    if not isinstance(doc, dict):
        raise KvcalibError(f"{path} is not a search record (a JSON object): {fix}.")
    for key, kinds in _SEARCH_FIELDS.items():
        if not isinstance(doc.get(key), kinds) or isinstance(doc.get(key), bool):
            raise KvcalibError(f"{path}: field {key} is {'missing' if key not in doc else repr(doc[key])[:60]}, "
                               f"expected {' or '.join(k.__name__ for k in kinds)}: {fix}.")
    if doc["context"] < 1:
        raise KvcalibError(f"{path}: field context is {doc['context']}, expected a positive number of tokens: {fix}.")
    cfg = doc["config"]
    if not isinstance(cfg.get("seed"), int) or "data" not in cfg:
        raise KvcalibError(f"{path}: field config lacks seed or data: {fix}.")
    for i, trial in enumerate(doc["trials"]):
        if not isinstance(trial, dict):
            raise KvcalibError(f"{path}: trials[{i}] is not an object: {fix}.")
        for key, kinds in _TRIAL_FIELDS.items():
            value = trial.get(key, KeyError)
            if value is KeyError or not isinstance(value, kinds) or isinstance(value, bool):
                raise KvcalibError(f"{path}: trials[{i}].{key} is {'missing' if value is KeyError else repr(value)[:60]}, "
                                   f"expected {' or '.join(k.__name__ for k in kinds)}: {fix}.")
    return doc
