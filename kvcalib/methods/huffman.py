"""Huffman codebooks for a recipe's quantized cache (KVComp), the cache's stream layout, and
what the coded cache costs in memory.

This is the offline ``codebooks`` step of DESIGN.md. It runs after a recipe is fitted, because
the symbols it counts are the codes the recipe's own codec stores.

Codebooks
---------
For every layer ``i`` and side ``s`` in ``{k, v}`` quantized below 16 bits, :func:`layer_histograms`
quantizes the reservoir of the collected statistics with the recipe's codec
(``Recipe.codecs``: centering, channel permutation and clipping applied exactly as the
runtime applies them). It cuts the reservoir into flush-sized blocks
(``LayerConfig.flush_block`` tokens, the unit the cache quantizes) and quantizes them as a
batch. It unpacks the codes and counts the symbols: ``int64 (2**bits,)``.
:func:`add_codebooks` turns each histogram into a length-limited canonical code
(:func:`kvcalib.quant.huffman.build_codebook`, ``max_len`` 12) and returns a new recipe with the
tensors

=============================  ================  ==================================================
``layers.{i}.{s}.huffman``     ``uint8 (2**b,)``  code length of each symbol (canonical code words
                                                  follow from the lengths alone)
``layers.{i}.{s}.huffman_hist``  ``int64 (2**b,)``  the calibration histogram; only with
                                                  ``store_histograms=True`` (the runtime's list of
                                                  tensor names must accept it first)
=============================  ================  ==================================================

and a provenance entry ``"huffman"`` (max_len, reservoir blocks, symbols counted, the
calibration estimate of bits per symbol for each layer and side, and the order-0 entropy).
16-bit sides get no codebook. :func:`load_codebooks` validates these tensors and rebuilds them
as :class:`~kvcalib.quant.huffman.Codebook` objects. A length set that is not a complete prefix
code (Kraft sum != 1) is refused with a :class:`~kvcalib.errors.RecipeError` naming the tensor,
and so is one of the wrong size for the layer's bits, a length outside 1..max_len, or a codebook
on a 16-bit side.

Cache stream layout (version 1): what the Triton decoder reads
---------------------------------------------------------------
The symbols are the unpacked codes of one side of one layer: ``unpack_codes(q.codes, bits)``
of the codec's :class:`~kvcalib.quant.uniform.QuantizedTensor`, ``uint8 (B, H, N, D)``, channels
in *stored* order (after the recipe's permutation, before any un-permutation).

1. Stream: ``tokens_per_stream`` (T_s, default 1) consecutive tokens of one (b, kv head), so
   ``L = T_s * D`` symbols, token-major, then stored channel order. Streams are coded with
   :mod:`kvcalib.quant.huffman` (canonical codes, MSB-first, raw fallback when coding would not
   be shorter).
2. Chunk: the streams of ``chunk_tokens`` (default 32, a multiple of T_s) consecutive tokens of one
   (b, h). A chunk starts on a 32-bit word boundary of ``payload`` (zero bits pad its last word),
   and its streams follow back to back with no padding.
3. ``payload uint32 (W,)``: chunks in (b, h, chunk) order, then one zero guard word, so the
   64-bit window read of the decode loop stays in bounds. ``chunk_word int32 (B, H, C)``: the word
   index where each chunk starts. ``C = ceil(N / chunk_tokens)``.
4. ``stream_excess (B, H, N / T_s)``: each stream's length in bits minus ``L`` (a code word has at
   least 1 bit). It is ``uint8`` when ``L * (bits - 1) <= 255`` (2-bit codes with D <= 255, 4-bit
   with D <= 85), else ``int16``. A stream is stored raw exactly when its excess is
   ``L * (bits - 1)``, so no flag array is stored.
5. Stream ``s`` of (b, h) lies in chunk ``c = s // (chunk_tokens / T_s)`` and starts at bit
   ``32 * chunk_word[b, h, c] + sum(L + stream_excess[b, h, s'])`` over the earlier streams
   ``s'`` of its chunk. A program decoding a tile of BLOCK_N tokens x D (BLOCK_N a multiple of
   ``chunk_tokens``) loads one word index per chunk and BLOCK_N excess values. An exclusive
   cumsum gives every lane its start bit. Then each lane runs the ``L``-step table loop of
   :mod:`kvcalib.quant.huffman` on its own token, with no dependence on any other tile.

:func:`encode_side` / :func:`decode_side` code a side as format-v1 blocks (one bit string, int64
offsets: the in-memory reference). :func:`to_cache_streams` converts them to the layout above
(:class:`CacheStreams`, the bytes a GPU cache holds). :func:`decode_cache_streams` is the
reference decoder of that layout; a Triton kernel must match it bit for bit.

Why one token per stream: a tile's lanes are then its tokens, for keys (per-channel scales)
and values (per-token scales) alike, and a lane's loop is only D steps. The price is the
per-stream length field. For 2-bit codes and D = 64 that is 8 bits per 64 symbols, 0.125
bits/symbol, against a saving of at most ~0.2-0.3 bits/symbol (see Memory).
``tokens_per_stream = 4`` cuts the field to 0.03 bits/symbol but makes each lane decode 4 tokens
in sequence. :class:`StreamLayout` holds both knobs, so either choice can be accounted.

Memory
------
:func:`entropy_memory` starts from ``Recipe.memory(info, context)`` (DESIGN.md's accounting:
full-precision sinks and window, scales, zero-points, means, recipe tensors). It keeps all of
that, replaces each coded side's ``{s}_codes`` bytes by its coded bytes, and adds the decode
tables:

- payload: ``bits_per_symbol * symbols / 8``, plus on average 16 bits of word padding per chunk
  (an estimate; :meth:`CacheStreams.nbytes` counts the exact padding of real data), plus one
  4-byte guard word per layer and side;
- ``chunk_word``: 4 bytes per chunk; ``stream_excess``: 1 or 2 bytes per stream (point 4). The
  format-v1 ``bit_offsets`` are int64 with a ``bool`` flag per stream in memory; what is counted
  here is what the GPU layout stores. Raw-fallback flags cost nothing, because they follow
  from the lengths;
- codebooks: the ``uint8`` lengths are recipe tensors, already in ``recipe_state``. The decode
  table a kernel keeps (``2**max(lengths)`` entries of 2 bytes, symbol and length) is counted as
  ``huffman_tables``.

All counts are per sequence (batch 1), as ``Recipe.memory`` counts them.

Not covered yet: recipes with a PATS schedule (older blocks stored at fewer bits would need a
codebook per tier width; refused with a RecipeError). With an OTT outlier pool, the cache leaves
the pool's tokens out of each group's range. The histograms here quantize without that mask, so
the estimate is slightly off for such recipes, but every code still decodes correctly.
"""

from __future__ import annotations

import math
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvcalib.errors import RecipeError
from kvcalib.layout import LayerConfig, MemoryBreakdown, held_tokens, quantized_token_count
from kvcalib.methods.base import (CalibrationError, FitContext, Flag, LayerGeometry, Method, TensorSpec,
                                  reservoir_positions, reservoir_to_bhtd)
from kvcalib.models import ModelInfo
# the cache stream layout (StreamLayout, CacheStreams and their coding) is the bit stream's format,
# shared with the coded storage tier: it lives with the Huffman codec, named here as before
from kvcalib.quant.huffman import (
    DEFAULT_MAX_LEN,
    CacheStreams,
    Codebook,
    HuffmanError,
    StreamLayout,
    build_codebook,
    decode_cache_streams,
    decode_side,
    encode_cache_streams,
    encode_side,
    symbol_histogram,
    to_cache_streams,
)
from kvcalib.quant.packing import unpack_codes
from kvcalib.stats import CollectedStats, LayerStats

if TYPE_CHECKING:  # pragma: no cover - the recipe format sits above the methods
    from kvcalib.recipe import Recipe

__all__ = [
    "HUFFMAN",
    "HUFFMAN_HIST",
    "CacheStreams",
    "CodedMemory",
    "StreamLayout",
    "add_codebooks",
    "codebook_bits",
    "decode_cache_streams",
    "decode_side",
    "encode_cache_streams",
    "encode_side",
    "entropy_memory",
    "flush_blocks",
    "flush_codes",
    "implied_bits",
    "layer_histograms",
    "load_codebooks",
    "side_coded_bytes",
    "side_codes",
    "strip_codebooks",
    "symbol_entropy",
    "tensor_name",
    "to_cache_streams",
    "HuffmanMethod",
]

HUFFMAN = "huffman"  # layers.{i}.{k|v}.huffman: uint8 code lengths (2**bits,)
HUFFMAN_HIST = "huffman_hist"  # layers.{i}.{k|v}.huffman_hist: int64 calibration histogram (2**bits,)
SIDES = ("k", "v")
_TABLE_ENTRY_BYTES = 2  # decode table entry: symbol (uint8) + length (uint8)

Key = tuple[int, str]  # (layer, side)


def _side_bits(cfg: LayerConfig, side: str) -> int:
    return cfg.k_bits if side == "k" else cfg.v_bits


def tensor_name(layer: int, side: str, kind: str = HUFFMAN) -> str:
    """``layers.{layer}.{side}.{kind}``."""
    return f"layers.{layer}.{side}.{kind}"


# ----------------------------------------------------------------------------------------------
# symbols exactly as the codec stores them


def flush_blocks(x: torch.Tensor, flush: int) -> torch.Tensor:
    """Cut token runs into the blocks the cache flushes: ``(NB, H, T, D)`` ->
    ``(NB * (T // flush), H, flush, D)``; a tail shorter than ``flush`` is dropped (the cache
    would still hold it in full precision)."""
    nb, h, t, d = x.shape
    n = t // flush
    if n == 0:
        raise CalibrationError(
            f"token runs of {t} tokens are shorter than one flush block ({flush} tokens): collect "
            f"with --block-len >= {flush}"
        )
    x = x[:, :, : n * flush].reshape(nb, h, n, flush, d)  # (NB, H, n, F, D)
    return x.permute(0, 2, 1, 3, 4).reshape(nb * n, h, flush, d)


def side_codes(codec: Any, side: str, x: torch.Tensor, valid: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Unpacked codes ``uint8 (B, H, N, D)`` (stored channel order) of ``x`` ``(B, H, N, D)`` as
    ``codec`` (a :class:`~kvcalib.codec.LayerCodec`) stores side ``side``. ``N`` must be
    a multiple of the flush block (keys quantized per channel need whole groups); ``positions``
    (B|1, N): the tokens' RoPE positions, for a codec that reads them."""
    if side not in SIDES:
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    block = (codec.encode_keys(x, valid, positions=positions) if side == "k"
             else codec.encode_values(x, valid, positions=positions))
    if block.quantized is None:
        raise ValueError(f"side {side!r} is kept at 16 bits: it has no codes to entropy-code")
    q = block.quantized
    return unpack_codes(q.codes, q.bits)


def flush_codes(codec: Any, side: str, x: torch.Tensor) -> torch.Tensor:
    """Codes ``uint8 (B, H, N, D)`` of ``x`` ``(B, H, N, D)`` quantized one flush block at a time,
    as the cache does (``N`` a multiple of the codec's flush block), in token order."""
    b, h, n, d = x.shape
    flush = codec.cfg.flush_block
    if n % flush:
        raise ValueError(f"{n} tokens are not a whole number of flush blocks of {flush} tokens")
    if n == 0:
        return torch.zeros((b, h, 0, d), dtype=torch.uint8)
    codes = side_codes(codec, side, flush_blocks(x, flush))  # (B * n/F, H, F, D)
    return codes.reshape(b, n // flush, h, flush, d).permute(0, 2, 1, 3, 4).reshape(b, h, n, d)


def strip_codebooks(recipe: Recipe) -> Recipe:
    """A copy of ``recipe`` without Huffman tensors and provenance (the same recipe, uncoded)."""
    tensors = {k: v for k, v in recipe.tensors.items() if k.split(".")[-1] not in (HUFFMAN, HUFFMAN_HIST)}
    prov = {k: v for k, v in recipe.provenance.items() if k != HUFFMAN}
    return dataclasses.replace(recipe, layers=None if recipe.layers is None else list(recipe.layers),
                               tensors=tensors, provenance=prov)


def _refuse_tiered(recipe: Recipe) -> None:
    """Codebooks are per (layer, side) at the layer's configured bits; a PATS schedule
    (``layers.{i}.kv.schedule``) stores older blocks at fewer bits, which would need one codebook
    per tier width: not supported yet, so refuse rather than code some blocks wrongly."""
    tiered = sorted(k for k in recipe.tensors if k.endswith(".kv.schedule"))
    if tiered:
        raise RecipeError(f"recipe {recipe.name!r} has a position-adaptive schedule ({tiered[0]}): Huffman "
                          "codebooks are built for one bit width per layer and side, not per schedule tier; "
                          "use a recipe without --schedule")


def _codecs(recipe: Recipe, info: ModelInfo) -> tuple[list[LayerConfig], list[Any]]:
    configs = recipe.layer_configs(info.num_layers)
    return configs, strip_codebooks(recipe).codecs(info)


def layer_histograms(recipe: Recipe, stats: CollectedStats) -> dict[Key, torch.Tensor]:
    """Symbol histograms ``int64 (2**bits,)`` per quantized (layer, side) of ``recipe``, counted
    over the reservoir of ``stats`` quantized exactly as the recipe's codec stores it.

    Raises:
        RecipeError: the recipe does not fit the statistics' model.
        CalibrationError: the reservoir is empty or its blocks are shorter than a flush block.
    """
    info = stats.model
    recipe.check_model(info)
    _refuse_tiered(recipe)
    configs, codecs = _codecs(recipe, info)
    out: dict[Key, torch.Tensor] = {}
    for i, (cfg, codec, layer) in enumerate(zip(configs, codecs, stats.layers)):
        try:
            hists = side_histograms(codec, layer)
        except CalibrationError as err:
            raise CalibrationError(f"layer {i}: {err}") from None
        out.update({(i, side): h for side, h in hists.items()})
    return out


def side_histograms(codec: Any, layer: LayerStats) -> dict[str, torch.Tensor]:
    """Symbol histograms ``int64 (2**bits,)`` of one layer's quantized sides: its reservoir cut
    into flush blocks and encoded by ``codec`` (the layer's LayerCodec) exactly as the cache does."""
    cfg = codec.cfg
    out: dict[str, torch.Tensor] = {}
    for side in SIDES:
        bits = _side_bits(cfg, side)
        if bits >= 16:
            continue
        res = layer.reservoir_k if side == "k" else layer.reservoir_v  # (NB, BL, H, D)
        if res.dim() != 4 or res.shape[0] == 0:
            raise CalibrationError("the statistics hold no reservoir blocks, so there are no symbols to "
                                   "count: collect with --reservoir-blocks >= 1")
        x = flush_blocks(reservoir_to_bhtd(res), cfg.flush_block)  # (NB*n, H, F, D)
        pos = None
        if codec.needs_positions:  # the same cut of the blocks' RoPE positions: (NB*n, F)
            pos = flush_blocks(reservoir_positions(layer)[:, None, :, None], cfg.flush_block)[:, 0, :, 0]
        out[side] = symbol_histogram(side_codes(codec, side, x, positions=pos), bits)  # (2**bits,)
    return out


def symbol_entropy(hist: torch.Tensor) -> float:
    """Order-0 entropy in bits/symbol of a histogram (0 for an empty one)."""
    p = hist.double() / max(int(hist.sum()), 1)
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


def add_codebooks(recipe: Recipe, stats: CollectedStats, max_len: int = DEFAULT_MAX_LEN, *,
                  store_histograms: bool = False, layout: StreamLayout | None = None,
                  only_if_smaller: bool = True) -> Recipe:
    """A new recipe with a Huffman codebook per quantized (layer, side) (see module docstring).

    Args:
        recipe: a fitted recipe or a preset; a preset becomes a fitted recipe for
            ``stats.model``, because codebooks are model-specific. Existing Huffman tensors are
            replaced.
        stats: collected statistics whose reservoir supplies the symbols.
        max_len: code length limit (decode-table width); 12 by default.
        store_histograms: also store ``layers.{i}.{s}.huffman_hist``. The runtime's list of
            tensors (the method declares it, informative) accepts it.
        layout: the stream layout the cache will use (default :class:`StreamLayout`()); it sets
            the index overhead that ``only_if_smaller`` weighs.
        only_if_smaller: give a side a codebook only when its calibration estimate plus the
            layout's index overhead (:meth:`StreamLayout.overhead_bits`) is below its raw bits.
            Otherwise coding would make that side bigger, and the side stays uncoded. The
            sides left out are listed in ``provenance["huffman"]["uncoded"]``.

    Raises:
        RecipeError: the recipe does not fit the statistics' model, or quantizes no side.
        CalibrationError: empty reservoir.
    """
    info = stats.model
    hists = layer_histograms(recipe, stats)
    if not hists:
        raise RecipeError(f"recipe {recipe.name!r} keeps every layer at 16 bits: there are no codes to entropy-code")
    base = strip_codebooks(recipe)
    configs = recipe.layer_configs(info.num_layers)
    tensors = dict(base.tensors)
    bits_ps: dict[str, list[float | None]] = {s: [None] * info.num_layers for s in SIDES}
    entropy: dict[str, list[float | None]] = {s: [None] * info.num_layers for s in SIDES}
    layout = layout or StreamLayout()
    uncoded: list[str] = []
    for (i, side), hist in sorted(hists.items()):
        cb = build_codebook(hist, max_len=max_len)
        bps = cb.expected_bits(hist)
        entropy[side][i] = round(symbol_entropy(hist), 4)
        bits = _side_bits(configs[i], side)
        if only_if_smaller and bps + layout.overhead_bits(info.head_dim, bits) >= bits:
            uncoded.append(f"{i}.{side}")
            continue
        tensors[tensor_name(i, side)] = cb.lengths.clone()
        if store_histograms:
            tensors[tensor_name(i, side, HUFFMAN_HIST)] = hist.clone()
        bits_ps[side][i] = round(bps, 4)
    provenance = dict(base.provenance)
    provenance[HUFFMAN] = {
        "made_by": "kvcalib.methods.huffman.add_codebooks",
        "max_len": max_len,
        "reservoir_blocks": int(stats.layers[0].reservoir_k.shape[0]) if stats.layers else 0,
        "block_len": int(stats.layers[0].reservoir_k.shape[1]) if stats.layers else 0,
        "symbols": {s: int(sum(int(h.sum()) for (_, sd), h in hists.items() if sd == s)) for s in SIDES},
        "bits_per_symbol": bits_ps,  # expected code length under the calibration histogram
        "entropy": entropy,  # order-0 entropy of the calibration histogram
        "layout": {"tokens_per_stream": layout.tokens_per_stream, "chunk_tokens": layout.chunk_tokens},
        "uncoded": uncoded,  # "layer.side" left uncoded: coding would not make them smaller
    }
    return dataclasses.replace(recipe, layers=list(configs), default_layer=None, model=info, tensors=tensors,
                               provenance=provenance)


# ----------------------------------------------------------------------------------------------
# validation


def _parse_name(name: str) -> tuple[int, str, str] | None:
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[3] in (HUFFMAN, HUFFMAN_HIST):
        if not parts[1].isdigit():
            raise RecipeError(f"recipe tensor {name!r}: the layer index {parts[1]!r} is not a number")
        return int(parts[1]), parts[2], parts[3]
    return None


def load_codebooks(recipe: Recipe, configs: list[LayerConfig], max_len: int = DEFAULT_MAX_LEN,
                   ) -> dict[Key, Codebook]:
    """Validate a recipe's Huffman tensors and rebuild its codebooks.

    Args:
        recipe: the recipe.
        configs: its per-layer configs for the model (``recipe.layer_configs(num_layers)``).
        max_len: the longest code length accepted (and the decode-table width).

    Returns:
        ``{(layer, side): Codebook}`` for every coded side (sides without a codebook are absent:
        stored uncoded).

    Raises:
        RecipeError: naming the tensor, when it is on a layer the model lacks or a side that is
            not k/v, on a 16-bit side, not a 1-D integer tensor (``uint8`` for lengths), of the
            wrong size for the layer's bits, has a length outside 1..max_len or a Kraft sum != 1,
            or (histograms) has negative counts.
    """
    out: dict[Key, Codebook] = {}
    for name, t in recipe.tensors.items():
        parsed = _parse_name(name)
        if parsed is None:
            continue
        i, side, kind = parsed
        where = f"recipe {recipe.name!r}: tensor {name}"
        if i >= len(configs):
            raise RecipeError(f"{where} is for layer {i}, but the model has {len(configs)} layers")
        if side not in SIDES:
            raise RecipeError(f"{where}: side must be k or v, got {side!r}")
        bits = _side_bits(configs[i], side)
        if bits >= 16:
            raise RecipeError(f"{where}: layer {i} keeps {side.upper()} at 16 bits, which has no codes to "
                              "entropy-code; remove the tensor or re-run add_codebooks")
        want = 1 << bits
        if t.dim() != 1 or t.numel() != want:
            raise RecipeError(f"{where} has shape {tuple(t.shape)}; layer {i} stores {bits}-bit "
                              f"{side.upper()} codes, so it needs ({want},) entries (one per symbol)")
        if kind == HUFFMAN_HIST:
            if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
                raise RecipeError(f"{where} must hold integer counts (int64), got {t.dtype}")
            if bool((t < 0).any()):
                raise RecipeError(f"{where} has negative counts")
            continue
        if t.dtype != torch.uint8:
            raise RecipeError(f"{where} must be uint8 code lengths, got {t.dtype}")
        try:
            out[(i, side)] = Codebook.from_lengths(t, max_len=max_len)
        except HuffmanError as err:
            raise RecipeError(f"{where}: {err}") from None
    return out


# ----------------------------------------------------------------------------------------------
# bits per symbol: calibration estimate, or what the lengths imply


def implied_bits(codebook: Codebook) -> float:
    """Mean code length under the distribution the code is optimal for (``p_s = 2**-len_s``):
    what the lengths alone say about bits per symbol when no histogram is at hand."""
    lengths = codebook.lengths.double()
    return float((lengths * torch.exp2(-lengths)).sum())


def codebook_bits(recipe: Recipe, configs: list[LayerConfig],
                  histograms: Mapping[Key, torch.Tensor] | None = None) -> tuple[dict[Key, float], str]:
    """Estimated stream bits per symbol of every coded side, and where the estimate comes from.

    In order of preference: ``histograms`` (expected code length under them); the recipe's
    ``huffman_hist`` tensors; the calibration estimate recorded in ``provenance["huffman"]``;
    the bits the lengths imply (:func:`implied_bits`). Returns ``({}, "none")`` for an uncoded
    recipe.
    """
    books = load_codebooks(recipe, configs)
    if not books:
        return {}, "none"
    if histograms is not None:
        return {k: cb.expected_bits(histograms[k]) for k, cb in books.items() if k in histograms}, "histograms"
    stored = {k: recipe.tensors.get(tensor_name(*k, HUFFMAN_HIST)) for k in books}
    if all(t is not None for t in stored.values()):
        return {k: cb.expected_bits(stored[k].long()) for k, cb in books.items()}, "calibration histogram"
    prov = recipe.provenance.get(HUFFMAN)
    if isinstance(prov, dict) and isinstance(prov.get("bits_per_symbol"), dict):
        per = prov["bits_per_symbol"]
        got: dict[Key, float] = {}
        for (i, side) in books:
            vals = per.get(side)
            if isinstance(vals, list) and i < len(vals) and isinstance(vals[i], (int, float)):
                got[(i, side)] = float(vals[i])
        if len(got) == len(books):
            return got, "calibration estimate (provenance)"
    return {k: implied_bits(cb) for k, cb in books.items()}, "implied by the code lengths"


# ----------------------------------------------------------------------------------------------
# memory


@dataclass(frozen=True)
class CodedMemory:
    """A recipe's accounted memory at ``context`` without and with Huffman coding.

    ``sides``: one dict per coded (layer, side): ``layer``, ``side``, ``bits`` (raw),
    ``bits_per_symbol`` (the payload estimate used), ``symbols``, ``raw_bytes``, ``payload_bytes``,
    ``index_bytes`` (chunk words + stream lengths), ``table_bytes``, ``coded_bytes``.
    """

    context: int
    uncoded: MemoryBreakdown
    coded: MemoryBreakdown
    sides: list[dict[str, Any]]

    @property
    def reduction(self) -> float:
        """Fraction of effective bits saved: ``1 - coded / uncoded``."""
        return 1.0 - self.coded.effective_bits / self.uncoded.effective_bits


def side_coded_bytes(tokens: int, heads: int, head_dim: int, bits: int, bits_per_symbol: float,
                     layout: StreamLayout = StreamLayout()) -> dict[str, float]:
    """Estimated bytes of one side of one layer holding ``tokens`` packed tokens per head.

    Whole streams only: tokens that do not fill a stream (``tokens % tokens_per_stream``) are
    counted raw. Payload padding is estimated as 16 bits per chunk (its mean).
    """
    tps = layout.tokens_per_stream
    coded_tokens = tokens // tps * tps
    streams = heads * (coded_tokens // tps)
    chunks = heads * math.ceil(coded_tokens / layout.chunk_tokens)
    bps = min(float(bits_per_symbol), float(bits))  # the raw fallback bounds every stream
    payload = bps * heads * coded_tokens * head_dim / 8 + chunks * 2.0 + (4.0 if streams else 0.0)
    excess = torch.empty((), dtype=layout.excess_dtype(head_dim, bits)).element_size()
    index = chunks * 4.0 + streams * float(excess)
    tail = heads * (tokens - coded_tokens) * head_dim * bits / 8
    return {"payload": payload + tail, "index": index}


def entropy_memory(recipe: Recipe, info: ModelInfo, bits_per_symbol: Mapping[Key, float],
                   context: int = 4096, layout: StreamLayout = StreamLayout()) -> CodedMemory:
    """Accounted bytes at ``context`` with each coded side's codes replaced by Huffman streams.

    Args:
        recipe: a recipe with codebooks (:func:`add_codebooks`); sides without one stay uncoded.
        info: the model's geometry.
        bits_per_symbol: stream bits per symbol of each coded (layer, side): the calibration
            estimate (:func:`codebook_bits`) or a measurement (``benchmarks/huffman_bits.py``).
        context: tokens cached (T), 4096 unless said otherwise.
        layout: the stream layout whose index is counted.

    Returns:
        :class:`CodedMemory`. ``uncoded`` is ``Recipe.memory`` of the same recipe without its
        Huffman tensors. ``coded`` has the same components except that ``{s}_codes`` only holds
        the uncoded sides. Coded sides are reported as ``{s}_huffman_payload``,
        ``{s}_huffman_index`` and ``huffman_tables``, and the codebook lengths are in
        ``recipe_state``.
    """
    configs = recipe.layer_configs(info.num_layers)
    books = load_codebooks(recipe, configs)
    if books:
        _refuse_tiered(recipe)
    missing = sorted(set(books) - set(bits_per_symbol))
    if missing:
        raise ValueError(f"bits_per_symbol lacks coded sides {missing[:4]}")
    uncoded = strip_codebooks(recipe).memory(info, context)
    comps = dict(recipe.memory(info, context).components)
    sides: list[dict[str, Any]] = []
    for (i, side), cb in sorted(books.items()):
        cfg = configs[i]
        bits = _side_bits(cfg, side)
        nq = quantized_token_count(cfg, held_tokens(context, info.sliding_window[i]))
        raw = nq * info.num_kv_heads * info.head_dim * bits / 8
        est = side_coded_bytes(nq, info.num_kv_heads, info.head_dim, bits, bits_per_symbol[(i, side)], layout)
        table = float(_TABLE_ENTRY_BYTES * (1 << int(cb.lengths.max()))) if nq else 0.0
        comps[f"{side}_codes"] = comps.get(f"{side}_codes", 0.0) - raw
        comps[f"{side}_huffman_payload"] = comps.get(f"{side}_huffman_payload", 0.0) + est["payload"]
        comps[f"{side}_huffman_index"] = comps.get(f"{side}_huffman_index", 0.0) + est["index"]
        comps["huffman_tables"] = comps.get("huffman_tables", 0.0) + table
        sides.append({"layer": i, "side": side, "bits": bits, "bits_per_symbol": float(bits_per_symbol[(i, side)]),
                      "symbols": nq * info.num_kv_heads * info.head_dim, "raw_bytes": raw,
                      "payload_bytes": est["payload"], "index_bytes": est["index"], "table_bytes": table,
                      "coded_bytes": est["payload"] + est["index"] + table})
    for side in SIDES:  # drop emptied code components (all sides coded); keep exact zeros out
        if f"{side}_codes" in comps and abs(comps[f"{side}_codes"]) < 1e-6:
            del comps[f"{side}_codes"]
    coded = MemoryBreakdown(context, uncoded.elements, comps)
    return CodedMemory(context, uncoded, coded, sides)


# ----------------------------------------------------------------------------------------------
# kvcalib inspect


def inspect_section(recipe: Recipe, info: ModelInfo, context: int, layers: list[dict[str, Any]],
                    elements_per_layer: list[int]) -> dict[str, Any] | None:
    """Per-layer bits/symbol and coded effective bits (added to ``layers`` in place) and the coded
    memory of a recipe with codebooks; None without. ``elements_per_layer[i]``: the K/V elements
    layer i holds at ``context`` (a sliding layer its window)."""
    configs = recipe.layer_configs(info.num_layers)
    bits, source = codebook_bits(recipe, configs)  # validates the codebooks (RecipeError)
    if not bits:
        return None
    layout = StreamLayout()
    prov = recipe.provenance.get(HUFFMAN)
    if isinstance(prov, dict) and isinstance(prov.get("layout"), dict):
        try:
            layout = StreamLayout(**prov["layout"])
        except (TypeError, ValueError):
            pass  # an unreadable note: account the default layout
    coded = entropy_memory(recipe, info, bits, context, layout)
    delta = [0.0] * info.num_layers  # coded - raw bytes of each layer
    for side in coded.sides:
        delta[side["layer"]] += side["coded_bytes"] - side["raw_bytes"]
    for row in layers:
        i = row["layer"]
        row["k_huffman_bits"] = bits.get((i, "k"))
        row["v_huffman_bits"] = bits.get((i, "v"))
        row["coded_effective_bits"] = row["effective_bits"] + 8.0 * delta[i] / elements_per_layer[i]
    return {
        "estimate": source,
        "coded_sides": len(bits),
        "quantized_sides": sum((c.k_bits < 16) + (c.v_bits < 16) for c in configs),
        "layout": {"tokens_per_stream": layout.tokens_per_stream, "chunk_tokens": layout.chunk_tokens},
        "effective_bits": coded.coded.effective_bits,
        "uncoded_effective_bits": coded.uncoded.effective_bits,
        "reduction_pct": 100.0 * coded.reduction,
        "total_bytes": coded.coded.total_bytes,
        "components": coded.coded.components,
    }


def huffman_lines(report: dict[str, Any]) -> list[str]:
    """Human-readable lines for the Huffman part of an :func:`inspect_recipe` report (empty
    without codebooks): a summary, then bits/symbol per layer as ``layer: K|V`` (``-`` uncoded)."""
    h = report.get("huffman")
    if not h:
        return []

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = [
        f"Huffman-coded effective bits at {report['context']}: {h['effective_bits']:.3f} "
        f"(uncoded {h['uncoded_effective_bits']:.3f}, {h['reduction_pct']:.1f}% saved); "
        f"{h['coded_sides']} of {h['quantized_sides']} quantized sides coded; bits/symbol: {h['estimate']}; "
        f"streams of {h['layout']['tokens_per_stream']} token(s) in {h['layout']['chunk_tokens']}-token chunks",
        "bits/symbol K|V (coded eff. bits) per layer: " + ", ".join(
            f"{r['layer']}: {fmt(r['k_huffman_bits'])}|{fmt(r['v_huffman_bits'])} ({r['coded_effective_bits']:.3f})"
            for r in report["layers"]),
    ]
    return lines


def inspect_lines(report: dict[str, Any]) -> list[str]:
    """Human-readable lines for the Huffman part of an inspect report (empty without codebooks):
    a summary, then bits/symbol per layer as ``layer: K|V`` (``-`` uncoded)."""
    h = report.get(HUFFMAN)
    if not h:
        return []

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    return [
        f"Huffman-coded effective bits at {report['context']}: {h['effective_bits']:.3f} "
        f"(uncoded {h['uncoded_effective_bits']:.3f}, {h['reduction_pct']:.1f}% saved); "
        f"{h['coded_sides']} of {h['quantized_sides']} quantized sides coded; bits/symbol: {h['estimate']}; "
        f"streams of {h['layout']['tokens_per_stream']} token(s) in {h['layout']['chunk_tokens']}-token chunks",
        "bits/symbol K|V (coded eff. bits) per layer: " + ", ".join(
            f"{r['layer']}: {fmt(r['k_huffman_bits'])}|{fmt(r['v_huffman_bits'])} ({r['coded_effective_bits']:.3f})"
            for r in report["layers"]),
    ]


def origin_line(note: dict[str, Any]) -> str:
    """One line from ``provenance["huffman"]`` (written by ``add_codebooks``)."""
    parts = []
    if "max_len" in note:
        parts.append(f"max_len {note['max_len']}")
    if note.get("reservoir_blocks"):
        parts.append(f"from {note['reservoir_blocks']} reservoir blocks of {note.get('block_len', '?')} tokens")
    per = note.get("bits_per_symbol")
    if isinstance(per, dict):
        for side in ("k", "v"):
            vals = [v for v in per.get(side) or [] if isinstance(v, (int, float))]
            if vals:
                parts.append(f"{side.upper()} {sum(vals) / len(vals):.3f} bits/symbol (calibration, mean of {len(vals)} layers)")
    if note.get("uncoded"):
        parts.append(f"left uncoded: {len(note['uncoded'])} sides")
    return "; ".join(parts) or json.dumps(note, sort_keys=True)



# ----------------------------------------------------------------------------------------------
# the method


class HuffmanMethod(Method):
    """KVComp's entropy coding: Huffman codebooks of the codes the recipe's codec stores.

    Codebooks depend on every other fitted tensor of the layer (the codes are what centering,
    permutation and clipping produce), and whether a side is worth coding on the index overhead
    of the stream layout, so this method works on the whole fitted recipe: its per-layer fit
    adds nothing and :meth:`finish` runs :func:`add_codebooks`. The fixed-width runtime does not
    read the codebooks (they are informative for it); the coded storage tier
    (:mod:`kvcalib.runtime.coded_tier`) and ``kvcalib inspect`` do. The search adds them to its
    chosen recipe (``search = "chosen"``): coding changes memory, never quality.
    """

    name: ClassVar[str] = "huffman"
    summary: ClassVar[str] = "KVComp Huffman codebooks of the quantized symbols (entropy-coded storage tier)"
    order: ClassVar[int] = 90
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec(HUFFMAN, SIDES, "uint8", "(2**bits,)", "code length of each symbol (canonical code)", applied=False),
        TensorSpec(HUFFMAN_HIST, SIDES, "int64", "(2**bits,)", "calibration symbol histogram", applied=False),
    )
    search: ClassVar[str | None] = "chosen"
    letter: ClassVar[str] = "h"
    flags: ClassVar[tuple[Flag, ...]] = (Flag(
        "huffman", bool, "KVComp: add Huffman codebooks of the quantized symbols (fitted on the statistics; sides "
        "where coding would not shrink stay uncoded).", tag=""),)

    def __init__(self, max_len: int = DEFAULT_MAX_LEN, store_histograms: bool = False,
                 only_if_smaller: bool = True) -> None:
        self.max_len = max_len
        self.store_histograms = store_histograms
        self.only_if_smaller = only_if_smaller

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        """The layer's codebooks, from its reservoir encoded by the layer's codec as fitted so far
        (the rule of :func:`add_codebooks`: a side is coded only when that shrinks it)."""
        if "kv.schedule" in context.fitted:
            raise CalibrationError("a position-adaptive schedule stores older blocks at fewer bits: Huffman "
                                   "codebooks are built for one bit width per side, not per schedule tier; use a "
                                   "recipe without --schedule")
        if not layer_cfg.compressed:
            return {}
        if context.codec is None:
            raise CalibrationError("Huffman codebooks need the layer's codec: fit through kvcalib.calibrate")
        base = {k: t for k, t in context.fitted.items() if k.split(".", 1)[-1] not in (HUFFMAN, HUFFMAN_HIST)}
        layout = StreamLayout()
        out: dict[str, torch.Tensor] = {}
        for side, hist in side_histograms(context.codec(base), layer_stats).items():
            cb = build_codebook(hist, max_len=self.max_len)
            overhead = layout.overhead_bits(geom.head_dim, layer_cfg.bits(side))
            if self.only_if_smaller and cb.expected_bits(hist) + overhead >= layer_cfg.bits(side):
                continue  # coding would not shrink this side
            out[f"{side}.{HUFFMAN}"] = cb.lengths.clone()
            if self.store_histograms:
                out[f"{side}.{HUFFMAN_HIST}"] = hist.clone()
        return out

    def finish(self, recipe: Recipe, stats: CollectedStats) -> Recipe:
        """The recipe with its codebooks and their provenance note (:func:`add_codebooks`, which
        refits them with the same rule on the finished recipe)."""
        return add_codebooks(recipe, stats, self.max_len, store_histograms=self.store_histograms,
                             only_if_smaller=self.only_if_smaller)

    @classmethod
    def inspect(cls, recipe: Recipe, info: ModelInfo, context: int, layers: list[dict[str, Any]],
                elements_per_layer: list[int]) -> dict[str, Any] | None:
        return inspect_section(recipe, info, context, layers, elements_per_layer)

    @classmethod
    def inspect_lines(cls, report: dict[str, Any]) -> list[str]:
        return inspect_lines(report)

    @classmethod
    def origin(cls, note: dict[str, Any]) -> str | None:
        return origin_line(note)

    #: the recipe's codebooks for the coded storage tier (kvcalib.runtime.coded_tier reaches them
    #: through the registry, as it reaches the codebook tensors' names through :attr:`tensors`)
    codebooks = staticmethod(load_codebooks)

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> None:
        for side in SIDES:  # validated here so every loaded recipe's codebooks are usable
            bits = cfg.bits(side)
            for kind in (HUFFMAN, HUFFMAN_HIST):
                t = tensors.get(f"{side}.{kind}")
                if t is None:
                    continue
                if bits >= 16:
                    raise ValueError(f"{side}.{kind}: the layer keeps {side.upper()} at 16 bits, which has no codes "
                                     "to entropy-code; remove the tensor")
                if t.dim() != 1 or t.numel() != 1 << bits:
                    raise ValueError(f"{side}.{kind} has shape {tuple(t.shape)}; the layer stores {bits}-bit "
                                     f"{side.upper()} codes, so it needs ({1 << bits},) entries (one per symbol)")
                if kind == HUFFMAN:
                    if t.dtype != torch.uint8:
                        raise ValueError(f"{side}.{kind} must be uint8 code lengths, got {t.dtype}")
                    try:
                        Codebook.from_lengths(t, max_len=DEFAULT_MAX_LEN)
                    except HuffmanError as err:
                        raise ValueError(f"{side}.{kind}: {err}") from None
                elif t.is_floating_point() or t.dtype == torch.bool or t.is_complex() or bool((t < 0).any()):
                    raise ValueError(f"{side}.{kind} must hold non-negative integer counts (int64), got {t.dtype}")
        return None
