"""Huffman-coded snapshots of a :class:`~kvcalib.runtime.cache.CompressedCache`: the storage tier.

Decoding Huffman inside attention costs more than it saves on the GPU (the fused kernel is
~3.7x slower than the fixed-width one, ``artifacts/bench/huffman.md``). So the cache keeps its
fixed-width packed codes for attention, and entropy coding is used where bytes cost more than
compute: offloading a cache to host memory or disk, or moving it to another machine. Issue 7:
"keep entropy coding as a storage tier (offload/transfer)".

Snapshot
--------
:func:`encode_cache` reads a cache through its public layer attributes (sinks, pending window, rows
of a padded batch, outlier pools, and every :class:`~kvcalib.runtime.store.PackedStore` part) and
returns a :class:`CodedCache`: a JSON-able ``document`` and a flat dict of ``tensors``, all on
the CPU. For every layer and side with a codebook (``layers.{i}.{k|v}.huffman`` in the recipe,
or passed in), each store's packed code plane ``uint8 (B, H, N, D * bits / 8)`` is unpacked to
symbols ``uint8 (B, H, N, D)`` and coded in the cache stream layout of
:mod:`kvcalib.methods.huffman` (:class:`~kvcalib.quant.huffman.CacheStreams`: word
aligned chunks, an int32 chunk word per chunk, a uint8/int16 excess per stream, and the raw
fallback per stream where coding would not shrink it). A side whose coded bytes (payload, index
and codebook) would not be smaller than its packed bytes stays packed (``side_fallback``).
Everything else is carried as it is: scales, zeros, means, OTT masks and pools, the
full-precision sinks and window, sides without a codebook, 16-bit sides.

:func:`decode_cache` rebuilds the cache, bit for bit: every packed part, every full-precision
tensor and every counter equal the original, so attention and later decoding steps give
identical outputs (``torch.equal``). It needs the recipe (for the codecs: clip, permutation,
centering); the snapshot holds a fingerprint of the recipe's codec state and of the layer
configs, and refuses another recipe.

A padded batch's layer keeps one unpadded layer per row (:mod:`kvcalib.runtime.cache`): its
snapshot holds each row as a layer of batch 1 (``rows`` in the document, with the rows' absolute
first and end positions), under ``layers.{i}.rows.{b}``.

Tensors (names in the file; ``i`` layer, ``j`` store (PATS tier), ``s`` side)::

    codebooks.{i}.{s}                           uint8 (2**bits,) code lengths (coded sides only)
    layers.{i}.sink_k | sink_v                  (B, H, S, D) cache dtype
    layers.{i}.pend_k | pend_v                  (B, H, U, D) cache dtype (the full-precision window)
    layers.{i}.rows.{b}.<any name above>        a padded (ragged) layer: the same per batch row, B = 1
    layers.{i}.outliers.{field}                 OTT pools (OutlierState fields), only with OTT
    layers.{i}.stores.{j}.{part}                a PackedStore part carried as is (live tokens)
    layers.{i}.stores.{j}.{s}_codes.payload       uint32 (W,)     coded code plane: CacheStreams
    layers.{i}.stores.{j}.{s}_codes.chunk_word    int32 (B, H, C)
    layers.{i}.stores.{j}.{s}_codes.stream_excess uint8|int16 (B, H, N / tokens_per_stream)

Bytes: :meth:`CodedCache.nbytes` counts every tensor of the snapshot under the keys of
:meth:`CompressedCache.nbytes` (``sinks``, ``window``, ``k_packed`` (uncoded code planes and raw
sides), ``k_scales``, ...) plus ``{s}_huffman_payload`` (with word padding and guard words),
``{s}_huffman_index`` (chunk words and stream excess) and ``codebooks``; the sum is exactly the
tensor bytes of the file :func:`save_coded` writes. ``document["packed_nbytes"]`` keeps the
cache's own ``nbytes()`` at snapshot time, so the two sit side by side (:meth:`CodedCache.summary`).
The file adds a header (the document and safetensors' tensor table), not counted in ``nbytes``.

File: :func:`save_coded` writes one safetensors file atomically (temporary name, then rename),
with a CRC-32 per tensor in the metadata. :func:`load_coded` checks the structure first
(format, every tensor present with the dtype and shape the document implies, codebook lengths a
complete prefix code, chunk words and stream lengths inside the payload) and then the CRCs, so a
corrupt file raises :class:`~kvcalib.errors.KvcalibError` or
:class:`~kvcalib.quant.huffman.HuffmanError` naming the problem, never a wrong answer or a hang.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from kvcalib.errors import KvcalibError
from kvcalib.io import read_safetensors_document
from kvcalib.methods import get as _method
from kvcalib.quant.huffman import (DEFAULT_MAX_LEN, CacheStreams, Codebook, HuffmanError, StreamLayout,
                                   decode_cache_streams, encode_cache_streams)
from kvcalib.quant.pools import POS_DTYPE, OutlierState
from kvcalib.quant.packing import SUPPORTED_BITS, pack_codes, unpack_codes
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe, resolve_recipe
from kvcalib.runtime.cache import CompressedCache, CompressedLayer

__all__ = ["FORMAT", "FORMAT_VERSION", "CodedCache", "decode_cache", "encode_cache", "load_coded",
           "recipe_fingerprint", "save_coded"]

FORMAT = "kvcalib-coded-cache"
FORMAT_VERSION = 1
METADATA_KEY = "kvcalib_coded_cache"  # safetensors metadata entry holding the JSON document
SIDES = ("k", "v")
Key = tuple[int, str]  # (layer, side) of a codebook
STREAM_FIELDS = ("payload", "chunk_word", "stream_excess")  # CacheStreams tensors of a coded side
LAYER_TENSORS = ("sink_k", "sink_v", "pend_k", "pend_v")
OUTLIER_FIELDS = ("pool_k", "pool_v", "pool_pos", "extra_k", "extra_v", "extra_pos", "extra_count", "tracking")
# PackedStore parts (kvcalib.runtime.store) this format knows; a new part must be added here
STORE_PARTS = ("k_codes", "k_scale", "k_zero", "k_raw", "v_codes", "v_scale", "v_zero", "v_raw",
               "k_mean", "v_mean", "k_mean_codes", "k_mean_scale", "k_mean_zero",
               "v_mean_codes", "v_mean_scale", "v_mean_zero", "keep")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint32, torch.bool)}


# ----------------------------------------------------------------------------------------------
# small helpers


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise KvcalibError(f"a cache tensor has dtype {dtype}, which coded snapshots do not store")
    return name


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy (the snapshot must not alias the live cache)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _raw_bytes(t: torch.Tensor):
    """The tensor's bytes as a buffer (any dtype, bf16 and bool included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(_raw_bytes(t))


def _units(layer_doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The documents holding a layer's tensors: the layer's own, or one per row of a padded one."""
    return layer_doc["rows"] if layer_doc.get("rows") is not None else [layer_doc]


def _huffman_tensors() -> set[str]:
    """Names of the Huffman method's recipe tensors (code lengths, histograms): the codebooks this
    tier codes with, which the fingerprint leaves out (the codecs do not depend on them)."""
    return {spec.name for spec in _method("huffman").tensors}


def recipe_fingerprint(recipe: Recipe | None, configs: list[LayerConfig]) -> str:
    """A short hash of what the codecs depend on: the layer configs and the recipe's fitted
    tensors (clip, permutation, centering, OTT, schedule), Huffman tensors excluded."""
    h = hashlib.sha256(json.dumps([c.to_dict() for c in configs], sort_keys=True).encode())
    if recipe is not None:
        for name in sorted(recipe.tensors):
            if name.split(".")[-1] in _huffman_tensors():
                continue
            t = recipe.tensors[name]
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(_raw_bytes(t).tobytes())
    return h.hexdigest()[:16]


def _category(name: str) -> str:
    """The :meth:`CodedCache.nbytes` key of a tensor name."""
    parts = name.split(".")
    if parts[0] == "codebooks":
        return "codebooks"
    if parts[2] == "rows":  # layers.i.rows.b.<name>: a padded batch's row, named as a layer's
        parts = parts[:2] + parts[4:]
    if parts[2] in ("sink_k", "sink_v"):
        return "sinks"
    if parts[2] in ("pend_k", "pend_v"):
        return "window"
    if parts[2] == "outliers":
        return "outlier_pool" if parts[3] in ("pool_k", "pool_v", "extra_k", "extra_v") else "outlier_positions"
    part = parts[4]  # layers.i.stores.j.<part>[.field]
    if len(parts) == 6:  # a coded code plane
        return f"{part[0]}_huffman_payload" if parts[5] == "payload" else f"{part[0]}_huffman_index"
    if part == "keep":
        return "outlier_masks"
    side, what = part[0], part[2:]
    if what in ("codes", "raw"):
        return f"{side}_packed"
    if what in ("scale", "zero"):
        return f"{side}_scales"
    return f"{side}_mean"


# ----------------------------------------------------------------------------------------------
# the snapshot


@dataclass(frozen=True, eq=False)
class CodedCache:
    """A Huffman-coded snapshot of a CompressedCache (module docstring).

    Attributes:
        document: JSON-able description: format, recipe fingerprint, stream layout, per layer its
            config, geometry, counters and stores (part shapes, which sides are coded), and the
            cache's own ``nbytes()`` at snapshot time (``packed_nbytes``).
        tensors: every stored tensor by name (CPU, contiguous).

    Construction validates that the tensors are exactly what the document describes (names,
    dtypes, shapes) and that codebooks and coded streams are well formed; it raises
    :class:`KvcalibError` or :class:`HuffmanError` naming the tensor otherwise.
    """

    document: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    _books: dict[Key, Codebook] = field(init=False, repr=False)
    _streams: dict[tuple[str, int, str], CacheStreams] = field(init=False, repr=False)  # (unit prefix, store, side)

    def __post_init__(self) -> None:
        books, streams = _validate(self.document, self.tensors)
        object.__setattr__(self, "_books", books)
        object.__setattr__(self, "_streams", streams)

    @property
    def layout(self) -> StreamLayout:
        lay = self.document["layout"]
        return StreamLayout(lay["tokens_per_stream"], lay["chunk_tokens"])

    def nbytes(self) -> dict[str, int]:
        """Bytes of every stored tensor, by component (keys of ``CompressedCache.nbytes()`` plus
        ``{s}_huffman_payload``, ``{s}_huffman_index`` and ``codebooks``)."""
        out: dict[str, int] = {}
        for name, t in self.tensors.items():
            key = _category(name)
            out[key] = out.get(key, 0) + _nbytes(t)
        return out

    def total_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    def effective_bits(self) -> float:
        """8 x snapshot bytes / K and V elements cached (as ``CompressedCache.effective_bits``)."""
        return 8.0 * self.total_bytes() / max(int(self.document["elements"]), 1)

    def summary(self) -> dict[str, Any]:
        """The snapshot next to the packed cache it came from: bytes, saving, effective bits,
        and the coded sides' code bytes, stream bits and raw-stream fraction."""
        packed = sum(int(v) for v in self.document["packed_nbytes"].values())
        coded = self.total_bytes()
        elements = max(int(self.document["elements"]), 1)
        code_packed = sum(int(c["packed_bytes"]) for layer in self.document["layers"] for unit in _units(layer)
                          for store in unit.get("stores", []) for c in store["coded"].values())
        nb = self.nbytes()
        code_coded = sum(v for k, v in nb.items() if "_huffman_" in k) + nb.get("codebooks", 0)
        symbols = sum(s.stream_excess.numel() * s.n_symbols for s in self._streams.values())
        streams = sum(s.stream_excess.numel() for s in self._streams.values())
        raw = sum(int(s.raw_fallback().sum()) for s in self._streams.values())
        return {
            "bytes_packed": packed, "bytes_coded": coded,
            "saved_pct": round(100.0 * (1 - coded / packed), 3) if packed else 0.0,
            "effective_bits_packed": round(8.0 * packed / elements, 4),
            "effective_bits_coded": round(8.0 * coded / elements, 4),
            "code_bytes_packed": code_packed, "code_bytes_coded": code_coded,
            "code_saved_pct": round(100.0 * (1 - code_coded / code_packed), 3) if code_packed else 0.0,
            "coded_sides": len(self._streams),
            "sides_left_packed": len(self.document.get("left_packed", [])),
            "bits_per_symbol": round(sum(s.stream_bits() for s in self._streams.values()) / symbols, 4)
            if symbols else None,
            "raw_stream_fraction": round(raw / streams, 4) if streams else None,
        }


# ----------------------------------------------------------------------------------------------
# encode


def _codebooks_for(cache: CompressedCache, source: Recipe | str | Mapping[Key, Codebook] | None,
                   ) -> tuple[dict[Key, Codebook], Recipe | None]:
    configs = [layer.cfg for layer in cache.layers]
    if source is None:
        if cache.recipe is None:
            raise KvcalibError("encode_cache needs codebooks: pass the recipe with codebooks "
                               "(kvcalib export --huffman) or a {(layer, side): Codebook} dict")
        source = cache.recipe
    if isinstance(source, Mapping):
        books = dict(source)
        for key, cb in books.items():
            if not isinstance(cb, Codebook):
                raise KvcalibError(f"codebooks[{key!r}] is a {type(cb).__name__}, not a Codebook")
            i, side = key
            if not (0 <= i < len(configs)) or side not in SIDES:
                raise KvcalibError(f"codebooks key {key!r} names no (layer, side) of this {len(configs)}-layer cache")
        return books, cache.recipe
    recipe = resolve_recipe(source)
    return _method("huffman").codebooks(recipe, configs), recipe


def _code_plane(codes: torch.Tensor, bits: int, cb: Codebook, layout: StreamLayout,
                side_fallback: bool) -> CacheStreams | None:
    """Packed codes ``uint8 (B, H, N, D * bits / 8)`` -> CacheStreams, or None to keep them packed."""
    n = codes.shape[2]
    if n == 0 or n % layout.tokens_per_stream:
        return None  # nothing to code, or tokens that do not fill whole streams
    streams = encode_cache_streams(unpack_codes(codes, bits), cb, layout)  # symbols (B, H, N, D)
    if side_fallback and sum(streams.nbytes().values()) + _nbytes(cb.lengths) >= _nbytes(codes):
        return None
    return streams


def _encode_unit(layer: CompressedLayer, i: int, prefix: str, doc: dict[str, Any], tensors: dict[str, torch.Tensor],
                 books: dict[Key, Codebook], layout: StreamLayout, side_fallback: bool, left_packed: list[str],
                 used: set[Key]) -> None:
    """Snapshot one dense layer (a layer, or a padded layer's row) of model layer ``i`` into
    ``doc`` and ``tensors`` (names under ``prefix``)."""
    b, h, s, d = layer.sink_k.shape
    doc.update(dtype=_dtype_name(layer.sink_k.dtype), batch=b, kv_heads=h, head_dim=d, n_seen=layer.n_seen,
               pend_start=layer.pend_start, sinks_dropped=bool(layer.sinks_dropped), sink_len=s,
               pend_len=int(layer.pend_k.shape[2]), outliers=None, stores=[])
    for name in LAYER_TENSORS:
        tensors[f"{prefix}.{name}"] = _host_copy(getattr(layer, name))
    state = layer.outliers.state
    if state is not None:
        doc["outliers"] = {"pool": int(state.pool_k.shape[2]), "extra": int(state.extra_k.shape[2])}
        for name in OUTLIER_FIELDS:
            tensors[f"{prefix}.outliers.{name}"] = _host_copy(getattr(state, name))
    for j, store in enumerate(layer.packed.stores):
        sdoc: dict[str, Any] = {"start": store.start, "n": store.n, "bits": dict(store.bits), "parts": {},
                                "coded": {}}
        doc["stores"].append(sdoc)
        views = {name: buf.view() for name, buf in store.parts.items()}
        unknown = sorted(set(views) - set(STORE_PARTS))
        if unknown:
            raise KvcalibError(f"kvcalib bug: PackedStore part {unknown[0]!r} is unknown to coded snapshots")
        for side in SIDES:
            codes, cb = views.get(f"{side}_codes"), books.get((i, side))
            if codes is None or cb is None:
                continue
            bits = store.bits[side]
            if cb.bits != bits:
                raise KvcalibError(f"the codebook of layer {i} side {side} is for {cb.bits}-bit codes, but store "
                                   f"{j} of that layer holds {bits}-bit codes")
            streams = _code_plane(codes, bits, cb, layout, side_fallback)
            if streams is None:
                left_packed.append(f"{prefix.removeprefix('layers.')}.{j}.{side}")
                continue
            views[f"{side}_codes"] = None
            used.add((i, side))
            sdoc["coded"][side] = {"bits": bits, "packed_bytes": _nbytes(codes)}
            for f in STREAM_FIELDS:
                tensors[f"{prefix}.stores.{j}.{side}_codes.{f}"] = getattr(streams, f)
        for name, view in views.items():
            if view is not None:
                t = _host_copy(view)
                sdoc["parts"][name] = [_dtype_name(t.dtype), list(t.shape)]
                tensors[f"{prefix}.stores.{j}.{name}"] = t


def encode_cache(cache: CompressedCache, codebooks: Recipe | str | Mapping[Key, Codebook] | None = None, *,
                 layout: StreamLayout = StreamLayout(), side_fallback: bool = True) -> CodedCache:
    """Snapshot ``cache`` with its code planes Huffman-coded (module docstring).

    Args:
        cache: a CompressedCache between steps (not halfway through a forward).
        codebooks: a recipe with Huffman tensors (path, preset or Recipe), or
            ``{(layer, side): Codebook}``; default: ``cache.recipe``. Sides without one stay packed.
        layout: stream layout of the coded planes. ``StreamLayout()`` (one token per stream) is
            the layout the GPU decoder reads; longer streams (e.g. ``StreamLayout(32, 32)``)
            need fewer length fields, which suits pure storage.
        side_fallback: keep a side packed when coding would not make it smaller (its payload,
            index and codebook against its packed bytes). False codes every side with a codebook.

    Returns:
        :class:`CodedCache` on the CPU; the cache is not modified.
    """
    if not isinstance(cache, CompressedCache):
        raise KvcalibError(f"encode_cache takes a CompressedCache, got {type(cache).__name__}")
    books, recipe = _codebooks_for(cache, codebooks)
    configs = [layer.cfg for layer in cache.layers]
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    left_packed: list[str] = []
    used: set[Key] = set()
    for i, layer in enumerate(cache.layers):
        if layer.is_initialized and (layer.awaiting_attention or layer.incoming is not None):
            raise KvcalibError(f"layer {i} of the cache was updated but has not run attention yet: snapshot a "
                               "cache between forward passes, not inside one")
        doc: dict[str, Any] = {"config": layer.cfg.to_dict(), "sliding_window": layer.sliding_window,
                               "initialized": bool(layer.is_initialized)}
        layers.append(doc)
        if not layer.is_initialized:
            continue
        if layer.ragged:
            doc.update(n_seen=layer.n_seen, row_first=list(layer.row_first), row_end=list(layer.row_end), rows=[])
            for r, row in enumerate(layer.rows):
                rdoc: dict[str, Any] = {"initialized": bool(row.is_initialized)}
                doc["rows"].append(rdoc)
                if row.is_initialized:
                    _encode_unit(row, i, f"layers.{i}.rows.{r}", rdoc, tensors, books, layout, side_fallback,
                                 left_packed, used)
        else:
            _encode_unit(layer, i, f"layers.{i}", doc, tensors, books, layout, side_fallback, left_packed, used)
    for i, side in sorted(used):
        tensors[f"codebooks.{i}.{side}"] = books[(i, side)].lengths.clone()
    max_len = max([books[k].max_len for k in used], default=DEFAULT_MAX_LEN)
    elements = sum(layer.cached_elements() for layer in cache.layers)
    document = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "recipe": {"name": None if recipe is None else recipe.name,
                   "fingerprint": recipe_fingerprint(recipe, configs)},
        "layout": {"tokens_per_stream": layout.tokens_per_stream, "chunk_tokens": layout.chunk_tokens},
        "max_len": max_len, "elements": elements,
        "packed_nbytes": {k: int(v) for k, v in cache.nbytes().items()},
        "left_packed": left_packed,  # "layer.store.side" with a codebook, kept packed (would not shrink)
        "layers": layers,
    }
    return CodedCache(document, tensors)


# ----------------------------------------------------------------------------------------------
# validation


def _int(x: Any, what: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise KvcalibError(f"the snapshot's document is malformed: {what} must be an integer >= {lo}, got {x!r}")
    return x


def _part_rows(cfg: LayerConfig, part: str, n: int) -> int:
    """Expected size along dim 2 of a store part for ``n`` packed tokens."""
    if part in ("k_scale", "k_zero") and cfg.k_axis == "channel":
        return n // cfg.k_group
    if part == "keep":
        block = cfg.flush_block
        return n // block * ((block + 7) // 8)
    return n


def _check_part(where: str, cfg: LayerConfig, part: str, dtype: str, shape: list, b: int, h: int, d: int,
                n: int, bits: dict[str, int]) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape a store part must have, checked against the layer's geometry."""
    if part not in STORE_PARTS:
        raise KvcalibError(f"{where} is not a PackedStore part this kvcalib knows ({', '.join(STORE_PARTS)})")
    if dtype not in _DTYPES or not isinstance(shape, list) or len(shape) < 3:
        raise KvcalibError(f"the snapshot's document is malformed: {where} has dtype {dtype!r} and shape {shape!r}")
    shape = [_int(x, f"{where} shape") for x in shape]
    heads = 1 if "_mean" in part else h
    if shape[:2] != [b, heads] or shape[2] != _part_rows(cfg, part, n):
        raise KvcalibError(f"{where} has shape {tuple(shape)}, which does not hold {n} packed tokens of batch {b} "
                           f"and {heads} head(s)")
    side = part[0]
    if part == f"{side}_codes" and shape[3:] != [d * bits[side] // 8]:
        raise KvcalibError(f"{where} has shape {tuple(shape)}: {bits[side]}-bit codes of head_dim {d} pack into "
                           f"{d * bits[side] // 8} bytes per token")
    return _DTYPES[dtype], tuple(shape)


def _validate(doc: Any, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[Key, Codebook],
                                                                        dict[tuple[str, int, str], CacheStreams]]:
    """Check ``tensors`` against ``doc``; return the codebooks and coded streams (see CodedCache)."""
    try:
        return _validate_inner(doc, tensors)
    except KvcalibError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise KvcalibError(f"the snapshot's document is malformed ({type(err).__name__}: {err})") from None


def _expect_unit(i: int, prefix: str, cfg: LayerConfig, ld: dict[str, Any], expect: dict, coded: list,
                 book_bits: dict[Key, int]) -> None:
    """The tensors one dense layer's document (``ld``, tensor names under ``prefix``) implies, into
    ``expect``; its coded planes into ``coded``, their bits into ``book_bits``."""
    if ld["dtype"] not in _DTYPES:
        raise KvcalibError(f"the snapshot's document is malformed: {prefix} dtype {ld['dtype']!r}")
    dt = _DTYPES[ld["dtype"]]
    b, h, d = (_int(ld[k], f"{prefix}.{k}", 1) for k in ("batch", "kv_heads", "head_dim"))
    s, u = (_int(ld[k], f"{prefix}.{k}") for k in ("sink_len", "pend_len"))
    _int(ld["n_seen"], f"{prefix}.n_seen")
    _int(ld["pend_start"], f"{prefix}.pend_start")
    for name, length in (("sink_k", s), ("sink_v", s), ("pend_k", u), ("pend_v", u)):
        expect[f"{prefix}.{name}"] = (dt, (b, h, length, d))
    if ld["outliers"] is not None:
        p, e = _int(ld["outliers"]["pool"], "outliers.pool"), _int(ld["outliers"]["extra"], "outliers.extra")
        o = f"{prefix}.outliers"
        expect.update({f"{o}.pool_k": (dt, (b, h, p, d)), f"{o}.pool_v": (dt, (b, h, p, d)),
                       f"{o}.extra_k": (dt, (b, h, e, d)), f"{o}.extra_v": (dt, (b, h, e, d)),
                       f"{o}.pool_pos": (POS_DTYPE, (b, h, p)), f"{o}.extra_pos": (POS_DTYPE, (b, h, e)),
                       f"{o}.extra_count": (torch.int64, (b, h)), f"{o}.tracking": (torch.bool, (b, h))})
    for j, sd in enumerate(ld["stores"]):
        n = _int(sd["n"], f"{prefix}.stores[{j}].n")
        _int(sd["start"], f"{prefix}.stores[{j}].start")
        bits = {side: _int(sd["bits"][side], f"{prefix}.stores[{j}].bits.{side}", 1) for side in SIDES}
        sp = f"{prefix}.stores.{j}"
        for part, (dtype, shape) in sd["parts"].items():
            expect[f"{sp}.{part}"] = _check_part(f"tensor {sp}.{part}", cfg, part, dtype, shape, b, h, d, n, bits)
        for side, cd in sd["coded"].items():
            if side not in SIDES or f"{side}_codes" in sd["parts"] or cd["bits"] != bits[side] \
                    or bits[side] not in SUPPORTED_BITS:
                raise KvcalibError(f"the snapshot's document is malformed: {prefix} store {j} codes side "
                                   f"{side!r} at {cd.get('bits')!r} bits (store bits {bits})")
            _int(cd["packed_bytes"], "packed_bytes")
            if book_bits.setdefault((i, side), bits[side]) != bits[side]:
                raise KvcalibError(f"layer {i} side {side}: stores coded at different bits share one codebook")
            coded.append((prefix, j, side, (b, h, n, d), bits[side]))
            for f in STREAM_FIELDS:
                expect[f"{sp}.{side}_codes.{f}"] = (None, None)  # type: ignore[assignment]


def _validate_inner(doc: Any, tensors: Mapping[str, torch.Tensor]):
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise KvcalibError(f"not a coded cache snapshot: format is {got!r}, expected {FORMAT!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise KvcalibError(f"coded cache snapshot version {doc.get('version')!r}; this kvcalib reads version "
                           f"{FORMAT_VERSION}: re-create the snapshot")
    if not isinstance(tensors, Mapping) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise KvcalibError("tensors must map names to torch.Tensors")
    lay = doc["layout"]
    try:
        layout = StreamLayout(lay["tokens_per_stream"], lay["chunk_tokens"])
    except ValueError as err:
        raise KvcalibError(f"the snapshot's stream layout is invalid: {err}") from None
    max_len = _int(doc["max_len"], "max_len", 1)
    _int(doc["elements"], "elements")
    if not isinstance(doc["packed_nbytes"], dict) or not isinstance(doc["layers"], list):
        raise KvcalibError("the snapshot's document is malformed: packed_nbytes must be an object, layers a list")
    expect: dict[str, tuple[torch.dtype, tuple[int, ...] | None]] = {}  # None shape: checked by CacheStreams
    coded: list[tuple[str, int, str, tuple[int, int, int, int], int]] = []  # (prefix, store, side, ...)
    book_bits: dict[Key, int] = {}
    for i, ld in enumerate(doc["layers"]):
        cfg = LayerConfig.from_dict(ld["config"], f"layers[{i}].config")
        if not ld["initialized"]:
            continue
        if ld.get("padding"):
            raise KvcalibError("the snapshot holds a padded batch in the layout of an older kvcalib (a padding mask); "
                               "this kvcalib keeps padded rows apart: re-create the snapshot")
        units = [(f"layers.{i}", ld)]
        if ld.get("rows") is not None:
            _int(ld["n_seen"], f"layers[{i}].n_seen")
            if not isinstance(ld["rows"], list) or len(ld["row_first"]) != len(ld["rows"]) \
                    or len(ld["row_end"]) != len(ld["rows"]):
                raise KvcalibError(f"the snapshot's document is malformed: layer {i} rows, row_first and row_end "
                                   "must be lists of one length")
            for r, (first, end) in enumerate(zip(ld["row_first"], ld["row_end"])):
                if first is not None:
                    _int(first, f"layers[{i}].row_first[{r}]")
                _int(end, f"layers[{i}].row_end[{r}]")
            units = [(f"layers.{i}.rows.{r}", rd) for r, rd in enumerate(ld["rows"]) if rd["initialized"]]
        for prefix, ud in units:
            _expect_unit(i, prefix, cfg, ud, expect, coded, book_bits)
    for (i, side), bits in book_bits.items():
        expect[f"codebooks.{i}.{side}"] = (torch.uint8, (1 << bits,))
    missing = sorted(set(expect) - set(tensors))
    if missing:
        raise KvcalibError(f"tensor {missing[0]} is missing ({len(missing)} missing): truncated or edited snapshot")
    unknown = sorted(set(tensors) - set(expect))
    if unknown:
        raise KvcalibError(f"tensor {unknown[0]} is not part of the snapshot its document describes "
                           f"({len(unknown)} unknown)")
    for name, (dtype, shape) in expect.items():
        t = tensors[name]
        if dtype is not None and (t.dtype != dtype or tuple(t.shape) != shape):
            raise KvcalibError(f"tensor {name} is {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}, but the "
                               f"document says {str(dtype).removeprefix('torch.')} {shape} (shape mismatch)")
    books: dict[Key, Codebook] = {}
    for (i, side) in book_bits:
        name = f"codebooks.{i}.{side}"
        try:
            books[(i, side)] = Codebook.from_lengths(tensors[name], max_len=max_len)
        except HuffmanError as err:
            raise HuffmanError(f"tensor {name}: {err}") from None
    streams: dict[tuple[str, int, str], CacheStreams] = {}
    for unit, j, side, shape, bits in coded:
        prefix = f"{unit}.stores.{j}.{side}_codes"
        try:
            streams[(unit, j, side)] = CacheStreams(*(tensors[f"{prefix}.{f}"] for f in STREAM_FIELDS),
                                                 shape=shape, bits=bits, layout=layout)
        except HuffmanError as err:
            raise HuffmanError(f"coded plane {prefix}: {err}") from None
    return books, streams


# ----------------------------------------------------------------------------------------------
# decode


def decode_cache(coded: CodedCache, recipe: Recipe | str | None = None, *, into: CompressedCache | None = None,
                 device: str | torch.device = "cpu") -> CompressedCache:
    """Rebuild the CompressedCache a snapshot was made from, bit for bit.

    Args:
        coded: from :func:`encode_cache` or :func:`load_coded`.
        recipe: the recipe the cache was built with (path, preset or Recipe); it supplies the
            codecs. May be omitted when ``into`` is given.
        into: an empty cache to fill (e.g. ``CompressedCache.from_recipe(model, recipe)``, which
            also switches the model's attention); default: a new cache from ``recipe``.
        device: where the restored tensors go.

    Raises:
        KvcalibError: the recipe or ``into`` does not match the snapshot (layer configs, codec
            fingerprint, layer count), or ``into`` already holds tokens.
        HuffmanError: a coded plane does not decode (corrupt streams).
    """
    if not isinstance(coded, CodedCache):
        raise KvcalibError(f"decode_cache takes a CodedCache, got {type(coded).__name__}")
    doc = coded.document
    n_layers = len(doc["layers"])
    if into is None:
        if recipe is None:
            raise KvcalibError("decode_cache needs the recipe the snapshot was made with (recipe=...), or an empty "
                               "cache built from it (into=...)")
        recipe = resolve_recipe(recipe)
        from kvcalib.recipe import build_codecs

        configs = recipe.layer_configs(n_layers)
        head_dim = next((u["head_dim"] for ld in doc["layers"] if ld["initialized"] for u in _units(ld)
                         if u["initialized"]), None)
        into = CompressedCache(configs, build_codecs(recipe, configs, head_dim),
                               [ld["sliding_window"] for ld in doc["layers"]], recipe)
    else:
        if not isinstance(into, CompressedCache):
            raise KvcalibError(f"into must be a CompressedCache, got {type(into).__name__}")
        if len(into.layers) != n_layers:
            raise KvcalibError(f"the snapshot has {n_layers} layers but the cache to fill has {len(into.layers)}")
        if any(layer.is_initialized for layer in into.layers):
            raise KvcalibError("the cache to fill already holds tokens: pass a fresh cache")
        recipe = resolve_recipe(recipe) if recipe is not None else into.recipe
    configs = [layer.cfg for layer in into.layers]
    fp = recipe_fingerprint(recipe, configs)
    want = doc["recipe"]["fingerprint"]
    if fp != want:
        raise KvcalibError(f"the snapshot was made with recipe {doc['recipe']['name']!r} (codec fingerprint {want}), "
                           f"but decoding uses {getattr(recipe, 'name', None)!r} (fingerprint {fp}): layer configs or "
                           "fitted tensors differ; decode with the recipe the cache was built with")
    for i, (layer, ld) in enumerate(zip(into.layers, doc["layers"])):
        if layer.cfg.to_dict() != ld["config"] or layer.sliding_window != ld["sliding_window"]:
            raise KvcalibError(f"layer {i}: the cache to fill has config {layer.cfg} / sliding window "
                               f"{layer.sliding_window}, the snapshot {ld['config']} / {ld['sliding_window']}")
        if ld["initialized"]:
            _restore_layer(coded, i, layer, ld, torch.device(device))
    return into


def _restore_layer(coded: CodedCache, i: int, layer: CompressedLayer, ld: dict[str, Any], device: torch.device) -> None:
    if ld.get("rows") is None:
        _restore_unit(coded, i, f"layers.{i}", layer, ld, device)
        return
    from kvcalib.runtime.cache import CompressedLayer as Layer

    layer.rows = []
    for r, rd in enumerate(ld["rows"]):
        row = Layer(layer.cfg, layer.codec, layer.layer_idx, layer.sliding_window)
        if rd["initialized"]:
            _restore_unit(coded, i, f"layers.{i}.rows.{r}", row, rd, device)
        layer.rows.append(row)
    layer.row_first, layer.row_end = list(ld["row_first"]), list(ld["row_end"])
    layer.chunk_rows, layer.chunk_len = [None] * len(layer.rows), 0
    first = next(row for row in layer.rows if row.is_initialized)
    layer.dtype, layer.device = first.dtype, device
    _, h, _, d = first.sink_k.shape
    layer.sink_k = layer.sink_v = layer.pend_k = layer.pend_v = first.sink_k.new_zeros((len(layer.rows), h, 0, d))
    layer.n_seen = ld["n_seen"]
    layer.awaiting_attention = False
    layer.is_initialized = True


def _restore_unit(coded: CodedCache, i: int, prefix: str, layer: CompressedLayer, ld: dict[str, Any],
                  device: torch.device) -> None:
    """Fill the empty dense ``layer`` from its document ``ld`` (tensors under ``prefix``)."""
    t = coded.tensors

    def put(name: str) -> torch.Tensor:
        return t[name].to(device=device, copy=True)

    if len(layer.packed.stores) != len(ld["stores"]):
        raise KvcalibError(f"layer {i}: the snapshot has {len(ld['stores'])} packed store(s) (PATS tiers), the "
                           f"recipe's codec {len(layer.packed.stores)}")
    pool = 0 if ld["outliers"] is None else ld["outliers"]["pool"]
    if ld["outliers"] is not None and layer.outliers.pool_size != pool:
        raise KvcalibError(f"layer {i}: the snapshot has an outlier pool of {pool}, the recipe "
                           f"{layer.outliers.pool_size}")
    layer.dtype, layer.device = _DTYPES[ld["dtype"]], device
    for name in LAYER_TENSORS:
        setattr(layer, name, put(f"{prefix}.{name}"))
    if ld["outliers"] is not None:
        layer.outliers.state = OutlierState(**{f: put(f"{prefix}.outliers.{f}") for f in OUTLIER_FIELDS})
    for j, (store, sd) in enumerate(zip(layer.packed.stores, ld["stores"])):
        if store.bits != sd["bits"]:
            raise KvcalibError(f"layer {i} store {j}: the snapshot holds {sd['bits']} bits, the recipe's codec "
                               f"{store.bits}")
        for part in sd["parts"]:
            store.parts[part].append(t[f"{prefix}.stores.{j}.{part}"].to(device))  # append copies
        for side, cd in sd["coded"].items():
            symbols = decode_cache_streams(coded._streams[(prefix, j, side)], coded._books[(i, side)])  # (B, H, N, D)
            store.parts[f"{side}_codes"].append(pack_codes(symbols, cd["bits"]).to(device))
        store.start, store.n = sd["start"], sd["n"]
    layer.n_seen, layer.pend_start, layer.sinks_dropped = ld["n_seen"], ld["pend_start"], ld["sinks_dropped"]
    layer.awaiting_attention = False
    layer.is_initialized = True


# ----------------------------------------------------------------------------------------------
# file


def save_coded(path: Path | str, coded: CodedCache) -> Path:
    """Write ``coded`` to one safetensors file atomically (temporary name, then rename), with a
    CRC-32 of every tensor in its metadata. Returns the path."""
    from safetensors.torch import save_file

    from kvcalib.io import atomic_path

    if not isinstance(coded, CodedCache):
        raise KvcalibError(f"save_coded takes a CodedCache, got {type(coded).__name__}")
    path = Path(path)
    tensors = {k: v.contiguous() for k, v in coded.tensors.items()}
    doc = dict(coded.document, crc32={k: _crc32(v) for k, v in tensors.items()})
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(doc)})
    return path


def load_coded(path: Path | str) -> CodedCache:
    """Read a file written by :func:`save_coded`, checking its structure and every tensor's CRC.

    Raises:
        KvcalibError: missing, truncated or unreadable file, not a snapshot, malformed document,
            a tensor missing, unknown or of the wrong dtype/shape, or a CRC mismatch.
        HuffmanError: codebook lengths that are not a complete prefix code, or coded streams
            whose chunk words or lengths leave the payload.
    """
    path = Path(path)
    if not path.is_file():
        raise KvcalibError(f"coded cache {path} does not exist")
    doc, tensors = read_safetensors_document(path, METADATA_KEY, "coded cache", "a coded cache snapshot",
                                             KvcalibError)
    crc = doc.pop("crc32", None) if isinstance(doc, dict) else None
    try:
        coded = CodedCache(doc, tensors)  # structure first: its errors name the problem best
    except KvcalibError as err:
        raise type(err)(f"coded cache {path}: {err}") from None
    if not isinstance(crc, dict) or set(crc) != set(tensors):
        raise KvcalibError(f"coded cache {path}: the CRC table is missing or does not list exactly the file's "
                           "tensors: corrupt or edited file")
    for name, t in tensors.items():
        got = _crc32(t)
        if got != crc[name]:
            raise KvcalibError(f"coded cache {path}: tensor {name} fails its CRC-32 check (stored {crc[name]!r}, "
                               f"read {got}): the file is corrupt; re-create it")
    return coded
