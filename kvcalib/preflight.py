"""Checks that need only the arguments, the files and the recipe, run before any model loads or
any dataset is read (issue 36: a bad input is refused in a second, never after minutes of work).

- output paths (:func:`check_output_file`, :func:`check_output_dir`): the place is a folder we
  can create files in (a real probe file, so a read-only mount or a full inode table shows), and
  it has room for what will be written;
- devices and dtypes (:func:`check_device`, :func:`check_dtype`);
- text sources (:func:`check_data`: the file exists, is of a known kind and holds text in the
  field asked for: an empty, whitespace-only or non-UTF-8 file, or a .jsonl without the
  ``--text-field`` column, is refused here; no network);
- recipes against a model from their metadata (:func:`check_recipe_model`): a recipe fitted for
  another model is refused before that model is fetched, converted or loaded;
- lengths against the model's positions (:func:`check_positions`), and a search budget against
  the floor of its space (:func:`check_search_budget`), from the model's geometry
  (:func:`model_geometry`: its config when on this machine, else what kvcalib pins for an
  embedded model that was never converted).

The commands call one function each (:func:`collect_inputs`, :func:`search_inputs`,
:func:`eval_inputs`, :func:`run_inputs`). Every refusal is one :class:`~kvcalib.errors.KvcalibError`
naming the option and the fix. Nothing here loads weights (a test probes the loader while the
bad-input table runs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvcalib.errors import KvcalibError, RecipeError
from kvcalib.models import model_info_offline  # noqa: F401  (commands and tests call it through here)

if TYPE_CHECKING:  # pragma: no cover
    from kvcalib.models import ModelInfo
    from kvcalib.recipe import Recipe

MIN_FREE_BYTES = 1 << 20  # never start a write with less than this free, whatever it will write
DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (the folder new files will be created under)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    return path


def _probe(folder: Path, option: str, target: Path) -> None:
    """Create and remove a file in ``folder``: the only honest test of a read-only mount (as
    root, ``os.access`` says yes to everything) or of a file system out of inodes."""
    try:
        fd, name = tempfile.mkstemp(prefix=".kvcalib-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise KvcalibError(f"{option} {target}: cannot create files in {folder} ({err.strerror or err}): "
                           "pass a path in a folder you can write.") from None


def _check_room(folder: Path, option: str, target: Path, need_bytes: int) -> None:
    free = shutil.disk_usage(folder).free
    need = max(int(need_bytes), MIN_FREE_BYTES)
    if free < need:
        raise KvcalibError(f"{option} {target}: the disk holding {folder} has {_size(free)} free, and this run "
                           f"writes about {_size(need)}: free some space or pass a path on another disk.")


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def check_output_file(path: Path | str, option: str, need_bytes: int = 0, *, force: bool = True) -> Path:
    """An output file (``-o``, ``--json``): not a folder, not there already unless ``force``, in a
    place where files can be created, with ``need_bytes`` free (at least :data:`MIN_FREE_BYTES`)."""
    path = Path(path)
    if str(path).endswith(os.sep) or path.is_dir():
        raise KvcalibError(f"{option} {path} is a folder: pass a file path (e.g. {path / 'out.json'}).")
    if path.exists() and not force:
        raise KvcalibError(f"{path} already exists: pass another {option} path, or --force to replace it.")
    folder = _nearest_existing(path.parent)
    if not folder.is_dir():
        raise KvcalibError(f"{option} {path}: {folder} is a file, not a folder: pass a path inside a folder.")
    _probe(folder, option, path)
    _check_room(folder, option, path, need_bytes)
    return path


def check_output_dir(path: Path | str, option: str, need_bytes: int = 0, *, may_exist: bool = False) -> Path:
    """A run folder to create (``--out``): new or empty (or, with ``may_exist``, an existing folder
    a command continues), in a place where files can be created, with ``need_bytes`` free."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise KvcalibError(f"{option} {path} is a file: pass a folder path.")
        if not may_exist and any(path.iterdir()):
            raise KvcalibError(f"{option} {path} already exists and is not empty: pass a new folder (run folders "
                               "are never overwritten).")
    folder = _nearest_existing(path)
    if not folder.is_dir():
        raise KvcalibError(f"{option} {path}: {folder} is a file, not a folder: pass a path inside a folder.")
    _probe(folder, option, path)
    _check_room(folder, option, path, need_bytes)
    return path


def check_device(device: str | None, option: str = "--device") -> None:
    """``cpu``, ``cuda`` / ``cuda:N`` where that GPU exists, ``mps`` where available; None = auto."""
    if device is None:
        return
    import torch

    name = device.strip().lower()
    kind, _, index = name.partition(":")
    if kind == "cpu" and not index:
        return
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise KvcalibError(f"{option} {device}: this machine has no usable CUDA device (torch "
                               f"{torch.__version__}): pass {option} cpu, or leave {option} out.")
        count = torch.cuda.device_count()
        if index and (not index.isdigit() or int(index) >= count):
            raise KvcalibError(f"{option} {device}: this machine has CUDA devices 0..{count - 1}: pass "
                               f"{option} cuda:0 (or cuda).")
        return
    if kind == "mps" and not index:
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return
        raise KvcalibError(f"{option} mps: Apple's Metal backend is not available here: pass {option} cpu.")
    raise KvcalibError(f"{option} {device!r} is not a device kvcalib runs on: use cpu or cuda (cuda:N), or leave "
                       f"{option} out (cuda when available, else cpu).")


def check_dtype(dtype: str | None, option: str = "--dtype") -> None:
    if dtype is not None and dtype.strip().lower() not in DTYPES:
        raise KvcalibError(f"{option} {dtype!r} is not known: use bf16, fp16 or fp32 (or leave it out).")


def check_data(data: str, split: str = "calib", text_field: str | None = None) -> None:
    """``--data``: a known source, or a file that exists, is of a readable kind and holds text.

    A local file is read here, with the reader the run uses (so the refusal is the run's own
    line): empty, whitespace-only or non-UTF-8 text, a .jsonl or .parquet file without the
    ``--text-field`` column (or without any default text column) are refused before a model loads.
    Reading it twice costs a fraction of what loading a model does. Hub datasets are not reached."""
    from kvcalib.data import resolve_text_source

    source = resolve_text_source(data, split, text_field)
    if source.kind == "file":
        source.load()


# ------------------------------------------------------------------------------ models offline
# The geometry of each embedded model, for the checks that run before it was ever fetched and
# converted (after that its config.json is read instead; a test checks these against the configs
# where they are on the machine). Only what was read off a converted model's config (or a recipe
# fitted on it) is pinned; what is not known here is left out and checked after the model loads.
EMBEDDED_GEOMETRY: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", "num_layers": 30, "num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64,
                     "max_positions": 8192, "sliding_window": (None,) * 30, "config_hash": "cc1cfbf31f103bfa"},
    "qwen2.5-coder-0.5b": {"model_type": "qwen2", "num_layers": 24, "num_q_heads": 14, "num_kv_heads": 2,
                           "head_dim": 64, "max_positions": 32768, "sliding_window": (None,) * 24,
                           "config_hash": "4453b4f0a8343b50"},
    # from the packages' model cards (docs/ASSETS): layers, heads and head_dim only
    "gemma3-270m": {"num_layers": 18, "num_q_heads": 4, "num_kv_heads": 1, "head_dim": 256},
    "qwen2.5-coder-1.5b": {"num_layers": 28, "num_q_heads": 12, "num_kv_heads": 2, "head_dim": 128},
}
_GEOMETRY_KEYS = ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "max_positions",
                  "sliding_window", "config_hash")


def model_geometry(model: str) -> "Mapping[str, Any] | None":
    """What is known of ``--model``'s cache geometry without fetching or loading anything, with
    ``info`` (a :class:`~kvcalib.models.ModelInfo`) where all of it is known: an embedded model's
    pinned geometry where :data:`EMBEDDED_GEOMETRY` has all of it (no config read: importing
    transformers to read one took 2-3 s of the 3 a refusal may take on a loaded 2-core machine),
    else its config when on this machine, else the fields pinned, else None. Lengths and budgets
    are checked against this; a recipe against the config first (:func:`check_recipe_model`: the
    config hash a conversion gives may differ between transformers versions)."""
    pinned = EMBEDDED_GEOMETRY.get(model)
    if pinned is not None and all(key in pinned for key in _GEOMETRY_KEYS):
        from kvcalib.models import ModelInfo, resolve_model_source

        resolve_model_source(model)  # the alias is known (it is: the table holds embedded ones)
        return {"name": model, **pinned, "info": ModelInfo(name=model, **pinned)}
    info = model_info_offline(model)
    if info is not None:
        return {key: getattr(info, key) for key in _GEOMETRY_KEYS} | {"name": info.name, "info": info}
    return None if pinned is None else {"name": model, **pinned}


def _check_against_geometry(recipe: "Recipe", geometry: Mapping[str, Any]) -> None:
    """Refuse ``recipe`` for what is known of a model's geometry, with the words of
    :meth:`~kvcalib.recipe.Recipe.check_model`: a field the recipe records that differs (all but
    the config hash, which only the config on this machine can give), a group that does not divide
    head_dim, sinks + window beyond the positions."""
    from kvcalib.recipe import check_layer_positions

    if recipe.model is not None:
        for key in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads", "model_type", "sliding_window",
                    "max_positions"):
            if key in geometry and getattr(recipe.model, key) != geometry[key]:
                raise RecipeError(
                    f"recipe {recipe.name!r} was fitted for {recipe.model.name} and does not fit this model: "
                    f"model.{key} is {geometry[key]!r}, the recipe expects {getattr(recipe.model, key)!r}. Fit a "
                    "recipe for this model (kvcalib collect + export/search) or use a preset.")
    configs = recipe.layers if recipe.layers is not None else [recipe.default_layer]
    where = "layers[{}]" if recipe.layers is not None else "default_layer"
    for i, cfg in enumerate(configs):
        if "head_dim" in geometry:
            try:
                cfg.check_head_dim(geometry["head_dim"])  # type: ignore[union-attr]
            except ValueError as err:
                raise RecipeError(f"recipe {recipe.name!r} does not fit {geometry['name']}: {err}") from None
        check_layer_positions(cfg, geometry.get("max_positions", 0), geometry["name"],  # type: ignore[arg-type]
                              f"recipe {recipe.name!r}: field {where.format(i)}")


def check_recipe_model(recipe: "Recipe", model: str | None, option: str = "--model") -> "ModelInfo | None":
    """Refuse ``recipe`` for ``model`` (None: the recipe's own model) before anything is fetched or
    loaded: against what is known of the model's geometry (:func:`model_geometry`: a recipe whose
    header names gemma3-270m over SmolLM2's 30 layers is refused before gemma3-270m is converted;
    a preset needs nothing more), then a fitted recipe against the model's config when it is on
    this machine (its hash: :meth:`~kvcalib.recipe.Recipe.check_model`), else by name (a recipe
    that records another model than the one named). Returns the model's geometry when known."""
    if model is None:
        if recipe.model is None:
            return None
        model = recipe.model.name
    geometry = model_geometry(model)
    if geometry is not None:
        _check_against_geometry(recipe, geometry)
    known = None if geometry is None else geometry.get("info")
    if recipe.model is None:
        return known
    info = model_info_offline(model)  # transformers reads the config (2-3 s): only for a fitted recipe
    if info is not None:
        recipe.check_model(info)
        return info
    if model != recipe.model.name:
        raise RecipeError(f"recipe {recipe.name!r} was fitted for {recipe.model.name}, and {option} {model} is "
                          f"another model (its config is not on this machine, so nothing was fetched to compare): "
                          f"leave {option} out to run on {recipe.model.name}, or fit a recipe for {model}.")
    return known


def stats_bytes(info: "ModelInfo", reservoir_blocks: int, block_len: int) -> int:
    """Size of a ``stats.safetensors`` for ``info``'s model: per layer the float16 reservoir of
    keys, values and queries, and ten float32 (H, D) moment tensors."""
    per_layer = (reservoir_blocks * block_len * (2 * info.num_kv_heads + info.num_q_heads) * info.head_dim * 2
                 + 10 * info.num_kv_heads * info.head_dim * 4)
    return info.num_layers * per_layer


# ------------------------------------------------------------------------------ lengths and budgets
def check_positions(geometry: "Mapping[str, Any] | None", lengths: Mapping[str, tuple[int, int]]) -> None:
    """Refuse a length over the model's maximum positions, naming the option: ``lengths`` maps an
    option to (its value, the tokens fed beside it), e.g. ``{"--seq-len": (1000000, 0)}``.
    Nothing is checked where the maximum is not known without loading the model (it is checked
    again after the model loads)."""
    limit = (geometry or {}).get("max_positions")
    if not limit:
        return
    for option, (value, extra) in lengths.items():
        if value + extra > limit:
            fed = f" (and {extra} tokens beside it: {value + extra})" if extra else ""
            fix = f"pass {option} {limit - extra} or less" if limit > extra else f"lower {option}"
            raise KvcalibError(f"{option} {value}{fed} is over {geometry['name']}'s maximum of {limit} "  # type: ignore[index]
                               f"positions: {fix}.")


def check_search_budget(config: Any, info: "ModelInfo | None") -> None:
    """``--budget-bits`` against the floor of the search space on ``info``'s geometry (the check
    :func:`kvcalib.optimize.check_budget` runs, with no model: effective bits need the geometry
    alone)."""
    if info is None:
        return
    from kvcalib.optimize import check_budget
    from kvcalib.optimize.study import floor_bits

    counter = bits_counter(config, info)
    check_budget(config, config.space, floor_bits(counter, config.space), counter)


def bits_counter(config: Any, info: "ModelInfo") -> Any:
    """A search objective that only counts effective bits at ``config.context`` on ``info``'s
    geometry (no model, no statistics): the search's floor and budget checks before a model loads."""
    import torch

    from kvcalib.optimize.objective import SearchObjective

    return SearchObjective(None, info, None, torch.zeros(1, 2, dtype=torch.long), context=config.context)


# ------------------------------------------------------------------------------ per command
def collect_inputs(model: str, data: str, split: str, text_field: str | None,
                   seq_len: int) -> "ModelInfo | None":
    """``kvcalib collect``'s text and lengths, before the model loads; returns the model's
    geometry where all of it is known (for the size of the statistics)."""
    check_data(data, split, text_field)
    geometry = model_geometry(model)
    check_positions(geometry, {"--seq-len": (seq_len, 0)})
    return (geometry or {}).get("info")


def search_inputs(config: Any, collects: bool) -> "ModelInfo | None":
    """``kvcalib search``'s text, lengths and budget, before the model loads (``collects``: the
    run folder holds no statistics yet, so ``--seq-len`` windows are collected too); returns the
    model's geometry where all of it is known."""
    check_data(config.data, "calib", config.text_field)
    geometry = model_geometry(config.model)
    lengths = {"--seq-len": (config.seq_len, 0)} if collects or config.score_seq_len is None else {}
    if config.score_seq_len is not None:
        lengths["--score-seq-len"] = (config.score_seq_len, 0)
    if config.eval and config.eval_seq_len is not None:  # (None: the context, resolved once the model's maximum is known)
        lengths["--eval-seq-len"] = (config.eval_seq_len, 0)
    check_positions(geometry, lengths)
    info = (geometry or {}).get("info")
    if info is not None and config.context is None:  # the context follows the model's maximum: known now
        config.resolve_context(info.max_positions)
    check_search_budget(config, info)
    return info


def eval_inputs(config: Any) -> "Mapping[str, Any] | None":
    """``kvcalib eval``'s text and lengths, before the model loads; returns the model's geometry."""
    check_data(config.data, "eval", config.text_field)
    geometry = model_geometry(config.model)
    lengths: dict[str, tuple[int, int]] = {}
    if "ppl" in config.metrics:
        lengths["--ppl-seq-len"] = (config.ppl_seq_len, 0)
    if "agreement" in config.metrics:  # generated after a prompt of agreement_prompt_len tokens
        lengths["--agreement-tokens"] = (config.agreement_tokens, config.agreement_prompt_len)
    if "passkey" in config.metrics:  # the answer's tokens are generated after the longest context
        lengths["--passkey-lengths"] = (max(config.passkey_lengths), config.passkey_new_tokens)
    check_positions(geometry, lengths)
    return geometry


def run_inputs(model: str, max_new_tokens: int) -> None:
    """``kvcalib run``'s lengths, before the model loads (the recipe: :func:`check_recipe_model`)."""
    check_positions(model_geometry(model), {"--max-new-tokens": (max_new_tokens, 0)})
