"""``kvcalib inspect``: a recipe as a per-layer report (table or JSON), where it came from, and a
layer-by-layer diff of two recipes (``kvcalib inspect A --diff B``)."""

from __future__ import annotations

import json
from typing import Any

from kvcalib.errors import KvcalibError
from kvcalib.models import DEFAULT_MODEL, ModelInfo
from kvcalib.layout import ACCOUNTING, held_elements, held_tokens, layer_bytes, legacy_bits_factor, quantized_token_count
from kvcalib.recipe import Recipe, resolve_recipe


def check_context(context: Any, info: ModelInfo | None = None) -> int:
    """``--context``: a positive number of tokens (0 would divide by zero, a negative one count
    negative bytes), and with ``info`` no more than the model's positions (a context the model
    cannot hold means nothing, and one of 2**40 tokens would take the accounting hours)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise KvcalibError(f"--context {context!r} is not a context length: pass a positive number of tokens "
                           "(e.g. 4096), the length at which bytes and effective bits are counted.")
    if info is not None and info.max_positions and context > info.max_positions:
        raise KvcalibError(f"--context {context:,} is beyond {info.name}'s {info.max_positions:,} positions: pass "
                           f"--context {info.max_positions} or less.")
    return context


def _model_info_for(recipe: Recipe, model: str | ModelInfo | None) -> ModelInfo:
    """The recipe's own model, else ``model``'s geometry: a ModelInfo as given, or a name whose
    config (not its weights) is read."""
    if isinstance(model, ModelInfo):
        return model
    if recipe.model is not None and model is None:
        return recipe.model
    from kvcalib.models import ensure_embedded_folder, model_info, resolve_model_source
    from kvcalib.preflight import model_geometry

    name = model or DEFAULT_MODEL
    kind, where, kwargs = resolve_model_source(name)  # a bad alias or path is refused here, offline
    info = (model_geometry(name) or {}).get("info")  # its config on this machine, or kvcalib's pinned geometry
    if info is not None:
        return info
    if kind == "embedded":
        where = str(ensure_embedded_folder(name))
    from transformers import AutoConfig

    try:  # the config alone (a hub id not cached yet, a .gguf file): no weights are loaded
        config = AutoConfig.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as err:
        raise KvcalibError(f"cannot read the config of --model {name!r} ({type(err).__name__}): pass an embedded alias or a local folder.") from None
    return model_info(config, name)


def _method_sections(recipe: Recipe, info: ModelInfo, context: int, layers: list[dict[str, Any]],
                     elements_per_layer: list[int]) -> dict[str, Any]:
    """Each registered method's own report section (``Method.inspect``), keyed by its name."""
    from kvcalib.methods import registry

    return {name: method.inspect(recipe, info, context, layers, elements_per_layer)
            for name, method in registry().items() if method.inspect is not None}


def inspect_recipe(spec: str | Recipe, model: str | ModelInfo | None = None, context: int | None = None) -> dict[str, Any]:
    """Everything `kvcalib inspect` shows, as a JSON-ready dict, at ``context`` tokens (None: the
    context the recipe was searched for, as its provenance records it, else 4096: a recipe searched
    for 16k is judged where it was made to be used).

    Every registered method adds its own section under its name (``Method.inspect``; None when
    the recipe does not use it) and may add per-layer fields: e.g. with Huffman codebooks each
    layer gets ``k_huffman_bits`` / ``v_huffman_bits`` and ``coded_effective_bits``, and
    ``report["huffman"]`` holds the coded memory at ``context``.
    """
    recipe = resolve_recipe(spec)
    if context is not None:
        check_context(context)
    info = _model_info_for(recipe, model)
    recipe.check_model(info)
    if context is not None:
        check_context(context, info)
    context_note = None
    if context is None:
        context, context_note = recorded_context(recipe.provenance, info)
    elements_per_layer = _layer_elements(info, context)
    layers = [{"layer": i, **cfg.to_dict(), "sliding_window": info.sliding_window[i],
               "held_tokens": held_tokens(context, info.sliding_window[i]), "effective_bits": bits}
              for i, (cfg, bits) in enumerate(zip(recipe.layer_configs(info.num_layers), _layer_bits(recipe, info, context)))]
    from kvcalib.runtime.triton_path import decode_paths

    for row, why in zip(layers, decode_paths(recipe, info)):
        row["decode"] = "kernel" if why is None else f"reference: {why}"
    mem = recipe.memory(info, context)
    return {
        "name": recipe.name,
        "preset": recipe.is_preset,
        "model": info.to_dict(),
        "context": context,
        "layers": layers,
        "memory": {"effective_bits": mem.effective_bits, "total_bytes": mem.total_bytes,
                   "compression_ratio": mem.compression_ratio, "bf16_bytes": mem.bf16_bytes,
                   "held_tokens": sum(r["held_tokens"] for r in layers), "accounting": ACCOUNTING,
                   "components": mem.components},
        # how the bits the provenance records were counted; the factor turns them into this accounting
        "recorded_accounting": recipe.accounting,
        "recorded_bits_factor": (1.0 if recipe.accounting == ACCOUNTING
                                 else legacy_bits_factor(context, info.sliding_window)),
        **_method_sections(recipe, info, context, layers, elements_per_layer),
        "tensors": {k: list(v.shape) for k, v in recipe.tensors.items()},
        "provenance": recipe.provenance,
        "origin": provenance_summary(recipe.provenance),
        "searched_context": recipe.searched_context,  # tokens per scored window of its search (None: not searched)
        "context_note": context_note,
    }


def decode_summary(layers: list[dict[str, Any]]) -> str:
    """One line on the decode path of an :func:`inspect_recipe` report's layers: all in the fused
    kernel, or which ones are not, why, and what that costs."""
    slow = [r for r in layers if r["decode"] != "kernel"]
    if not slow:
        return f"decode on a GPU: all {len(layers)} layers in the fused Triton kernel"
    reasons = sorted({r["decode"].removeprefix("reference: ") for r in slow})
    return (f"decode on a GPU: {len(layers) - len(slow)} of {len(layers)} layers in the fused kernel; layers "
            f"{', '.join(str(r['layer']) for r in slow)} on the PyTorch reference path ({'; '.join(reasons)}), "
            "which dequantizes the whole cache at every step (tens of times slower than bf16 at long context) "
            "and keeps the recipe out of whole-step CUDA graphs")


DEFAULT_CONTEXT = 4096


def recorded_context(provenance: dict[str, Any], info: ModelInfo) -> tuple[int, str | None]:
    """(the context to count memory at when none is asked for, a note when the recorded one was
    set aside): the context the recipe's provenance records (a recipe searched for 16k is judged
    where it was made to be used), unless it is not a positive integer or lies beyond the model's
    positions (a file's number is informational: 4,096,000 on an 8,192-position model means
    nothing); else 4096, or the model's positions where they are fewer."""
    default = min(DEFAULT_CONTEXT, info.max_positions) if info.max_positions else DEFAULT_CONTEXT
    recorded = provenance.get("context")
    if recorded is None:
        return default, None
    if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 1:
        return default, f"the recorded context {recorded!r} is not a number of tokens: counted at {default}"
    if info.max_positions and recorded > info.max_positions:
        return default, (f"the recorded context {recorded:,} is beyond {info.name}'s {info.max_positions:,} "
                         f"positions: counted at {default}")
    return recorded, None


def method_lines(report: dict[str, Any]) -> list[str]:
    """Human-readable lines of every method's section of an :func:`inspect_recipe` report
    (``Method.inspect_lines``; empty where a method has no section)."""
    from kvcalib.methods import registry

    lines: list[str] = []
    for name, method in registry().items():
        if report.get(name):
            lines += method.inspect_lines(report)
    return lines


# provenance keys people ask about first, with their labels (kvcalib export/search write them)
_ORIGIN_KEYS = (
    ("made_by", "made by"), ("kvcalib_version", "kvcalib"), ("statistics", "statistics"),
    ("data", "data"), ("samples", "samples"), ("seq_len", "seq len"), ("seed", "seed"),
    ("methods", "methods"), ("objective", "objective"), ("objective_value", "objective value"),
    ("budget", "budget"), ("bits_budget", "bits budget"), ("trials", "trials"), ("n_trials", "trials"),
    ("search_budget", "search budget"), ("held_out", "held-out"), ("heldout", "held-out"),
    ("held_out_kl", "held-out KL"), ("held_out_ppl", "held-out ppl"),
)


def provenance_summary(provenance: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs saying where a recipe came from: the well-known keys first, in a fixed
    order, then every other provenance key as it is (nothing recorded is hidden)."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.6g}"
        if isinstance(v, (dict, list)):
            return json.dumps(v, sort_keys=True)
        return str(v)

    for key, label in _ORIGIN_KEYS:
        if key in provenance and provenance[key] not in (None, "", [], {}):
            out.append((label, fmt(provenance[key])))
            seen.add(key)
    from kvcalib.methods import registry

    for name, method in registry().items():  # a method's own record: summarised by the method, not dumped
        line = _method_origin(method, provenance.get(name))
        if line is not None:
            out.append((name, line))
            seen.add(name)
    for key in sorted(provenance):
        if key not in seen and provenance[key] not in (None, "", [], {}):
            out.append((key, fmt(provenance[key])))
    return out


def _method_origin(method: Any, note: Any) -> str | None:
    """``method.origin(note)`` for a method's provenance record, or None (the record is then
    shown as it is): provenance is informational and not validated on load, so a record of
    another shape (a number where a list was written) must not break ``inspect``."""
    if not isinstance(note, dict):
        return None
    try:
        return method.origin(note)
    except Exception:  # noqa: BLE001  (any shape a hand-edited file can give)
        return None


_LAYER_FIELDS = ("k_bits", "v_bits", "k_axis", "k_group", "v_group", "window", "sinks")


def _fitted(recipe: Recipe, layer: int) -> list[str]:
    """Fitted tensor kinds of one layer, e.g. ``["k.clip", "v.perm"]`` (from ``layers.{i}.*`` names)."""
    prefix = f"layers.{layer}."
    return sorted(name[len(prefix):] for name in recipe.tensors if name.startswith(prefix))


def _layer_elements(info: ModelInfo, context: int) -> list[int]:
    """K/V elements each layer holds at ``context`` (a sliding layer its window): the denominator of
    its effective bits, as the whole cache's (:func:`~kvcalib.layout.held_elements`)."""
    return [held_elements(info.num_kv_heads, info.head_dim, context, [w]) for w in info.sliding_window]


def _layer_bits(recipe: Recipe, info: ModelInfo, context: int) -> list[float]:
    """Effective bits per element of each layer at ``context`` (payload at each stored tier's bits,
    scales, full-precision parts, and what the layer's method states keep per token: TaDA means,
    OTT pools, the bytes 8-bit scale pairs give back) over the tokens the layer holds: 16.0 for a
    bf16 layer, sliding or not. Tables kept once per model and the recipe's own tensors are not
    a layer's (``Recipe.memory`` counts them)."""
    out = []
    for i, (cfg, codec, elements) in enumerate(zip(recipe.layer_configs(info.num_layers), recipe.codecs(info),
                                                   _layer_elements(info, context))):
        window = info.sliding_window[i]
        total = sum(layer_bytes(cfg, info.num_kv_heads, info.head_dim, context, window, codec.tiers).values())
        kept = held_tokens(context, window)
        packed = quantized_token_count(cfg, kept)
        total += sum(sum(state.bytes(cfg, info.num_kv_heads, info.head_dim, kept, packed).values())
                     for state in codec.states.values())
        out.append(8.0 * total / elements)
    return out


def diff_recipes(a: str | Recipe, b: str | Recipe, model: str | ModelInfo | None = None,
                 context: int | None = None) -> dict[str, Any]:
    """Compare two recipes layer by layer: only layers that differ, plus a summary.

    Per differing layer: each of bits/groups/axis/window/sinks that differ as ``[a, b]``, the
    fitted tensors present in only one of them, and both effective bits at ``context``. The
    summary has both names, models, total effective bits, the count of differing layers per
    field, and the provenance keys whose values differ. Both recipes must fit one geometry.
    """
    if context is not None:
        check_context(context)
    ra, rb = resolve_recipe(a), resolve_recipe(b)
    info = _model_info_for(ra if ra.model is not None or rb.model is None else rb, model)
    for r in (ra, rb):
        r.check_model(info)  # refuses a recipe fitted for another model, naming the field
    if context is None:  # 4096, or the model's positions where they are fewer
        context = min(DEFAULT_CONTEXT, info.max_positions) if info.max_positions else DEFAULT_CONTEXT
    check_context(context, info)
    la, lb = ra.layer_configs(info.num_layers), rb.layer_configs(info.num_layers)
    bits_a, bits_b = _layer_bits(ra, info, context), _layer_bits(rb, info, context)
    layers: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for i, (ca, cb) in enumerate(zip(la, lb)):
        changes: dict[str, Any] = {}
        for name in _LAYER_FIELDS:
            va, vb = getattr(ca, name), getattr(cb, name)
            if va != vb:
                changes[name] = [va, vb]
        fa, fb = _fitted(ra, i), _fitted(rb, i)
        if fa != fb:
            changes["fitted"] = [fa, fb]
        if not changes:
            continue
        for name in changes:
            counts[name] = counts.get(name, 0) + 1
        layers.append({"layer": i, "changes": changes, "effective_bits": [bits_a[i], bits_b[i]]})
    mem_a, mem_b = ra.memory(info, context), rb.memory(info, context)
    prov_keys = sorted(k for k in set(ra.provenance) | set(rb.provenance)
                       if ra.provenance.get(k) != rb.provenance.get(k))
    return {
        "a": {"name": ra.name, "model": ra.model.name if ra.model else None, "effective_bits": mem_a.effective_bits,
              "compression_ratio": mem_a.compression_ratio, "total_bytes": mem_a.total_bytes,
              "origin": provenance_summary(ra.provenance)},
        "b": {"name": rb.name, "model": rb.model.name if rb.model else None, "effective_bits": mem_b.effective_bits,
              "compression_ratio": mem_b.compression_ratio, "total_bytes": mem_b.total_bytes,
              "origin": provenance_summary(rb.provenance)},
        "accounting": ACCOUNTING,
        "model": info.name,
        "context": context,
        "num_layers": info.num_layers,
        "layers": layers,
        "summary": {"differing_layers": len(layers), "identical_layers": info.num_layers - len(layers),
                    "fields": counts, "effective_bits_delta": mem_b.effective_bits - mem_a.effective_bits,
                    "provenance_differs": {k: [ra.provenance.get(k), rb.provenance.get(k)] for k in prov_keys}},
    }
