"""Recipe files: one safetensors file that says how every layer's K and V are compressed.

Layout (no pickle)::

    tensors   layers.{i}.{k|v}.{name}   fitted state (permutations, clip scales, codebooks...)
    metadata  "kvcalib_recipe": JSON document
              {
                "format": "kvcalib-recipe", "schema_version": 1,
                "name": str,
                "model": ModelInfo dict or null (null = a model-agnostic preset),
                "layers": [LayerConfig dict, ...] (one per layer), or
                "default_layer": LayerConfig dict (presets: the same config for every layer),
                "provenance": {"data", "samples", "seed", "objective", "kvcalib_version", ...}
              }

Loading validates every field and fails with :class:`RecipeError` naming the field and the value
expected. A fitted recipe is refused for a model whose geometry or config hash differs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from kvcalib.errors import RecipeError
from kvcalib.io import read_safetensors_document
from kvcalib.models import ModelInfo

RECIPE_FORMAT = "kvcalib-recipe"
SCHEMA_VERSION = 1
METADATA_KEY = "kvcalib_recipe"
VALID_BITS = (2, 4, 8, 16)  # 16 = kept in full precision (not quantized)
KEY_AXES = ("channel", "token")  # keys per channel over token groups (KIVI) or per token
FP_BITS = 16  # full-precision segments are accounted at 16 bits, as stored on GPU (bf16/fp16)
SCALE_BYTES = 2  # scales and zero-points are float16
MAX_OUTLIER_POOL = 1024  # full-precision pool slots per kv head; beyond this a pool defeats compression


@dataclass(frozen=True)
class LayerConfig:
    """How one layer's cache is compressed (user configuration; fitted tensors live apart).

    - ``k_bits``/``v_bits``: 2, 4, 8, or 16 (no quantization).
    - ``k_axis``: ``channel`` = keys quantized per channel over groups of ``k_group`` consecutive
      tokens (KIVI); ``token`` = per token over groups of ``k_group`` channels.
    - ``v_group``: values are quantized per token over groups of ``v_group`` channels.
    - ``sinks``: the first S tokens stay in full precision forever (attention sinks).
    - ``window``: the most recent R tokens stay in full precision; older tokens are flushed to
      packed storage in blocks of ``flush_block`` tokens once R + block tokens are pending.
    """

    k_bits: int = 16
    v_bits: int = 16
    k_axis: str = "channel"
    k_group: int = 32
    v_group: int = 32
    sinks: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in VALID_BITS:
                raise ValueError(f"{name} must be one of {VALID_BITS}, got {getattr(self, name)!r}")
        if self.k_axis not in KEY_AXES:
            raise ValueError(f"k_axis must be one of {KEY_AXES}, got {self.k_axis!r}")
        for name in ("k_group", "v_group"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        for name in ("sinks", "window"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {val!r}")
        if self.compressed and self.window and self.window < self.flush_block:
            raise ValueError(
                f"window ({self.window}) is shorter than a group ({self.flush_block} tokens): "
                f"use window 0 or at least {self.flush_block}"
            )

    @property
    def compressed(self) -> bool:
        return self.k_bits < 16 or self.v_bits < 16

    @property
    def flush_block(self) -> int:
        """Tokens moved from the window to packed storage at once."""
        if self.k_bits < 16 and self.k_axis == "channel":
            return self.k_group
        return 1

    def check_head_dim(self, head_dim: int) -> None:
        """Group sizes along channels must divide head_dim; packing needs whole bytes."""
        if self.v_bits < 16 and head_dim % self.v_group:
            raise ValueError(f"v_group {self.v_group} does not divide head_dim {head_dim}")
        if self.k_bits < 16 and self.k_axis == "token" and head_dim % self.k_group:
            raise ValueError(f"k_group {self.k_group} does not divide head_dim {head_dim}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "layer") -> "LayerConfig":
        if not isinstance(data, dict):
            raise RecipeError(f"recipe field {where} must be an object, got {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise RecipeError(f"recipe field {where} has unknown keys {unknown}; allowed: {sorted(allowed)}")
        try:
            return cls(**data)
        except (ValueError, TypeError) as err:
            raise RecipeError(f"recipe field {where}: {err}") from None


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one sequence's cache holds at context T, by component (all layers, K and V)."""

    context: int
    elements: int  # 2 * layers * kv_heads * head_dim * T
    components: dict[str, float]

    @property
    def total_bytes(self) -> float:
        return float(sum(self.components.values()))

    @property
    def effective_bits(self) -> float:
        """8 x bytes / elements (DESIGN.md); bf16 everywhere is 16.0."""
        return 8.0 * self.total_bytes / self.elements


def quantized_token_count(cfg: LayerConfig, t: int) -> int:
    """Tokens in packed storage after ``t`` tokens have been cached (flush policy of the runtime)."""
    if not cfg.compressed:
        return 0
    pending = t - min(t, cfg.sinks)
    block = cfg.flush_block
    n_blocks = max(0, (pending - cfg.window) // block)
    return n_blocks * block


def layer_bytes(cfg: LayerConfig, heads: int, head_dim: int, t: int, sliding: int | None = None) -> dict[str, float]:
    """Bytes of one layer's K and V for one sequence at context ``t``, by component."""
    kept = t if sliding is None else min(t, sliding)
    nq = quantized_token_count(cfg, kept)
    n_fp = kept - nq
    fp_bytes = FP_BITS // 8
    out = {"full_precision": float(2 * n_fp * heads * head_dim * fp_bytes)}
    if nq:
        if cfg.k_bits < 16:
            out["k_codes"] = nq * heads * head_dim * cfg.k_bits / 8
            if cfg.k_axis == "channel":
                out["k_scales"] = (nq // cfg.k_group) * heads * head_dim * 2 * SCALE_BYTES
            else:
                out["k_scales"] = nq * heads * (head_dim // cfg.k_group) * 2 * SCALE_BYTES
        else:
            out["full_precision"] += nq * heads * head_dim * fp_bytes
        if cfg.v_bits < 16:
            out["v_codes"] = nq * heads * head_dim * cfg.v_bits / 8
            out["v_scales"] = nq * heads * (head_dim // cfg.v_group) * 2 * SCALE_BYTES
        else:
            out["full_precision"] += nq * heads * head_dim * fp_bytes
    return out


@dataclass
class Recipe:
    """A loaded recipe: per-layer configuration, fitted tensors, model identity, provenance."""

    name: str
    layers: list[LayerConfig] | None = None  # None: a preset with one default_layer for all
    default_layer: LayerConfig | None = None
    model: ModelInfo | None = None  # None: model-agnostic preset
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.layers is None) == (self.default_layer is None):
            raise RecipeError("a recipe needs exactly one of `layers` (fitted) or `default_layer` (preset)")

    @property
    def is_preset(self) -> bool:
        return self.layers is None

    def layer_configs(self, num_layers: int) -> list[LayerConfig]:
        """One LayerConfig per layer of a model with ``num_layers`` layers."""
        if self.layers is None:
            return [self.default_layer] * num_layers  # type: ignore[list-item]
        if len(self.layers) != num_layers:
            raise RecipeError(f"recipe {self.name!r} has {len(self.layers)} layers but the model has {num_layers}")
        return list(self.layers)

    def check_model(self, info: ModelInfo) -> None:
        """Refuse a fitted recipe for another model, naming the mismatching field."""
        for cfg in self.layer_configs(info.num_layers):
            try:
                cfg.check_head_dim(info.head_dim)
            except ValueError as err:
                raise RecipeError(f"recipe {self.name!r} does not fit {info.name}: {err}") from None
        if self.model is None:
            return
        for key in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads", "model_type", "config_hash"):
            want, got = getattr(self.model, key), getattr(info, key)
            if want != got:
                raise RecipeError(
                    f"recipe {self.name!r} was fitted for {self.model.name} and does not fit this model: "
                    f"model.{key} is {got!r}, the recipe expects {want!r}. Fit a recipe for this model "
                    "(kvcalib collect + export/search) or use a preset."
                )

    # ------------------------------------------------------------------ per-layer fitted state
    def outlier_pool(self, i: int, cfg: LayerConfig) -> int:
        """OTT pool size of layer ``i`` from ``layers.{i}.kv.outlier_pool`` (0 = off / absent).

        Refuses (naming the tensor) a non-integer or non-scalar tensor, a negative size, and a
        pool on a layer kept at 16 bits.
        """
        name = f"layers.{i}.kv.outlier_pool"
        t = self.tensors.get(name)
        if t is None:
            return 0
        if t.numel() != 1 or t.is_floating_point() or t.dtype == torch.bool:
            raise RecipeError(f"recipe {self.name!r}: tensor {name} must be an integer scalar (the OTT pool "
                              f"size), got {t.dtype} of shape {tuple(t.shape)}: re-export the recipe")
        size = int(t.reshape(-1)[0])
        if not 0 <= size <= MAX_OUTLIER_POOL:
            raise RecipeError(f"recipe {self.name!r}: tensor {name} is {size}; the outlier pool size must be "
                              f">= 0 and <= {MAX_OUTLIER_POOL} (0 = off, OTT uses 3): re-export the recipe")
        if size and not cfg.compressed:
            raise RecipeError(f"recipe {self.name!r}: tensor {name} is {size} but layer {i} keeps K and V at "
                              "16 bits (nothing is flushed): set it to 0 or drop the tensor")
        return size

    def schedule(self, i: int, cfg: LayerConfig):
        """PATS schedule of layer ``i`` from ``layers.{i}.kv.schedule`` (None when absent).

        Returns a :class:`~kvcalib.calibrate.schedule.Schedule` (sinks from the layer config),
        validated: ages start at 0 and strictly increase, bits never increase with age, and the
        first quantized tier is the layer config (window, bits, sinks). Refusals name the tensor.
        """
        name = f"layers.{i}.kv.schedule"
        t = self.tensors.get(name)
        if t is None:
            return None
        from kvcalib.calibrate.schedule import Schedule
        from kvcalib.errors import KvcalibError

        try:
            sched = Schedule.from_tensor(t, sinks=cfg.sinks)
            sched.check_layer(cfg)
        except KvcalibError as err:
            raise RecipeError(f"recipe {self.name!r}: tensor {name} (rows age, k_bits, v_bits) is invalid: "
                              f"{err}. Re-export the recipe (kvcalib export --schedule ...)") from None
        return sched

    def memory(self, info: ModelInfo, context: int = 4096) -> MemoryBreakdown:
        """Accounted bytes per sequence at ``context`` (DESIGN.md's memory accounting).

        Per layer: :func:`layer_bytes`, or, with a PATS schedule, ``schedule_bytes`` (each flushed
        block at its tier's bits); centering means; OTT pools (``pool_bytes``: full-precision
        pool + extra pool slots, int32 positions, counters, and ``ceil(G / 8)`` mask bytes per
        flushed block per kv head, as the cache stores them); fitted tensors amortised.
        """
        from kvcalib.calibrate.outliers import EXTRA_CAPACITY, pool_bytes
        from kvcalib.calibrate.schedule import schedule_bytes

        comps: dict[str, float] = {}
        fp_bytes = FP_BITS // 8
        for i, cfg in enumerate(self.layer_configs(info.num_layers)):
            kept = context if info.sliding_window[i] is None else min(context, info.sliding_window[i])
            sched = self.schedule(i, cfg)
            if sched is not None and cfg.compressed:
                base = schedule_bytes(sched, kept, info.num_kv_heads, info.head_dim, cfg.k_group, cfg.v_group,
                                      cfg.k_axis, fp_bytes)
            else:
                base = layer_bytes(cfg, info.num_kv_heads, info.head_dim, context, info.sliding_window[i])
            for key, val in base.items():
                comps[key] = comps.get(key, 0.0) + val
            nq = quantized_token_count(cfg, kept)
            pool = self.outlier_pool(i, cfg)
            if pool and nq:  # the cache allocates the pools at the first flush
                blocks = nq // cfg.flush_block
                mask_tokens = blocks * ((cfg.flush_block + 7) // 8) * 8  # whole bytes per block
                ott = pool_bytes(info.num_kv_heads, info.head_dim, pool, EXTRA_CAPACITY, mask_tokens, fp_bytes)
                for key, val in (("outlier_pool", ott["fp_k_v"]), ("outlier_positions", ott["positions"] + ott["counters"]),
                                 ("outlier_masks", ott["masks"])):
                    comps[key] = comps.get(key, 0.0) + val
            for side in ("k", "v"):
                t = self.tensors.get(f"layers.{i}.{side}.center")
                bits = int(round(float(t.reshape(-1)[0]))) if t is not None else 0
                if bits and nq and (cfg.k_bits if side == "k" else cfg.v_bits) < 16:
                    # one stored mean per token (TaDA): 16-bit = 2D bytes, 8-bit = D codes + fp16 scale/zero
                    per_token = 2.0 * info.head_dim if bits == 16 else info.head_dim + 4.0
                    comps[f"{side}_mean"] = comps.get(f"{side}_mean", 0.0) + nq * per_token
        for name, tensor in self.tensors.items():  # fitted state read at decode time, amortised
            comps["recipe_state"] = comps.get("recipe_state", 0.0) + tensor.numel() * tensor.element_size()
        elements = 2 * info.num_layers * info.num_kv_heads * info.head_dim * context
        return MemoryBreakdown(context, elements, comps)

    # ------------------------------------------------------------------ file I/O
    def metadata(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": RECIPE_FORMAT,
            "schema_version": SCHEMA_VERSION,
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
        if not isinstance(doc, dict):
            raise RecipeError(f"{where}: the recipe document must be a JSON object")
        if doc.get("format") != RECIPE_FORMAT:
            raise RecipeError(f"{where}: field format is {doc.get('format')!r}, expected {RECIPE_FORMAT!r}")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise RecipeError(
                f"{where}: field schema_version is {doc.get('schema_version')!r}, this kvcalib reads "
                f"{SCHEMA_VERSION}: re-export the recipe with this version"
            )
        allowed = {"format", "schema_version", "name", "model", "provenance", "layers", "default_layer"}
        unknown = sorted(set(doc) - allowed)
        if unknown:
            raise RecipeError(f"{where}: unknown fields {unknown}; allowed: {sorted(allowed)}")
        name = doc.get("name")
        if not isinstance(name, str) or not name:
            raise RecipeError(f"{where}: field name must be a non-empty string")
        model = None
        if doc.get("model") is not None:
            try:
                model = ModelInfo.from_dict(doc["model"])
                if model.num_layers < 1 or model.num_kv_heads < 1 or model.head_dim < 1:
                    raise ValueError("non-positive geometry")
            except (TypeError, ValueError, KeyError, AttributeError) as err:
                raise RecipeError(f"{where}: field model is malformed ({err}); expected the model description kvcalib writes") from None
        provenance = doc.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise RecipeError(f"{where}: field provenance must be an object")
        if ("layers" in doc) == ("default_layer" in doc):
            raise RecipeError(f"{where}: exactly one of fields layers / default_layer is expected")
        if "layers" in doc:
            if not isinstance(doc["layers"], list) or not doc["layers"]:
                raise RecipeError(f"{where}: field layers must be a non-empty list")
            layers = [LayerConfig.from_dict(d, f"layers[{i}]") for i, d in enumerate(doc["layers"])]
            if model is not None and len(layers) != model.num_layers:
                raise RecipeError(f"{where}: field layers has {len(layers)} entries, expected model.num_layers = {model.num_layers}")
            recipe = cls(name=name, layers=layers, model=model, tensors=tensors, provenance=provenance)
        else:
            recipe = cls(name=name, default_layer=LayerConfig.from_dict(doc["default_layer"], "default_layer"),
                         model=model, tensors=tensors, provenance=provenance)
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise RecipeError(f"{where}: tensor {key} holds NaN or inf; re-export the recipe")
        return recipe

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


def with_layers(recipe: Recipe, num_layers: int, **changes: Any) -> Recipe:
    """A fitted-style copy with one explicit LayerConfig per layer (changes applied to all)."""
    layers = [replace(c, **changes) for c in recipe.layer_configs(num_layers)]
    return Recipe(name=recipe.name, layers=layers, model=recipe.model, tensors=dict(recipe.tensors),
                  provenance=dict(recipe.provenance))


def isclose_bits(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
