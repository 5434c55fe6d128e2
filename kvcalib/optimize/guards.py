"""Guards that keep a study meaningful and never stuck (issue 36).

- :func:`objective_record` / :func:`check_same_objective`: a study records the options that
  define its objective (what is scored and how: model, text, scoring length and count, seed,
  statistics, context, budget, copy weight, rotation kind); a resume, or a worker joining the
  study, with another value is refused naming the option, so trials scored at 128 and at 256
  tokens never sit side by side.
- :func:`check_study_before_work`: the same check, and "is there a study to resume", before any
  model loads (it reads the storage only).
- :func:`check_quantized_scoring`: a scoring length under which some point of the space never
  quantizes a scored token is refused, naming the length that works: such a point scores as
  lossless (KL 0) at any bits, and a space where no point quantizes scores every trial the same.
- :func:`check_stats_before_work`: statistics already in the run folder are finite and
  self-consistent before any model loads (a NaN would otherwise surface in the first trial).
- :func:`presets_for`: the presets the search compares against, less those that do not fit the
  model (a group that does not divide its head_dim), found before the search rather than after it.
- :func:`storage_lost`: after a failure nobody named, whether the study's storage went away
  under the search (an environment fault, one line) rather than a bug (a traceback).
- :func:`forget_failed_study`: a study file this run created and in which no trial finished is
  removed when the run fails, so the folder is never stuck between "drop --resume" (a study is
  there) and "pass --resume" (nothing to resume).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from kvcalib.errors import KvcalibError
from kvcalib.optimize.space import SearchSpace, SpaceError

if TYPE_CHECKING:  # pragma: no cover
    from kvcalib.optimize import SearchConfig

log = logging.getLogger(__name__)

ATTR_OBJECTIVE = "objective"  # study user attr: objective_record() of the run that created it
# SearchConfig field -> the `kvcalib search` option that sets it (the fields that define the objective)
OBJECTIVE_OPTIONS = {
    "model": "--model", "data": "--data", "text_field": "--text-field", "samples": "--samples",
    "seq_len": "--seq-len", "score_samples": "--score-samples", "seed": "--seed", "context": "--context",
    "budget_bits": "--budget-bits", "copy_weight": "--copy-weight", "rotate": "--rotate",
}
# a field a study recorded before it existed -> the value that study was scored with
RECORDED_BEFORE = {"copy_weight": 0.0,  # no copy windows before issue 53
                   "rotate": "hadamard"}  # every rotation a Hadamard one before --rotate (ROTATE_DEFAULT)


def objective_record(config: "SearchConfig") -> dict[str, Any]:
    """The options that define a study's objective, as recorded in it."""
    return {name: getattr(config, name) for name in OBJECTIVE_OPTIONS}


def check_same_objective(recorded: Any, config: "SearchConfig", where: str) -> None:
    """Refuse ``config`` for a study recorded with another objective, naming the first option that
    differs and the value that continues the study. A study made before the record existed
    (``recorded`` None) is not checked."""
    if not isinstance(recorded, dict):
        return
    for name, option in OBJECTIVE_OPTIONS.items():
        if name not in recorded and name not in RECORDED_BEFORE:
            continue
        was, now = recorded.get(name, RECORDED_BEFORE.get(name)), getattr(config, name)
        if name in ("context", "copy_weight") and now is None:  # resolved when the model loads; record_objective checks it then
            continue
        if was != now and not (isinstance(was, (int, float)) and isinstance(now, (int, float))
                               and math.isclose(was, now, rel_tol=1e-12)):
            shown = "(not given)" if was is None else was
            why = ("the budget is the constraint every trial was judged against" if name == "budget_bits" else
                   "trials scored under two objectives are not comparable")
            raise KvcalibError(
                f"{option} {now} differs from the study in {where}, made with {option} {shown}: {why}. Pass "
                f"{option} {shown} to continue it, or start a new study (another --out, or another --study name).")


def record_objective(study: Any, config: "SearchConfig", where: str) -> None:
    """Record ``config``'s objective in a new study, or refuse ``config`` for an existing study
    (one with trials or a record) made with another objective (:func:`check_same_objective`)."""
    recorded = study.user_attrs.get(ATTR_OBJECTIVE)
    if recorded is None and not study.trials:
        study.set_user_attr(ATTR_OBJECTIVE, objective_record(config))
        return
    check_same_objective(recorded, config, where)


def _default_db(config: "SearchConfig") -> Path:
    return Path(config.out) / "study.db"


def check_study_before_work(config: "SearchConfig") -> None:
    """Before any model loads: a ``--resume`` has a study to resume, and an existing study (resumed,
    or joined by a worker through a shared storage) has the objective of ``config``."""
    if config.storage is None:
        db = _default_db(config)
        if not db.is_file():
            if config.resume:
                raise KvcalibError(f"nothing to resume in {config.out}: it holds statistics but no study yet (the "
                                   "search stopped before its first trial): run the same command without --resume, "
                                   "which starts the study from these statistics.")
            return
        if not config.resume:
            raise KvcalibError(f"{config.out} already holds a study (study.db): pass --resume to continue it, or "
                               "another --out.")
        url = f"sqlite:///{db.resolve()}"
    else:
        url = config.storage
    from kvcalib.optimize.study import probed_storage

    with probed_storage(url) as storage:
        studies = {s.study_name: s for s in storage.get_all_studies()}
    if config.study not in studies:
        if config.resume:
            raise KvcalibError(f"no study {config.study!r} in {url} to resume: drop --resume to start it, or pass "
                               "the --study name the search was started with.")
        return
    check_same_objective(studies[config.study].user_attrs.get(ATTR_OBJECTIVE), config,
                         str(config.out) if config.storage is None else url)


def min_quantized_length(space: SearchSpace) -> int:
    """The shortest scoring sequence in which every (group, window, sinks) of ``space`` quantizes
    at least one block that a scored query sees: query ``i`` sees the blocks flushed after ``i``
    cached tokens (:func:`kvcalib.layout.quantized_token_count`), so the last query of a
    ``T``-token sequence sees one once ``T - 1 - sinks - window >= block``."""
    block = max(space.groups) if space.k_axis == "channel" else 1  # keys per channel flush whole key groups
    return max(space.sinks) + max(space.windows) + block + 1


def check_quantized_scoring(space: SearchSpace, seq_len: int, option: str = "--seq-len") -> None:
    """Refuse scoring sequences too short for every point of ``space`` to quantize a scored token."""
    need = min_quantized_length(space)
    if seq_len >= need:
        return
    block = max(space.groups) if space.k_axis == "channel" else 1
    none = min(space.sinks) + min(space.windows) + (min(space.groups) if space.k_axis == "channel" else 1) + 1 > seq_len
    what = ("no point of the search space quantizes a single scored token, so every trial scores the same and the "
            "search would pick the cheapest point" if none else
            "the points with the largest window, sinks and group quantize no scored token, so they score as lossless "
            "(KL 0) at any bits")
    raise SpaceError(
        f"{option} {seq_len} is too short: {what}. Tokens reach the quantized cache only after the sinks "
        f"({max(space.sinks)}), the full-precision window ({max(space.windows)}) and one group ({block}): pass "
        f"{option} {need} or more (several times that scores more quantized tokens), or search smaller windows.")


def forget_failed_study(db: Path) -> None:
    """Remove a study file (and SQLite's side files) that a failed start created."""
    for path in (db, db.with_name(db.name + "-journal"), db.with_name(db.name + "-wal"),
                 db.with_name(db.name + "-shm")):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def no_empty_study(config: "SearchConfig") -> Iterator[None]:
    """Around a search into ``config.out``'s own study file: when it fails (not Ctrl-C, which leaves
    a resumable study) and the file is new and readably holds no finished trial, remove it."""
    db = _default_db(config)
    created = config.storage is None and not db.exists()
    try:
        yield
    except Exception:
        if created and db.exists() and not _finished_trials(db, config.study):
            forget_failed_study(db)
        raise


def _finished_trials(db: Path, name: str) -> bool:
    """Whether study ``name`` in SQLite file ``db`` holds a complete or pruned trial. True when it
    cannot be read: a file that may be unreadable only for now is never removed."""
    try:
        import optuna

        from kvcalib.optimize.study import finished_count, probed_storage

        with probed_storage(f"sqlite:///{db.resolve()}") as storage:
            return finished_count(optuna.load_study(study_name=name, storage=storage)) > 0
    except Exception:  # noqa: BLE001
        return True


def presets_for(names: tuple[str, ...], info: Any) -> tuple[str, ...]:
    """The presets of ``names`` that fit ``info``'s model; each one left out is logged with why."""
    from kvcalib.errors import RecipeError
    from kvcalib.recipe import load_preset

    keep = []
    for name in names:
        try:
            load_preset(name).check_model(info)
        except RecipeError as err:
            log.warning("preset %s is left out of the comparison: %s", name, err)
            continue
        keep.append(name)
    return tuple(keep)


def check_stats_before_work(run_dir: Path) -> None:
    """Refuse a run folder whose ``stats.safetensors`` holds NaN/inf or mismatched shapes, naming
    the layer (nothing to check when the folder has no statistics yet)."""
    from kvcalib.methods.base import CalibrationError, validate_layer_stats
    from kvcalib.stats import CollectedStats

    if not (Path(run_dir) / "stats.safetensors").is_file():
        return
    stats = CollectedStats.load(run_dir)
    for i, layer in enumerate(stats.layers):
        try:
            validate_layer_stats(layer, stats.model.num_kv_heads, stats.model.head_dim,
                                 need_reservoir=stats.filled_blocks > 0)
        except CalibrationError as err:
            raise KvcalibError(f"the statistics in {run_dir} cannot be searched (layer {i}: {err}): collect them "
                               "again into a new --out.") from None


def storage_lost(config: "SearchConfig") -> str | None:
    """After a search failed with an error nobody named: one line when its study storage no longer
    holds the study (moved, deleted or rewritten while the search ran: Optuna then fails with
    errors such as "Cannot tell a WAITING trial"), else None (the storage is intact: a bug)."""
    from kvcalib.optimize.study import probed_storage, storage_url

    url = storage_url(config.storage, Path(config.out))
    path = None
    if url.startswith("journal:") or url.endswith((".log", ".journal")):
        path = Path(url[len("journal:"):] if url.startswith("journal:") else url)
    elif url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
    if path is not None and not path.is_file():
        return f"the study storage {path} disappeared while the search ran: restore it"
    try:
        with probed_storage(url) as storage:
            names = {s.study_name for s in storage.get_all_studies()}
    except Exception as err:  # noqa: BLE001  (whatever the backend raises: it cannot be read)
        return f"the study storage {url} cannot be read any more ({type(err).__name__}): restore it"
    if config.study not in names:
        return f"the study storage {url} no longer holds study {config.study!r} (it was replaced while the search ran): restore it"
    return None
