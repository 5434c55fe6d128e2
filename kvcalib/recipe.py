"""Recipe files: one safetensors file that says how every layer's K and V are compressed.

Layout (no pickle)::

    tensors   layers.{i}.{k|v}.{name}   fitted state (permutations, clip scales, codebooks...)
    metadata  "kvcalib_recipe": JSON document
              {
                "format": "kvcalib-recipe", "schema_version": 2,
                "accounting": "held-tokens" (how the effective bits the provenance records
                              were counted: kvcalib.layout.ACCOUNTING),
                "name": str,
                "model": ModelInfo dict or null (null = a model-agnostic preset),
                "layers": [LayerConfig dict, ...] (one per layer), or
                "default_layer": LayerConfig dict (presets: the same config for every layer),
                "provenance": {"data", "samples", "seed", "objective", "kvcalib_version", ...}
              }

Loading validates every field and fails with :class:`RecipeError` naming the field and the value
expected. A fitted recipe is refused for a model whose geometry or config hash differs.

Schema 1 (before issue 38) had no ``accounting`` field: its provenance numbers (``effective_bits``,
``budget_bits``) were counted with :data:`~kvcalib.layout.LEGACY_ACCOUNTING`, and it still loads
with that accounting. ``Recipe.memory`` always counts with the current accounting; ``accounting``
only says what the recorded numbers mean.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from kvcalib.codec import LayerCodec
from kvcalib.errors import KvcalibError, RecipeError
from kvcalib.io import read_safetensors_document
from kvcalib.layout import (ACCOUNTING, ACCOUNTINGS, FP_BITS, LEGACY_ACCOUNTING, SCALE_BYTES, LayerConfig,
                            MemoryBreakdown, held_elements,
                            held_tokens, layer_bytes, quantized_token_count)
from kvcalib.models import ModelInfo

RECIPE_FORMAT = "kvcalib-recipe"
SCHEMA_VERSION = 2
READ_VERSIONS = (1, 2)  # 1: no "accounting" field (read as LEGACY_ACCOUNTING)
METADATA_KEY = "kvcalib_recipe"
# what ``metadata()`` always writes: a document without one of them is refused, not defaulted
REQUIRED_FIELDS = ("format", "schema_version", "name", "model", "provenance")
# ``layers.{i}.{k|v|kv}.{name}``, ``i`` written without leading zeros (so two names never meet
# on one layer) in ASCII digits (``str.isdigit`` also accepts "²", which ``int`` refuses)
TENSOR_NAME = re.compile(r"^layers\.(0|[1-9][0-9]*)\.(k|v|kv)\.([A-Za-z_][A-Za-z0-9_]*)$")


@dataclass
class Recipe:
    """A loaded recipe: per-layer configuration, fitted tensors, model identity, provenance."""

    name: str
    layers: list[LayerConfig] | None = None  # None: a preset with one default_layer for all
    default_layer: LayerConfig | None = None
    model: ModelInfo | None = None  # None: model-agnostic preset
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    # how the effective bits in ``provenance`` were counted (kvcalib.layout.ACCOUNTINGS); a copy of
    # a recipe keeps its provenance, so it keeps this too
    accounting: str = ACCOUNTING

    def __post_init__(self) -> None:
        if (self.layers is None) == (self.default_layer is None):
            raise RecipeError("a recipe needs exactly one of `layers` (fitted) or `default_layer` (preset)")
        if self.accounting not in ACCOUNTINGS:
            raise RecipeError(f"recipe accounting must be one of {ACCOUNTINGS}, got {self.accounting!r}")

    @property
    def is_preset(self) -> bool:
        return self.layers is None

    @property
    def searched_context(self) -> int | None:
        """The context (tokens) this recipe was searched for: the length of the windows its
        search scored (provenance ``searched_context``; a search before that field recorded it as
        ``seq_len``). None for presets and hand-made recipes (:func:`beyond_searched_note`)."""
        value = self.provenance.get("searched_context")
        if value is None and self.provenance.get("made_by") == "kvcalib search":
            value = self.provenance.get("seq_len")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def layer_configs(self, num_layers: int) -> list[LayerConfig]:
        """One LayerConfig per layer of a model with ``num_layers`` layers."""
        if self.layers is None:
            return [self.default_layer] * num_layers  # type: ignore[list-item]
        if len(self.layers) != num_layers:
            raise RecipeError(f"recipe {self.name!r} has {len(self.layers)} layers but the model has {num_layers}")
        return list(self.layers)

    def check_model(self, info: ModelInfo) -> None:
        """Refuse a fitted recipe for another model, naming the mismatching field (every field of
        the model description but its name: an edited sliding window or position limit would
        make the memory accounting describe another cache than the one the runtime builds)."""
        if self.model is not None:  # the model first: "fitted for X" says more than "24 layers, not 30"
            for key in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads", "model_type", "config_hash",
                        "sliding_window", "max_positions"):
                want, got = getattr(self.model, key), getattr(info, key)
                if want != got:
                    raise RecipeError(
                        f"recipe {self.name!r} was fitted for {self.model.name} and does not fit this model: "
                        f"model.{key} is {got!r}, the recipe expects {want!r}. Fit a recipe for this model "
                        "(kvcalib collect + export/search) or use a preset."
                    )
        for i, cfg in enumerate(self.layer_configs(info.num_layers)):
            try:
                cfg.check_head_dim(info.head_dim)
            except ValueError as err:
                raise RecipeError(f"recipe {self.name!r} does not fit {info.name}: {err}") from None
            where = f"layers[{i}]" if self.layers is not None else "default_layer"
            check_layer_positions(cfg, info.max_positions, info.name, f"recipe {self.name!r}: field {where}")

    def validate(self, info: ModelInfo | None = None) -> "Recipe":
        """Check the whole recipe against itself (and ``info``'s model when given, else the model
        it records): every layer config complete and cheaper than bf16, groups that divide
        head_dim, and every tensor against its layer and the method that declares it (each
        method's :meth:`~kvcalib.methods.base.Method.load`: name, side, dtype, shape, values).
        Returns the recipe; raises :class:`RecipeError` naming the field or tensor and the fix.

        A recipe that records no model (a preset) holds no fitted tensors: they are per layer
        and kv head of one model.
        """
        info = info or self.model
        configs = self.layers if self.layers is not None else [self.default_layer]
        for i, cfg in enumerate(configs):  # type: ignore[arg-type]
            where = f"layers[{i}]" if self.layers is not None else "default_layer"
            check_layer_cost(cfg, f"recipe {self.name!r}: field {where}")
            if info is not None:
                try:
                    cfg.check_head_dim(info.head_dim)
                except ValueError as err:
                    raise RecipeError(f"recipe {self.name!r}: field {where}: {err} of {info.name}: use a group that "
                                      f"divides {info.head_dim}") from None
                check_layer_positions(cfg, info.max_positions, info.name, f"recipe {self.name!r}: field {where}")
        if info is None:
            if self.tensors:
                raise RecipeError(f"recipe {self.name!r} records no model but holds fitted tensors "
                                  f"({', '.join(sorted(self.tensors)[:3])}...), which are per layer and kv head of "
                                  "the model they were fitted on: re-export it from that model's statistics")
            return self
        self.codecs(info)
        return self

    # ------------------------------------------------------------------ per-layer fitted state
    def layer_tensors(self, num_layers: int) -> list[dict[str, torch.Tensor]]:
        """The fitted tensors of each layer, unprefixed (``"k.clip"``...). A name that is not
        ``layers.{i}.{k|v|kv}.{name}`` with ``i`` below ``num_layers`` is refused, naming it."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        for name, tensor in self.tensors.items():
            match = TENSOR_NAME.match(name) if isinstance(name, str) else None
            if match is None or int(match.group(1)) >= num_layers:
                raise RecipeError(f"recipe {self.name!r} holds tensor {name!r}, which this kvcalib does not apply "
                                  f"(tensors are layers.<i>.<k|v|kv>.<name> with i < {num_layers}): re-export the "
                                  "recipe with this version")
            out[int(match.group(1))][f"{match.group(2)}.{match.group(3)}"] = tensor
        return out

    def codecs(self, info: ModelInfo | None = None, *, num_layers: int | None = None,
               head_dim: int | None = None) -> list[LayerCodec]:
        """One validated :class:`~kvcalib.codec.LayerCodec` per layer, carrying every method state
        the recipe's tensors give (for ``info``'s model, or ``num_layers``/``head_dim`` alone).
        A tensor that is invalid, of the wrong shape for the layer or of no method is refused with
        a RecipeError naming it."""
        heads = None
        if info is not None:
            num_layers, head_dim, heads = info.num_layers, info.head_dim, info.num_kv_heads
        if num_layers is None:
            raise ValueError("Recipe.codecs needs the model's info or num_layers")
        configs = self.layer_configs(num_layers)
        per_layer = self.layer_tensors(num_layers)
        codecs = []
        for i, (cfg, tensors) in enumerate(zip(configs, per_layer)):
            try:
                codecs.append(LayerCodec.from_tensors(cfg, tensors, heads, head_dim, prefix=f"layers.{i}."))
            except (ValueError, KvcalibError) as err:
                raise RecipeError(f"recipe {self.name!r}: {err}: re-export the recipe") from None
        return codecs

    def memory(self, info: ModelInfo, context: int = 4096) -> MemoryBreakdown:
        """Accounted bytes per sequence at ``context`` (docs/design.md's memory accounting).

        Per layer: :func:`~kvcalib.layout.layer_bytes` over the tokens the layer keeps (a sliding
        layer its window), each packed block at the bits of its stored tier (PATS), plus what
        every method state adds (``MethodState.bytes``: TaDA means, OTT pools and masks...), and
        once per model the tables the runtime shares between layers (``MethodState.shared_bytes``:
        a Walsh-Hadamard matrix); fitted tensors the runtime reads are amortised as ``recipe_state``. The elements are
        those the model's bf16 cache holds (:func:`~kvcalib.layout.held_elements`), so the fp16
        preset is 16.0 bits on every model.
        """
        comps: dict[str, float] = {}
        shared: dict[str, float] = {}  # tables kept once per model (MethodState.shared_bytes), by name
        for i, (cfg, codec) in enumerate(zip(self.layer_configs(info.num_layers), self.codecs(info))):
            window = info.sliding_window[i]
            kept = held_tokens(context, window)
            parts = [layer_bytes(cfg, info.num_kv_heads, info.head_dim, context, window, codec.tiers)]
            packed = quantized_token_count(cfg, kept)
            parts += [state.bytes(cfg, info.num_kv_heads, info.head_dim, kept, packed)
                      for state in codec.states.values()]
            for part in parts:
                for key, val in part.items():
                    comps[key] = comps.get(key, 0.0) + val
            if packed:
                for state in codec.states.values():
                    for key, val in state.shared_bytes(info.head_dim).items():
                        shared[key] = max(shared.get(key, 0.0), val)
        for key, val in shared.items():
            comps[key] = comps.get(key, 0.0) + val
        for name, tensor in self.tensors.items():  # fitted state read at decode time, amortised
            comps["recipe_state"] = comps.get("recipe_state", 0.0) + tensor.numel() * tensor.element_size()
        return MemoryBreakdown(context, held_elements(info.num_kv_heads, info.head_dim, context, info.sliding_window), comps)

    # ------------------------------------------------------------------ file I/O
    def metadata(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": RECIPE_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "accounting": self.accounting,
            "name": self.name,
            "model": self.model.to_dict() if self.model else None,
            "provenance": self.provenance,
        }
        if self.layers is not None:
            doc["layers"] = [c.to_dict() for c in self.layers]
        else:
            doc["default_layer"] = self.default_layer.to_dict()  # type: ignore[union-attr]
        return doc

    def save(self, path: Path) -> None:
        """Write atomically (temporary name, then rename)."""
        from safetensors.torch import save_file

        from kvcalib.io import atomic_path

        path = Path(path)
        tensors = {k: v.contiguous() for k, v in self.tensors.items()}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(self.metadata())})

    @classmethod
    def from_document(cls, doc: Any, tensors: dict[str, torch.Tensor], where: str) -> "Recipe":
        """A validated recipe from its JSON document and tensors (:meth:`validate`); every field
        :meth:`metadata` writes must be there: nothing missing is filled in with a default."""
        if not isinstance(doc, dict):
            raise RecipeError(f"{where}: the recipe document must be a JSON object")
        if doc.get("format") != RECIPE_FORMAT:
            raise RecipeError(f"{where}: field format is {doc.get('format')!r}, expected {RECIPE_FORMAT!r}")
        version = doc.get("schema_version")
        if isinstance(version, bool) or version not in READ_VERSIONS:
            raise RecipeError(
                f"{where}: field schema_version is {version!r}, this kvcalib reads "
                f"{' or '.join(map(str, READ_VERSIONS))}: re-export the recipe with this version"
            )
        allowed = {*REQUIRED_FIELDS, "layers", "default_layer"}
        if version >= 2:
            allowed.add("accounting")
            accounting = doc.get("accounting")
            if accounting not in ACCOUNTINGS:
                raise RecipeError(f"{where}: field accounting is {accounting!r}, expected one of {list(ACCOUNTINGS)}")
        else:
            accounting = LEGACY_ACCOUNTING
        unknown = sorted(map(str, set(doc) - allowed))
        if unknown:
            raise RecipeError(f"{where}: unknown fields {unknown}; allowed: {sorted(allowed)}")
        missing = [key for key in REQUIRED_FIELDS if key not in doc]
        if missing:
            raise RecipeError(f"{where}: field(s) {missing} are missing (a recipe names all of "
                              f"{', '.join(REQUIRED_FIELDS)}; model may be null): re-export the recipe")
        name = doc["name"]
        if not isinstance(name, str) or not name.strip():
            raise RecipeError(f"{where}: field name must be a non-empty string")
        model = None if doc["model"] is None else model_from_dict(doc["model"], f"{where}: field model")
        provenance = doc["provenance"]
        if not isinstance(provenance, dict):
            raise RecipeError(f"{where}: field provenance must be an object")
        if ("layers" in doc) == ("default_layer" in doc):
            raise RecipeError(f"{where}: exactly one of fields layers / default_layer is expected")
        if not all(isinstance(key, str) for key in tensors):
            raise RecipeError(f"{where}: tensor names must be strings")
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise RecipeError(f"{where}: tensor {key} holds NaN or inf; re-export the recipe")
        if "layers" in doc:
            if not isinstance(doc["layers"], list) or not doc["layers"]:
                raise RecipeError(f"{where}: field layers must be a non-empty list")
            layers = [layer_from_dict(d, f"layers[{i}]", where) for i, d in enumerate(doc["layers"])]
            if model is not None and len(layers) != model.num_layers:
                raise RecipeError(f"{where}: field layers has {len(layers)} entries, expected model.num_layers = {model.num_layers}")
            recipe = cls(name=name, layers=layers, model=model, tensors=tensors, provenance=provenance,
                         accounting=accounting)
        else:
            recipe = cls(name=name, default_layer=layer_from_dict(doc["default_layer"], "default_layer", where),
                         model=model, tensors=tensors, provenance=provenance, accounting=accounting)
        try:
            return recipe.validate()
        except RecipeError as err:
            raise RecipeError(f"{where}: {err}") from None

    @classmethod
    def load(cls, path: Path | str) -> "Recipe":
        """Load and validate a recipe file, or a preset by name (``kivi-2``...)."""
        if isinstance(path, str) and not path.endswith((".safetensors", ".json")) and path in list_presets():
            return load_preset(path)
        path = Path(path)
        if not path.is_file():
            raise RecipeError(
                f"recipe {path} does not exist: pass a recipe file written by `kvcalib export`/`search`, "
                f"or a preset name ({', '.join(list_presets())})"
            )
        if path.suffix == ".json":
            return _load_json(path)
        doc, tensors = read_safetensors_document(path, METADATA_KEY, "recipe", "a kvcalib recipe", RecipeError,
                                                 fix=": re-export it")
        return cls.from_document(doc, tensors, str(path))


def _load_json(path: Path) -> Recipe:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecipeError(f"recipe {path} is not readable JSON ({err}): fix or re-create it") from None
    return Recipe.from_document(doc, {}, str(path))


def _preset_dir() -> Path:
    """Shipped presets: ``recipes/presets`` in the source tree, installed as ``kvcalib.presets``."""
    import importlib.resources

    return Path(str(importlib.resources.files("kvcalib.presets")))


def list_presets() -> list[str]:
    return sorted(p.stem for p in _preset_dir().glob("*.json"))


def load_preset(name: str) -> Recipe:
    path = _preset_dir() / f"{name}.json"
    if not path.is_file():
        raise RecipeError(f"unknown preset {name!r}: use one of {', '.join(list_presets())}")
    return _load_json(path)


def resolve_recipe(spec: str | Path | Recipe) -> Recipe:
    """A Recipe from a path, a preset name, or a Recipe (wherever --recipe is taken)."""
    if isinstance(spec, Recipe):
        return spec
    return Recipe.load(str(spec) if not isinstance(spec, Path) else spec)


BEYOND_FACTOR = 2  # a recipe used at more than this many times its searched context is flagged


def beyond_searched_note(recipe: Recipe, context: int) -> str | None:
    """One line when ``recipe`` is used at ``context`` tokens, more than :data:`BEYOND_FACTOR` times
    the context it was searched for (its choices were never scored there), else None."""
    searched = recipe.searched_context
    if searched is None or context <= BEYOND_FACTOR * searched:
        return None
    return (f"note: recipe {recipe.name!r} was searched for {searched}-token contexts and is used at {context} "
            f"tokens; its bits were never scored that far. Search one for this context: kvcalib search --context {context}")


def build_codecs(recipe: Recipe, configs: list[LayerConfig], head_dim: int | None = None) -> list[LayerCodec]:
    """``recipe.codecs`` for ``len(configs)`` layers (``configs`` must be the recipe's own)."""
    return recipe.codecs(num_layers=len(configs), head_dim=head_dim)


def with_layers(recipe: Recipe, num_layers: int, **changes: Any) -> Recipe:
    """A fitted-style copy with one explicit LayerConfig per layer (changes applied to all)."""
    layers = [replace(c, **changes) for c in recipe.layer_configs(num_layers)]
    return Recipe(name=recipe.name, layers=layers, model=recipe.model, tensors=dict(recipe.tensors),
                  provenance=dict(recipe.provenance), accounting=recipe.accounting)


def isclose_bits(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


_MODEL_INTS = {"num_layers": 1, "num_q_heads": 1, "num_kv_heads": 1, "head_dim": 1, "max_positions": 0}
_MODEL_STRINGS = ("name", "model_type", "config_hash")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def model_from_dict(data: Any, where: str) -> ModelInfo:
    """The recipe's model description, every field present and of its type, the heads grouped
    (query heads a multiple of kv heads) and one sliding-window entry per layer (None or >= 1)."""
    expected = {f.name for f in fields(ModelInfo)}
    if not isinstance(data, dict):
        raise RecipeError(f"{where} must be an object (the model description kvcalib writes) or null, "
                          f"got {type(data).__name__}")
    wrong = sorted(map(str, set(data) ^ expected))
    if wrong:
        raise RecipeError(f"{where} has unknown or missing keys {wrong}; it needs exactly {sorted(expected)}: "
                          "re-export the recipe")
    for key, low in _MODEL_INTS.items():
        if not _is_int(data[key]) or data[key] < low:
            raise RecipeError(f"{where}.{key} must be an integer >= {low}, got {data[key]!r}")
    for key in _MODEL_STRINGS:
        if not isinstance(data[key], str) or not data[key]:
            raise RecipeError(f"{where}.{key} must be a non-empty string, got {data[key]!r}")
    if data["num_q_heads"] % data["num_kv_heads"]:
        raise RecipeError(f"{where}: num_q_heads {data['num_q_heads']} is not a multiple of num_kv_heads "
                          f"{data['num_kv_heads']}")
    sliding = data["sliding_window"]
    if not isinstance(sliding, list) or len(sliding) != data["num_layers"] or not all(
            w is None or (_is_int(w) and w >= 1) for w in sliding):
        raise RecipeError(f"{where}.sliding_window must list, for each of the {data['num_layers']} layers, null "
                          f"(global attention) or its window in tokens (>= 1); got {sliding!r}")
    return ModelInfo.from_dict(data)


def layer_from_dict(data: Any, field_name: str, where: str) -> LayerConfig:
    """Layer entry ``field_name`` of the recipe at ``where``: every key of
    :class:`~kvcalib.layout.LayerConfig` present (no key falls back to a default: a deleted
    ``window`` must not quietly become 0) and of its type."""
    if isinstance(data, dict):
        keys = [f.name for f in fields(LayerConfig)]
        missing = [key for key in keys if key not in data]
        if missing:
            raise RecipeError(f"{where}: field {field_name} lacks {missing}: every layer entry names all of "
                              f"{', '.join(keys)} (no defaults are assumed): re-export the recipe")
    try:
        return LayerConfig.from_dict(data, field_name)
    except RecipeError as err:
        raise RecipeError(f"{where}: {err}") from None


def side_bits_per_element(cfg: LayerConfig, side: str) -> float:
    """Bits one element of a quantized ``side`` costs in packed storage: its code plus its share
    of the group's float16 scale and zero-point (a group of ``group`` tokens per channel for
    KIVI keys, of ``group`` channels per token otherwise: the same share either way)."""
    return cfg.bits(side) + 2 * SCALE_BYTES * 8 / cfg.group(side)


def check_layer_cost(cfg: LayerConfig, where: str) -> None:
    """Refuse a quantized side whose groups are so small that its codes and scales cost at least
    what bf16 costs (it would lose precision and save nothing), naming the smallest group that saves."""
    for side in ("k", "v"):
        if cfg.bits(side) >= FP_BITS:
            continue
        cost = side_bits_per_element(cfg, side)
        if cost >= FP_BITS:
            smallest = math.floor(2 * SCALE_BYTES * 8 / (FP_BITS - cfg.bits(side))) + 1
            raise RecipeError(
                f"{where}: {side}_bits {cfg.bits(side)} with {side}_group {cfg.group(side)} costs {cost:g} bits per "
                f"element with its scales, bf16 costs {FP_BITS}: use {side}_group >= {smallest} (or {side}_bits 16)")


def check_layer_positions(cfg: LayerConfig, limit: int, model: str, where: str) -> None:
    """Refuse sinks and a window that together keep more tokens in full precision than the model
    ``model`` has positions (``limit``; 0 = not known, nothing checked): they cannot mean anything
    for the model (no token would ever be compressed: a preset with ``sinks`` 2^31 counted as a
    "compressed" recipe at 16.0 effective bits)."""
    if not limit or cfg.sinks + cfg.window <= limit:
        return
    raise RecipeError(f"{where}: sinks {cfg.sinks} + window {cfg.window} are beyond {model}'s {limit} positions "
                      f"(those tokens are kept in full precision, so nothing would ever be compressed): use sinks + "
                      f"window of at most {limit} (e.g. window 128, sinks 4)")
