"""Checks that need only the arguments, the files and the recipe, run before any model loads or
any dataset is read (issue 36: a bad input is refused in a second, never after minutes of work).

- output paths (:func:`check_output_file`, :func:`check_output_dir`): the place is a folder we
  can create files in (a real probe file, so a read-only mount or a full inode table shows), and
  it has room for what will be written;
- devices and dtypes (:func:`check_device`, :func:`check_dtype`);
- text sources (:func:`check_data`: the file exists and is of a known kind; no network);
- recipes against a model from their metadata (:func:`check_recipe_model`): a recipe fitted for
  another model is refused before that model is fetched, converted or loaded.

Every refusal is one :class:`~kvcalib.errors.KvcalibError` naming the option and the fix. Nothing
here loads weights; torch is imported only by the device check.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvcalib.errors import KvcalibError

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
    """``--data``: a known source, or a file that exists and is of a readable kind (no network)."""
    from kvcalib.data import resolve_text_source

    resolve_text_source(data, split, text_field)


# ------------------------------------------------------------------------------ models offline
def model_info_offline(model: str) -> "ModelInfo | None":
    """``--model``'s geometry from a config already on this machine, or None when learning it
    would fetch something (a hub id not in the cache, an embedded model never converted) or load
    weights (a ``.gguf`` file)."""
    from kvcalib.models import model_info, resolve_model_source
    from kvcalib.paths import home_subdir

    kind, where, _ = resolve_model_source(model)
    if kind == "embedded":
        folder = home_subdir("models") / model / "hf"
        if not (folder / "config.json").is_file():
            return None
        where = str(folder)
    elif kind == "gguf":
        return None
    elif kind == "hub":
        from kvcalib import hub

        if not hub.cached(where):  # nothing to read (and no transformers import to pay for it)
            return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError):
        return None
    return model_info(config, model if kind in ("embedded", "hub") else Path(model).name)  # as load_model names it


def check_recipe_model(recipe: "Recipe", model: str | None, option: str = "--model") -> "ModelInfo | None":
    """Refuse ``recipe`` for ``model`` (None: the recipe's own model) before anything is fetched or
    loaded: against the model's config when it is on this machine, else by name (a recipe that
    records another model than the one named). Returns the model's geometry when known."""
    if model is None:
        if recipe.model is None:
            return None
        model = recipe.model.name
    info = model_info_offline(model)
    if info is not None:
        recipe.check_model(info)
        return info
    if recipe.model is not None and model != recipe.model.name:
        from kvcalib.errors import RecipeError

        raise RecipeError(f"recipe {recipe.name!r} was fitted for {recipe.model.name}, and {option} {model} is "
                          f"another model (its config is not on this machine, so nothing was fetched to compare): "
                          f"leave {option} out to run on {recipe.model.name}, or fit a recipe for {model}.")
    return None


def stats_bytes(info: "ModelInfo", reservoir_blocks: int, block_len: int) -> int:
    """Size of a ``stats.safetensors`` for ``info``'s model: per layer the float16 reservoir of
    keys, values and queries, and ten float32 (H, D) moment tensors."""
    per_layer = (reservoir_blocks * block_len * (2 * info.num_kv_heads + info.num_q_heads) * info.head_dim * 2
                 + 10 * info.num_kv_heads * info.head_dim * 4)
    return info.num_layers * per_layer
