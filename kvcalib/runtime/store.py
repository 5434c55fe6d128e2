"""Packed storage of one layer's flushed tokens: growable buffers of codes, scales and masks.

A :class:`PackedStore` holds a contiguous run of absolute positions ``[start, start + n)`` at
one bit width per side (shapes in :mod:`kvcalib.codec`'s docstring). A layer without a
PATS schedule has one store; with one, :class:`kvcalib.runtime.tiers.PackedTiers` keeps one
store per quantized tier. When OTT is on, each flushed block also stores its quant mask,
``ceil(G / 8)`` bytes per kv head (:mod:`kvcalib.runtime.outlier_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcalib.quant.uniform import QuantizedTensor
from kvcalib.layout import LayerConfig
from kvcalib.codec import PackedBlock
from kvcalib.runtime.outlier_pool import mask_bytes_per_block, unpack_keep


GROWTH = 0.125  # a packed store's allocation: this fraction of its live tokens beyond them
MIN_SLACK_BLOCKS = 4  # ... and at least this many flush blocks


class GrowBuffer:
    """A tensor that grows along dim 2; its owner says how many entries a new allocation holds
    (:meth:`PackedStore.append`: every part of a store to one token capacity)."""

    def __init__(self, on_change=None) -> None:
        self.buf: torch.Tensor | None = None
        self.n = 0  # used entries along dim 2
        self.front = 0  # entries dropped from the front (sliding layers, tier moves)
        self.on_change = on_change  # called when ``buf`` is reallocated or entries are dropped

    def append(self, x: torch.Tensor, capacity: int = 0) -> None:
        """Append ``x`` (B, H, N, ...) along dim 2; a new allocation holds at least ``capacity``
        entries (and at least twice the live ones without a capacity)."""
        need = self.n + x.shape[2]
        if self.buf is None or need > self.buf.shape[2]:
            live = self.n - self.front
            cap = max(live + x.shape[2], capacity or max(2 * live, 16))
            new = x.new_empty((*x.shape[:2], cap, *x.shape[3:]))
            if live:
                new[:, :, :live] = self.buf[:, :, self.front:self.n]
            self.n, self.front, self.buf = live, 0, new
            need = live + x.shape[2]
            if self.on_change is not None:
                self.on_change()
        self.buf[:, :, self.n:need] = x
        self.n = need

    def drop_front(self, count: int) -> None:
        self.front = min(self.n, self.front + count)
        if self.on_change is not None:
            self.on_change()

    def view(self) -> torch.Tensor | None:
        """(B, H, n - front, ...) live entries (a view, no copy)."""
        return None if self.buf is None else self.buf[:, :, self.front:self.n]

    def nbytes(self) -> int:
        """Bytes of the live entries (capacity slack is an allocator detail, reported apart)."""
        v = self.view()
        return 0 if v is None else int(v.numel() * v.element_size())


@dataclass
class PackedView:
    """Contiguous views of a layer's packed storage, for kernels (shapes in codec.py's docstring).

    ``k_codes``/``v_codes`` (B, H, N, packed D) uint8 or, for a 16-bit side, ``k_raw``/``v_raw``
    (B, H, N, D); scales/zeros float16. Packed tokens hold absolute positions [start, start + N).
    ``k_mean``/``v_mean``: a centred side's TaDA mean, float16 (B, 1, N, D) (16-bit) or
    ``(codes uint8 (B, 1, N, D), scale, zero float16 (B, 1, N, 1))`` (8-bit); None otherwise.
    ``keep``: OTT quant masks uint8 (B, H, blocks * ceil(flush_block / 8)) (0 bit: the token's
    packed slot is masked, it lives in the outlier pool); None without OTT.
    """

    cfg: LayerConfig
    start: int
    n: int
    k_codes: torch.Tensor | None
    k_scale: torch.Tensor | None
    k_zero: torch.Tensor | None
    k_raw: torch.Tensor | None
    v_codes: torch.Tensor | None
    v_scale: torch.Tensor | None
    v_zero: torch.Tensor | None
    v_raw: torch.Tensor | None
    k_mean: torch.Tensor | tuple | None = None
    v_mean: torch.Tensor | tuple | None = None
    keep: torch.Tensor | None = None


def packed_view(cfg: LayerConfig, start: int, n: int, parts: dict) -> PackedView:
    """A :class:`PackedView` over ``parts`` (a store's part name -> tensor or None; absent names
    count as None), a centred side's mean as its tensor or its 8-bit (codes, scale, zero)."""
    p = {k: parts.get(k) for k in ("k_codes", "k_scale", "k_zero", "k_raw", "v_codes", "v_scale", "v_zero", "v_raw")}
    for side in ("k", "v"):
        mean = parts.get(f"{side}_mean")
        if mean is None and parts.get(f"{side}_mean_codes") is not None:
            mean = tuple(parts[f"{side}_mean_{n}"] for n in ("codes", "scale", "zero"))
        p[f"{side}_mean"] = mean
    return PackedView(cfg, start, n, **p, keep=parts.get("keep"))


class PackedStore:
    """Flushed tokens of one layer at one bit width per side, K and V, in growable buffers.

    ``k_bits``/``v_bits`` default to the layer config's (a tier store passes its tier's bits).

    Every part is allocated for one token capacity (:data:`GROWTH` beyond the live tokens, in
    whole flush blocks), so a decode kernel can read the whole allocation
    (:meth:`capacity_view`) with the live range on the device (:meth:`device_range`): then its
    launch does not change when a flush appends tokens, only when the store is reallocated -- a
    CUDA graph of a decode step outlives the flush (:mod:`kvcalib.runtime.layer_graphs`).
    """

    def __init__(self, cfg: LayerConfig, k_bits: int | None = None, v_bits: int | None = None) -> None:
        self.cfg = cfg
        self.bits = {"k": cfg.k_bits if k_bits is None else k_bits, "v": cfg.v_bits if v_bits is None else v_bits}
        self.start = 0  # absolute position of the first live packed token
        self.n = 0  # live packed tokens
        self.generation = 0  # bumped when a part is reallocated or drops tokens (capacity_view)
        self.parts = {name: GrowBuffer(self._changed) for name in
                      ("k_codes", "k_scale", "k_zero", "k_raw", "v_codes", "v_scale", "v_zero", "v_raw",
                       "k_mean", "v_mean", "k_mean_codes", "k_mean_scale", "k_mean_zero",
                       "v_mean_codes", "v_mean_scale", "v_mean_zero", "keep")}
        self._view: PackedView | None = None  # view() of the current contents (decode steps reuse it)
        self.kernel_part: tuple | None = None  # the Triton path's arguments built from that view
        self._capacity_view: tuple | None = None  # (generation, capacity_view()) until a reallocation
        self._range: tuple[torch.Tensor, torch.Tensor] | None = None  # device_range(): lo, hi int32 (B,)
        self._range_n = -1  # the live count ``_range`` holds (-1: not written yet)

    def append(self, start: int, k: PackedBlock, v: PackedBlock, n: int, keep: torch.Tensor | None = None) -> None:
        """Append ``n`` tokens at absolute ``start`` (right after the live ones); ``keep`` = their
        packed quant masks, uint8 ``(B, H, blocks * ceil(G / 8))`` (OTT), or None."""
        self._view = None
        if self.n == 0:
            self.start = start
        tokens = self.capacity_for(self.n + n)  # what a part reallocated now holds, in tokens

        def put(name: str, x: torch.Tensor) -> None:
            self.parts[name].append(x, self.part_rows(name, tokens))

        for side, blk in (("k", k), ("v", v)):
            if blk.quantized is not None:
                put(f"{side}_codes", blk.quantized.codes)
                put(f"{side}_scale", blk.quantized.scale)
                put(f"{side}_zero", blk.quantized.zero)
            else:
                put(f"{side}_raw", blk.raw)
            if blk.mean is not None:
                put(f"{side}_mean", blk.mean)
            if blk.mean_q is not None:
                put(f"{side}_mean_codes", blk.mean_q.codes)
                put(f"{side}_mean_scale", blk.mean_q.scale)
                put(f"{side}_mean_zero", blk.mean_q.zero)
        if keep is not None:
            put("keep", keep)
        self.n += n
        if self._range is None and self.parts["k_codes"].buf is not None:
            # made here, eagerly, never first inside a CUDA-graph capture (a launch's part is
            # built there): a capture records a fill instead of running it, and every replay would
            # write the count of the capture back
            self._make_range()
        self._write_range()

    def part_rows(self, name: str, tokens: int) -> int:
        """Rows along dim 2 of part ``name`` for ``tokens`` tokens (scales of per-channel keys:
        one per key group; OTT masks: bytes per flush block; the rest: one per token)."""
        if name in ("k_scale", "k_zero", "v_scale", "v_zero"):
            return self._scale_rows(name[0], tokens)
        if name == "keep":
            return self._keep_rows(tokens)
        return tokens

    def capacity_for(self, live: int) -> int:
        """Tokens a new allocation holds for ``live`` tokens: :data:`GROWTH` more (at least
        :data:`MIN_SLACK_BLOCKS` flush blocks), in whole flush blocks. Not doubling: a kernel
        reading the whole allocation plans its split over it, and a graph lives until the next
        reallocation (one per ~1/8 of the context: 4k tokens at 32k)."""
        block = self.cfg.flush_block
        want = live + max(int(live * GROWTH), MIN_SLACK_BLOCKS * block)
        return -(-want // block) * block

    def _scale_rows(self, side: str, tokens: int) -> int:
        """Rows of the scale tensor along dim 2 for ``tokens`` tokens."""
        if side == "k" and self.cfg.k_axis == "channel":
            return tokens // self.cfg.k_group
        return tokens

    def _keep_rows(self, tokens: int) -> int:
        """Bytes of packed quant mask along dim 2 for ``tokens`` tokens (whole flush blocks)."""
        block = self.cfg.flush_block
        return tokens // block * mask_bytes_per_block(block)

    def drop_front(self, tokens: int) -> None:
        """Forget the oldest ``tokens`` packed tokens (a multiple of the flush block)."""
        self._view = None
        tokens = min(tokens, self.n)
        for side in ("k", "v"):
            for name in ("codes", "raw", "mean", "mean_codes", "mean_scale", "mean_zero"):
                self.parts[f"{side}_{name}"].drop_front(tokens)
            rows = self._scale_rows(side, tokens)
            self.parts[f"{side}_scale"].drop_front(rows)
            self.parts[f"{side}_zero"].drop_front(rows)
        self.parts["keep"].drop_front(self._keep_rows(tokens))
        self.start += tokens
        self.n -= tokens
        self._write_range()

    # ------------------------------------------------------------------ whole-allocation reads
    def capacity_view(self) -> PackedView | None:
        """Views of the whole allocation, tokens ``[0, capacity)`` from ``start`` (``n`` = the
        capacity; the live ones are :meth:`device_range`'s). The same object until the store is
        reallocated. None when it cannot be read so: nothing stored, tokens dropped from the
        front (sliding layers, tier moves), a 16-bit side, or parts of unequal capacity."""
        cached = self._capacity_view
        if cached is not None and cached[0] == self.generation:
            return cached[1]
        self._capacity_view = (self.generation, None)
        kc, vc = self.parts["k_codes"].buf, self.parts["v_codes"].buf
        if kc is None or vc is None or any(p.front for p in self.parts.values()):
            return None
        cap = kc.shape[2]
        whole = {}
        for name, part in self.parts.items():
            if part.buf is None:
                whole[name] = None
                continue
            if part.buf.shape[2] != self.part_rows(name, cap):
                return None  # allocated before the store's capacity rule (a restored cache): exact views
            whole[name] = part.buf
        view = packed_view(self.cfg, self.start, cap, whole)
        self._capacity_view = (self.generation, view)
        return view

    def _changed(self) -> None:
        self.generation += 1

    def buffers_moved(self) -> None:
        """Its parts' buffers were replaced from outside (a padded batch's rows joined in shared
        allocations, :mod:`kvcalib.runtime.joint`): forget the views and kernel arguments built
        over the old ones, and count a new generation (a launch over the whole allocation changes)."""
        self._view = self.kernel_part = self._capacity_view = None
        self._changed()

    def device_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) int32 (B,) on the store's device: the live tokens ``[0, n)`` of
        :meth:`capacity_view`, rewritten in place by every append or drop (a captured launch
        reads the new count)."""
        if self._range is None:  # a store filled without append (a restored cache): made now
            self._make_range()
        if self._range_n != self.n:  # also after code that set ``n`` directly (a restored cache)
            self._write_range()
        return self._range

    def _make_range(self) -> None:
        kc = self.parts["k_codes"].buf  # (B, H, capacity, PK)
        self._range = (torch.zeros(kc.shape[0], dtype=torch.int32, device=kc.device),
                       torch.zeros(kc.shape[0], dtype=torch.int32, device=kc.device))
        self._range_n = -1

    def _write_range(self) -> None:
        if self._range is not None and self._range_n != self.n:
            self._range[1].fill_(self.n)
            self._range_n = self.n

    def view(self) -> PackedView:
        """Views of the live contents; the same object until the next append or drop (a decode
        step between two flushes slices nothing). Code that sets ``start``/``n`` and the buffers
        directly (restoring a saved cache) changes ``start`` or ``n``, which also renews it."""
        cached = self._view
        if cached is not None and cached.start == self.start and cached.n == self.n:
            return cached
        p = {k: b.view() for k, b in self.parts.items() if "mean" not in k and k != "keep"}
        for side in ("k", "v"):
            mean = self.parts[f"{side}_mean"].view()
            if mean is None and self.parts[f"{side}_mean_codes"].view() is not None:
                mean = tuple(self.parts[f"{side}_mean_{n}"].view() for n in ("codes", "scale", "zero"))
            p[f"{side}_mean"] = mean
        self._view = PackedView(self.cfg, self.start, self.n, **p, keep=self.parts["keep"].view())
        return self._view

    def centred(self) -> bool:
        return any(self.parts[n].buf is not None for n in ("k_mean", "v_mean", "k_mean_codes", "v_mean_codes"))

    def block(self, side: str, a: int, b: int) -> PackedBlock:
        """Tokens [a, b) (relative to the live start) of one side, as a PackedBlock of views."""
        raw = self.parts[f"{side}_raw"].view()
        if raw is not None:
            return PackedBlock(None, raw[:, :, a:b])
        bits = self.bits[side]
        group = self.cfg.k_group if side == "k" else self.cfg.v_group
        axis = "token" if (side == "k" and self.cfg.k_axis == "channel") else "channel"
        ra, rb = self._scale_rows(side, a), self._scale_rows(side, b)
        mean = self.parts[f"{side}_mean"].view()
        mean_codes = self.parts[f"{side}_mean_codes"].view()
        mean_q = None
        if mean_codes is not None:
            mean_q = QuantizedTensor(mean_codes[:, :, a:b], self.parts[f"{side}_mean_scale"].view()[:, :, a:b],
                                     self.parts[f"{side}_mean_zero"].view()[:, :, a:b], 8, mean_codes.shape[-1], "channel")
        return PackedBlock(QuantizedTensor(
            self.parts[f"{side}_codes"].view()[:, :, a:b], self.parts[f"{side}_scale"].view()[:, :, ra:rb],
            self.parts[f"{side}_zero"].view()[:, :, ra:rb], bits, group, axis), None,
            None if mean is None else mean[:, :, a:b], mean_q)

    def keep_bytes(self, a: int, b: int) -> torch.Tensor | None:
        """Packed quant masks of tokens [a, b) (whole blocks), uint8 ``(B, H, R)``; None without OTT."""
        keep = self.parts["keep"].view()
        return None if keep is None else keep[:, :, self._keep_rows(a):self._keep_rows(b)]

    def keep(self, a: int, b: int) -> torch.Tensor | None:
        """Quant masks of tokens [a, b) (whole blocks), bool ``(B, H, b - a)``: False = the token
        lives in the outlier pool; None without OTT."""
        packed = self.keep_bytes(a, b)
        return None if packed is None else unpack_keep(packed, self.cfg.flush_block)

    def nbytes(self) -> dict[str, int]:
        out = {"k_packed": 0, "k_scales": 0, "v_packed": 0, "v_scales": 0}
        for side in ("k", "v"):
            out[f"{side}_packed"] += self.parts[f"{side}_codes"].nbytes() + self.parts[f"{side}_raw"].nbytes()
            out[f"{side}_scales"] += self.parts[f"{side}_scale"].nbytes() + self.parts[f"{side}_zero"].nbytes()
            mean = sum(self.parts[f"{side}_{n}"].nbytes() for n in ("mean", "mean_codes", "mean_scale", "mean_zero"))
            if mean:
                out[f"{side}_mean"] = mean
        if self.parts["keep"].nbytes():
            out["outlier_masks"] = self.parts["keep"].nbytes()
        return out
