"""FP8 KV-cache calibration for serving engines: ``k_scale``/``v_scale`` in the compressed-tensors layout.

vLLM and SGLang quantize the KV cache to FP8 (e4m3) with one scale per attention layer (or per
kv head) that they read from the checkpoint. This module writes those scales from kvcalib's
collected statistics, so an engine serves with calibrated scales instead of its default 1.0.

What the engines read (looked up, not guessed):

- Tensor names: ``model.layers.{i}.self_attn.k_scale`` and ``...v_scale``. compressed-tensors
  registers the KV-cache qparams on the attention module under ``k_scale``/``v_scale``
  (``compressed_tensors.quantization.quant_metadata.KVCacheScaleType``); vLLM's
  ``maybe_remap_kv_scale_name`` (``vllm/model_executor/model_loader/weight_utils.py``) maps
  ``self_attn.{k,v}_scale`` onto its ``Attention`` layer, and SGLang does the same.
- Meaning: dequantization scale, ``x ~ fp8(x / scale) * scale`` (vLLM
  ``layers/quantization/kv_cache.py``: "k/v_scale will be used to quantize k/v_cache entries
  before saving them to the cache - dequantize ... before fetching them"), so a calibrated
  scale is ``absmax / 448`` (448 = the largest finite float8_e4m3fn value).
- Shapes: strategy ``tensor`` -> ``(1,)`` (compressed-tensors ``initialize_qparams``:
  ``expected_shape = (1,)``); strategy ``attn_head`` -> ``(H_kv, 1, 1)`` (same function,
  ``(observed_shape[-3], 1, 1)``; vLLM's ``CompressedTensorsKVCacheMethod`` flattens it: "LLM-Compressor
  stores scales as 3D tensors of shape [num_heads, 1, 1]"). We write float32.
- ``config.json`` gets ``quantization_config`` = compressed-tensors ``QuantizationConfig``
  with ``quant_method: "compressed-tensors"``, empty ``config_groups`` (no weight quantization)
  and ``kv_cache_scheme`` = ``QuantizationArgs(num_bits=8, type="float", strategy=..., dynamic=False,
  symmetric=True)``. vLLM's ``validate_kv_cache_scheme`` accepts type float / 8 bits, strategy
  ``tensor`` or ``attn_head`` (older vLLM: ``tensor`` only) and symmetric only.
- Per-head support: vLLM docs (features/quantization/quantized_kvcache.md): per-attention-head
  scales ``k/v_scale = [num_kv_heads]`` work "only with the Flash Attention backend"; SGLang's
  ``BaseKVCacheMethod.process_weights_after_loading`` raises "Only support per-tensor scaling
  factor for fp8 KV cache". So per-tensor is the default and ``per_head=True`` is vLLM-only.

To serve: put the written ``kv_cache_scales.safetensors`` beside the model's weights and use the
written ``config.json`` (or copy the weights and tokenizer into ``out_dir``), then run the engine
with an FP8 KV cache (vLLM ``--kv-cache-dtype fp8``). If the weights are sharded with a
``model.safetensors.index.json``, add the scale names to its ``weight_map`` (vLLM only reads the
files the index names).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcalib.errors import KvcalibError

if TYPE_CHECKING:  # pragma: no cover
    from kvcalib.models import ModelInfo
    from kvcalib.recipe import Recipe
    from kvcalib.stats import CollectedStats

FP8_E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn value
SCALES_FILE = "kv_cache_scales.safetensors"
RECORD_FILE = "kvcalib_serving.json"


def kv_cache_scheme(per_head: bool = False) -> dict[str, Any]:
    """The ``kv_cache_scheme`` entry compressed-tensors writes for static symmetric FP8 scales.

    Field names and values are those of ``compressed_tensors.quantization.QuantizationArgs``
    (``model_dump`` of ``QuantizationArgs(num_bits=8, type="float", strategy=..., dynamic=False,
    symmetric=True)``).
    """
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
            "strategy": "attn_head" if per_head else "tensor", "dynamic": False}


def quantization_config(per_head: bool = False) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for a KV-cache-only compressed-tensors model."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",  # weights untouched (compressed-tensors' format for a non-compressed model)
        "quantization_status": "frozen",  # calibrated, observers removed
        "config_groups": {},  # no weight/activation quantization
        "kv_cache_scheme": kv_cache_scheme(per_head),
        "ignore": [],
        "global_compression_ratio": None,
    }


def fp8_scales(stats: "CollectedStats", *, per_head: bool = False, clip: float | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors ``model.layers.{i}.self_attn.{k,v}_scale`` from collected statistics.

    scale = clip x absmax / 448, absmax over all calibration tokens and channels of the layer
    (``per_head=False``: shape (1,)) or of each kv head (``per_head=True``: shape (H_kv, 1, 1)).
    ``clip`` in (0, 1] (default 1: no clipping) trades saturation of the rarest outliers for
    resolution. A layer that never saw a non-zero value gets scale 1.0 (the engines' default).
    """
    if clip is not None and not (0.0 < float(clip) <= 1.0):
        raise KvcalibError(f"clip must be in (0, 1], got {clip!r}: 1 keeps the full range, 0.9 saturates the top 10%.")
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(stats.layers):
        for side in ("k", "v"):
            absmax = getattr(layer, side)["absmax"].to(torch.float32)  # (H, D)
            if not torch.isfinite(absmax).all():
                raise KvcalibError(f"layer {i} {side} statistics hold NaN or inf: collect again (in fp32).")
            peak = absmax.amax(dim=1) if per_head else absmax.amax().reshape(1)  # (H,) or (1,)
            if clip is not None and float(clip) != 1.0:
                peak = peak * float(clip)
            scale = peak / FP8_E4M3_MAX
            scale = torch.where(peak > 0, scale, torch.ones_like(scale))
            if per_head:
                scale = scale.reshape(-1, 1, 1)  # (H, 1, 1), compressed-tensors' attn_head shape
            out[f"model.layers.{i}.self_attn.{side}_scale"] = scale.contiguous()
    return out


def _model_folder(stats: "CollectedStats", run_dir: Path, model: str | Path | None) -> Path:
    """The folder whose ``config.json`` the export extends (see export_compressed_tensors)."""
    from kvcalib.models import embedded_aliases, ensure_embedded_folder

    if model is not None:
        if str(model) in embedded_aliases():
            return ensure_embedded_folder(str(model))
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file():
            raise KvcalibError(f"--model {model} is not a model folder with a config.json: pass the local folder the statistics were collected from.")
        return folder
    name = stats.model.name
    if name in embedded_aliases():
        return ensure_embedded_folder(name)
    run_json = run_dir / "run.json"
    if run_json.is_file():
        try:
            source = json.loads(run_json.read_text()).get("model_source")
        except (OSError, json.JSONDecodeError):
            source = None
        if source and (Path(source) / "config.json").is_file():
            return Path(source)
    raise KvcalibError(
        f"the statistics in {run_dir} come from {name!r}, which is not a local folder: pass "
        "--model FOLDER (the model's local folder with config.json) to export serving scales."
    )


def _check_geometry(stats_model: "ModelInfo", folder: Path) -> None:
    from transformers import AutoConfig

    from kvcalib.models import model_info

    try:
        info = model_info(AutoConfig.from_pretrained(str(folder)), stats_model.name)
    except (OSError, ValueError) as err:
        raise KvcalibError(f"cannot read {folder / 'config.json'} ({type(err).__name__}): pass the model's folder.") from None
    for key in ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
        want, got = getattr(stats_model, key), getattr(info, key)
        if want != got:
            raise KvcalibError(
                f"{folder} is not the model the statistics were collected from: {key} is {got!r}, "
                f"the statistics have {want!r}. Pass the right --model folder."
            )


def export_compressed_tensors(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    model: str | Path | None = None,
    per_head: bool = False,
    clip: float | None = None,
    force: bool = False,
) -> Path:
    """Write FP8 KV-cache scales that vLLM/SGLang load, from ``kvcalib collect`` statistics.

    ``out_dir`` receives (atomically: a temporary folder renamed at the end):

    - ``kv_cache_scales.safetensors``: ``model.layers.{i}.self_attn.k_scale`` / ``v_scale``,
      float32, ``absmax / 448`` of layer ``i``'s keys/values; shape ``(1,)`` per tensor, or
      ``(H_kv, 1, 1)`` with ``per_head=True`` (vLLM Flash Attention backend only; SGLang takes
      per-tensor scales only);
    - ``config.json``: the model's config plus ``quantization_config`` with the compressed-tensors
      ``kv_cache_scheme`` (8-bit float, static, symmetric, strategy ``tensor``/``attn_head``);
    - ``kvcalib_serving.json``: how it was made (statistics, model folder, options, versions).

    ``model``: where ``config.json`` comes from. Default: the embedded model's folder for embedded
    aliases, else the local folder the statistics were collected from (``run.json``); a hub model
    needs ``model=FOLDER``. An existing non-empty ``out_dir`` is refused unless ``force``.

    Example::

        >>> from kvcalib.serving import export_compressed_tensors
        >>> export_compressed_tensors("runs/smol", "serve/smol-fp8")  # doctest: +SKIP
        PosixPath('serve/smol-fp8')
    """
    from safetensors.torch import save_file

    from kvcalib import __version__
    from kvcalib.io import atomic_path
    from kvcalib.stats import CollectedStats

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise KvcalibError(f"{out_dir} already exists and is not empty: pass another folder, or force=True (--force) to replace it.")
    stats = CollectedStats.load(run_dir)
    folder = _model_folder(stats, run_dir, model)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise KvcalibError(f"cannot read {folder / 'config.json'}: {err}.") from None
    _check_geometry(stats.model, folder)
    existing = config.get("quantization_config")
    qcfg = quantization_config(per_head)
    if existing:
        if existing.get("quant_method") != "compressed-tensors":
            raise KvcalibError(
                f"{folder} is already quantized with {existing.get('quant_method')!r}; the FP8 KV-cache "
                "scheme can only be added to an unquantized or compressed-tensors model."
            )
        qcfg = {**existing, "kv_cache_scheme": kv_cache_scheme(per_head)}
    config["quantization_config"] = qcfg
    scales = fp8_scales(stats, per_head=per_head, clip=clip)
    record = {
        "made_by": "kvcalib.serving.export_compressed_tensors",
        "kvcalib_version": __version__,
        "statistics": str(run_dir),
        "model": stats.model.name,
        "model_folder": str(folder),
        "strategy": "attn_head" if per_head else "tensor",
        "clip": clip,
        "fp8_max": FP8_E4M3_MAX,
        "tensors": SCALES_FILE,
        "calibration": {k: stats.config.get(k) for k in ("data", "samples", "seq_len", "seed")},
        "serve": "vllm serve <model folder with these files> --kv-cache-dtype fp8",
    }
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        save_file(scales, str(tmp / SCALES_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir


def recipe_to_serving(
    recipe: "Recipe | str | Path",
    out_dir: str | Path,
    *,
    model: str | Path | None = None,
    per_head: bool = False,
    clip: float | None = None,
    force: bool = False,
) -> Path:
    """Export a recipe for a serving engine, where the engine can express it: FP8 scales only.

    vLLM and SGLang hold the KV cache in FP8 with per-tensor (or per-head) scales; kvcalib's
    2-/4-bit packed groups, windows, sinks, reordering and Huffman codes have no counterpart
    there, so a recipe with any layer under 8 bits is refused with a message naming what can be
    exported instead (FP8 scales from the statistics the recipe was fitted on). An 8/16-bit
    recipe exports the FP8 scales of those statistics (``provenance["statistics"]``).
    """
    from kvcalib.recipe import resolve_recipe

    rec = resolve_recipe(recipe)
    stats_dir = rec.provenance.get("statistics")
    configs = rec.layers if rec.layers is not None else [rec.default_layer]
    low = sorted({b for c in configs for b in (c.k_bits, c.v_bits) if b < 8})  # type: ignore[union-attr]
    instead = (f"export_compressed_tensors({stats_dir!r}, OUT_DIR)" if stats_dir
               else "export_compressed_tensors(RUN_DIR, OUT_DIR) on the statistics of `kvcalib collect`")
    if low:
        raise KvcalibError(
            f"recipe {rec.name!r} uses {'/'.join(map(str, low))}-bit KV layers, which vLLM and SGLang "
            "cannot express (their quantized KV cache is FP8 with per-tensor or per-head scales). What "
            f"can be exported is FP8 e4m3 k_scale/v_scale from the collected statistics: {instead}."
        )
    if not stats_dir:
        raise KvcalibError(
            f"recipe {rec.name!r} does not record the statistics it was fitted on "
            f"(provenance.statistics): run {instead}."
        )
    return export_compressed_tensors(stats_dir, out_dir, model=model, per_head=per_head, clip=clip, force=force)


__all__ = ["FP8_E4M3_MAX", "SCALES_FILE", "export_compressed_tensors", "fp8_scales", "kv_cache_scheme",
           "quantization_config", "recipe_to_serving"]
