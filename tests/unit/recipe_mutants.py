"""Recipe mutants for the fuzz (``test_recipe_fuzz.py``) and ``scripts/fuzz_recipes.py``.

Small fitted recipes of a tiny 2-layer llama (4 query heads, 2 kv heads, head_dim 16), one per
method and layout, are mutated in memory -- their JSON document (a key deleted, a value replaced
or nudged, a layer entry added, dropped or swapped, a key added) and their tensors (dropped,
renamed to another layer / side / kind, copied across recipes, reshaped, cast, values edited) --
and :func:`judge` says what each mutant became:

- ``refused``: :meth:`Recipe.from_document` (what loading a file runs) raised :class:`RecipeError`;
- ``refused_for_model``: it loaded, and the tiny model refused it (``check_model``);
- ``working``: it loaded, its memory accounting is finite and positive at two contexts,
  ``inspect`` (at the context the provenance records, as ``kvcalib inspect`` runs it) reports the
  same memory, a context and windows within the model's positions, its method lines and origin,
  and serialises to JSON, and a cache built from it runs a prompt and one decode step through the
  reference path (bf16 model: full-precision segments take the 16 bits the accounting counts)
  with finite logits, holding exactly the bytes the accounting counts at that length (the fitted
  tensors, amortised apart, aside).

The provenance and its method records (a search's context and budget, Huffman's bits per symbol
and stream layout) are mutated too: they are informational, not validated on load, and
``inspect`` must show whatever shape they take.

Anything else (another exception, a NaN, a disagreement) is a failure the fuzz reports.
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from kvcalib.errors import RecipeError
from kvcalib.layout import LayerConfig
from kvcalib.models import ModelInfo, model_info
from kvcalib.recipe import Recipe

PROMPT_LEN = 40  # > sinks + window + group of every base recipe: blocks flush, tiers are reached

JSON_VALUES: tuple[Any, ...] = (None, True, False, 0, 1, -1, 2, 3, 4, 8, 16, 32, 64, 128, 2.0, 0.5, -3, 10**9, "",
                                "x", "channel", "token", "llama", [], {}, [None], [None, None], [1, 2], [8, 8, 8],
                                4_096_000, 2**31, 2**63, 1e-30, float("nan"), {"v": 3}, {"k": [1.5], "v": "x"})
TENSOR_KINDS = ("clip", "perm", "center", "center_gain", "outlier_pool", "outlier_gain", "schedule", "huffman",
                "huffman_hist", "equalize")
DTYPES = (torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool)
ELEMENT_VALUES = (0, -1, 1, 2, 3, 0.5, 0.999, 1.5, 255, 17, 1e30, -1e30, float("nan"), float("inf"), 1e-30, 1e-4)
# what a search records (kvcalib.optimize.search_provenance), informational: mutated like the rest
SEARCH_PROVENANCE = {"made_by": "fuzz", "kvcalib_version": "0", "data": "embedded", "samples": 6, "seq_len": 64,
                     "seed": 0, "objective": "decode-faithful KL", "objective_value": 0.01, "effective_bits": 3.5,
                     "trial": 3, "trials": 8, "budget_bits": 4.0, "context": 256, "schedule": "none"}


def tiny_setup():
    """(model, info, stats) of the tiny llama the base recipes are fitted for."""
    from kvcalib.collection import collect_stats
    from tests.conftest import tiny_model

    model = tiny_model("llama", heads=4, kv_heads=2, head_dim=16)
    info = model_info(model.config, "tiny-llama")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (64,), generator=g) for _ in range(6)]
    stats = collect_stats(model, seqs, reservoir_blocks=4, block_len=32, name="tiny-llama", progress=False)
    return model.to(torch.bfloat16), info, stats


def base_recipes(info: ModelInfo, stats) -> dict[str, Recipe]:
    """One recipe per method and layout, fitted on ``stats``, and a model-agnostic preset."""
    from kvcalib.calibrate import finish_recipe, fit_stats
    from kvcalib.methods.schedule import ScheduleMethod

    def fitted(name: str, configs: list[LayerConfig], methods: list) -> Recipe:
        tensors = fit_stats(stats, configs, methods=[m for m in methods if m != "huffman"], seed=0)
        recipe = Recipe(name=name, layers=configs, model=info, tensors=tensors, provenance=dict(SEARCH_PROVENANCE))
        if "huffman" in methods:
            from kvcalib.methods.huffman import HuffmanMethod

            recipe = finish_recipe(recipe, stats, [HuffmanMethod(store_histograms=True)])
        return recipe.validate()

    kivi = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, sinks=2, window=8)
    token = LayerConfig(k_bits=4, v_bits=4, k_axis="token", k_group=8, v_group=8, window=0)
    tiered = LayerConfig(k_bits=8, v_bits=4, k_group=8, v_group=8, sinks=4, window=8)
    coded = LayerConfig(k_bits=4, v_bits=4, k_group=8, v_group=8, window=8)
    mixed = [LayerConfig(), LayerConfig(k_bits=2, v_bits=8, k_group=8, v_group=8, window=16)]
    n = info.num_layers
    return {
        "methods": fitted("methods", [kivi] * n, ["center", "reorder", "clip", "outliers"]),
        "token-axis": fitted("token-axis", [token] * n, ["reorder", "clip"]),
        "schedule": fitted("schedule", [tiered] * n, [ScheduleMethod(ages=(16, 32))]),
        "huffman": fitted("huffman", [coded] * n, ["clip", "huffman"]),
        "mixed": fitted("mixed", mixed, ["clip"]),
        "preset": Recipe(name="preset", default_layer=kivi, provenance=dict(SEARCH_PROVENANCE)).validate(),
    }


# ---------------------------------------------------------------------------------- mutation
@dataclass
class Mutant:
    doc: Any  # the recipe's JSON document
    tensors: dict[str, torch.Tensor]
    ops: list[str]  # what was done, for the failure message

    def save(self, path) -> None:
        """Write it as a recipe file (the on-disk sample of the fuzz)."""
        from safetensors.torch import save_file

        from kvcalib.recipe import METADATA_KEY

        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path),
                  metadata={METADATA_KEY: json.dumps(self.doc)})


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every (key path) inside the document, dict keys and list indices alike."""
    out = []
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return out
    for key, child in items:
        out.append(prefix + (key,))
        out.extend(_paths(child, prefix + (key,)))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    node = doc
    for key in path[:-1]:
        node = node[key]
    return node


def _nudge(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return rng.choice(JSON_VALUES)
    return rng.choice([value + 1, value - 1, value * 2, value // 2 if isinstance(value, int) else value / 2, -value, 0,
                       float(value)])


def _mutate_doc(doc: dict, rng: random.Random) -> str:
    paths = _paths(doc)
    # 40% of the edits go to the fields that shape the cache (model geometry, layer entries), 30% to
    # the provenance (informational: a search's context and budget, a method's record), the rest anywhere
    shaping = [p for p in paths if p[0] in ("model", "layers", "default_layer") and len(p) >= 2]
    informational = [p for p in paths if p[0] == "provenance" and len(p) >= 2]
    draw = rng.random()
    pool = shaping if shaping and draw < 0.4 else informational if informational and draw < 0.7 else paths
    path = rng.choice(pool)
    parent, key = _parent(doc, path), path[-1]
    op = rng.choice(("delete", "replace", "nudge", "nudge", "add_key", "layers"))
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = copy.deepcopy(rng.choice(JSON_VALUES))
    elif op == "nudge":
        parent[key] = _nudge(parent[key], rng)
    elif op == "add_key":
        layers = doc.get("layers") if isinstance(doc.get("layers"), list) else []
        prov = doc.get("provenance")
        target = rng.choice([d for d in [doc, doc.get("model"), doc.get("default_layer"), *layers, prov,
                                         *(prov.values() if isinstance(prov, dict) else ())]
                             if isinstance(d, dict)])
        target[rng.choice(("extra", "window", "k_bits", "sliding_window", "layers", "sinks", "context", "huffman",
                           "bits_per_symbol", "layout"))] = copy.deepcopy(rng.choice(JSON_VALUES))
    else:
        layers = doc.get("layers")
        if not isinstance(layers, list) or not layers:
            return _mutate_doc(doc, rng)
        kind = rng.choice(("duplicate", "drop", "swap"))
        if kind == "duplicate":
            layers.append(copy.deepcopy(rng.choice(layers)))
        elif kind == "drop":
            layers.pop(rng.randrange(len(layers)))
        else:
            i, j = rng.randrange(len(layers)), rng.randrange(len(layers))
            layers[i], layers[j] = layers[j], layers[i]
        return f"doc:layers-{kind}"
    return f"doc:{op}:{'.'.join(map(str, path))}"


def _rename(name: str, rng: random.Random) -> str:
    parts = name.split(".")
    what = rng.choice(("layer", "side", "kind"))
    if what == "layer":
        parts[1] = rng.choice(("0", "1", "2", "01", "99", "x", "-1", "²"))
    elif what == "side":
        parts[2] = rng.choice(("k", "v", "kv", "q"))
    else:
        parts[3] = rng.choice(TENSOR_KINDS)
    return ".".join(parts)


def _edit_values(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    t = t.clone()
    if t.numel() == 0:
        return t
    flat = t.reshape(-1)
    if rng.random() < 0.3 and flat.numel() > 1:  # swap two entries (a permutation stays one, mostly)
        i, j = rng.randrange(flat.numel()), rng.randrange(flat.numel())
        flat[i], flat[j] = flat[j].clone(), flat[i].clone()
        return t
    value = rng.choice(ELEMENT_VALUES)
    if not t.is_floating_point() and (isinstance(value, float) and not math.isfinite(value)):
        value = -7
    try:
        if rng.random() < 0.2:
            flat.fill_(value)
        else:
            flat[rng.randrange(flat.numel())] = value
    except (RuntimeError, OverflowError):  # a value the dtype cannot hold: the nearest it can
        flat[rng.randrange(flat.numel())] = 1
    return t


def _reshape(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    kind = rng.choice(("flatten", "unsqueeze", "drop_row", "repeat_row", "transpose", "scalar", "empty"))
    if kind == "flatten":
        return t.reshape(-1)
    if kind == "unsqueeze":
        return t.unsqueeze(rng.randrange(t.dim() + 1))
    if kind == "drop_row" and t.dim() and t.shape[0] > 1:
        return t[:-1]
    if kind == "repeat_row" and t.dim():
        return torch.cat([t, t[:1]])
    if kind == "transpose" and t.dim() >= 2:
        return t.transpose(0, 1)
    if kind == "scalar" and t.numel():
        return t.reshape(-1)[0].clone()
    if kind == "empty":
        return t.reshape(-1)[:0]
    return t.reshape(-1)


def _mutate_tensors(tensors: dict[str, torch.Tensor], pool: list[tuple[str, torch.Tensor]],
                    rng: random.Random) -> str:
    op = rng.choice(("drop", "rename", "copy", "reshape", "dtype", "values", "values"))
    if op == "copy" or not tensors:  # a tensor of another recipe, under its own name or one of ours
        name, t = rng.choice(pool)
        if tensors and rng.random() < 0.5:
            name = rng.choice(list(tensors))
        tensors[name] = t.clone()
        return f"tensor:copy:{name}"
    name = rng.choice(sorted(tensors))
    t = tensors[name]
    if op == "drop":
        del tensors[name]
    elif op == "rename":
        del tensors[name]
        name = _rename(name, rng)
        tensors[name] = t
    elif op == "reshape":
        tensors[name] = _reshape(t, rng).contiguous()
    elif op == "dtype":
        tensors[name] = t.to(rng.choice(DTYPES))
    else:
        tensors[name] = _edit_values(t, rng)
    return f"tensor:{op}:{name}"


def mutate(base: Recipe, seed: int, n_ops: int, pool: list[tuple[str, torch.Tensor]]) -> Mutant:
    """``base`` with ``n_ops`` random edits (seeded), to its document or its tensors."""
    rng = random.Random(seed)
    doc = json.loads(json.dumps(base.metadata()))
    tensors = {k: v.clone() for k, v in base.tensors.items()}
    ops = []
    for _ in range(n_ops):
        if rng.random() < 0.5:
            ops.append(_mutate_doc(doc, rng))
        else:
            ops.append(_mutate_tensors(tensors, pool, rng))
    return Mutant(doc, tensors, ops)


# ---------------------------------------------------------------------------------- judging
def decode_step(model, recipe: Recipe, ids: torch.Tensor):
    """(logits (1, V), cache) of one decode step after a ``PROMPT_LEN``-token prompt, through a
    cache built from ``recipe`` (the reference path on CPU)."""
    from kvcalib.runtime.cache import CompressedCache

    cache = CompressedCache.from_recipe(model, recipe)
    with torch.no_grad():
        model(input_ids=ids[:, :PROMPT_LEN], past_key_values=cache, use_cache=True)
        out = model(input_ids=ids[:, PROMPT_LEN:PROMPT_LEN + 1], past_key_values=cache, use_cache=True)
    return out.logits[:, -1], cache


def judge(mutant: Mutant, model, info: ModelInfo, ids: torch.Tensor) -> str:
    """``refused``, ``refused_for_model`` or ``working`` (module docstring); raises an
    AssertionError naming the mutant's edits for anything else."""
    from kvcalib.inspect import inspect_recipe, method_lines

    try:
        recipe = Recipe.from_document(mutant.doc, mutant.tensors, "mutant")
    except RecipeError:
        return "refused"
    try:
        recipe.check_model(info)
    except RecipeError:
        return "refused_for_model"
    try:
        for context in (PROMPT_LEN, 4096):
            mem = recipe.memory(info, context)
            assert math.isfinite(mem.effective_bits) and mem.effective_bits > 0, (context, mem)
            assert all(v >= 0 for v in mem.components.values()), mem.components
        report = inspect_recipe(recipe, model=info)  # as `kvcalib inspect R`: the context the provenance records
        context = report["context"]
        assert 1 <= context <= info.max_positions, ("context beyond the model's positions", context)
        assert all(r["sinks"] + r["window"] <= info.max_positions for r in report["layers"]), "window beyond positions"
        assert report["memory"]["effective_bits"] == recipe.memory(info, context).effective_bits
        json.dumps(report)
        method_lines(report)  # the lines `kvcalib inspect` prints from the methods' sections
        assert all(isinstance(label, str) and isinstance(value, str) for label, value in report["origin"])
        logits, cache = decode_step(model, recipe, ids)
        assert bool(torch.isfinite(logits).all()), "non-finite logits"
        # the fixed window buffer's free slots are allocation slack, reported apart (runtime/cache.py)
        held = sum(v for k, v in cache.nbytes().items() if k not in ("padding_mask", "window_free"))
        counted = recipe.memory(info, PROMPT_LEN + 1).components
        assert held == sum(v for k, v in counted.items() if k != "recipe_state"), (cache.nbytes(), counted)
    except Exception as err:
        raise AssertionError(f"a mutant loaded but does not work ({type(err).__name__}: {err}); "
                             f"edits: {mutant.ops}") from err
    return "working"
