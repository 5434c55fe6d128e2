"""A padded batch's rows in shared allocations: one kernel launch per layer and decode step.

A padded batch's layer is *ragged* (:mod:`kvcalib.runtime.cache`): one unpadded single-row
layer per batch row, so that a row holds exactly what its prompt alone would. Read row by row,
that is one kernel launch per row, layer and step, and in per-layer CUDA graphs one recapture
whenever any row flushes (rows of different lengths flush at different steps). Measured on an
H200 (SmolLM2-135M, batch 8, 6,000-token prompts, rows 211 tokens apart, ``kivi-2``): 148 new
tokens/s padded against 342 unpadded with layer graphs (630 captures a call against 30), 61
against 250 without them (``docs/gpu.md``, "Padded batches").

:class:`JointRows` keeps the rows as they are -- each still its own layer, flushed and encoded
as its prompt alone -- but moves their tensors into batched allocations, each row's tensors
becoming views of its batch index: the sinks (B, H, S, D), the pending window's fixed buffer
(B, H, U, D) and every part of the packed store (B, H, capacity, ...), the capacity the largest
any row needs. The kernel then reads every row in one launch in the *stable-launch* layout
(:attr:`~kvcalib.runtime.cache.CompressedLayer.stable_launch`): sinks at virtual positions
``[0, S)``, the window buffer at ``[S, S + U)`` under a visibility row per batch row, and the
packed allocation with each row's live count on the device (:attr:`JointRows.hi`). A flush
appends inside the shared allocation and changes only those counts, so a CUDA graph of the
step outlives it; a row outgrowing the allocation reallocates its own (the store's usual
growth, :class:`~kvcalib.runtime.store.GrowBuffer`) and the next use joins the rows again in a
larger one (:meth:`JointRows.valid` notices; about once per 1/8 of the longest row's context).

Rows join when each is a global, untiered layer without OTT pools whose sinks are full and whose
window sits in its fixed buffer (what a dense stable launch needs too); otherwise, or with
``KVCALIB_JOINT_ROWS=0`` (the benchmarks' baseline), the layer decodes row by row as before. The result is the same attention as each row's own launch up to
the order of the kernel's float32 partial sums (the split plan counts the batch).
"""

from __future__ import annotations

import itertools
import os

import torch

_BUILDS = itertools.count(1)  # a joint's id: a rebuild is a new launch (layer_graphs' period)
_MASKS: dict[tuple, torch.Tensor] = {}  # dynamic steps' visibility rows, shared by a step's layers


def row_joinable(row) -> bool:
    """Whether one row layer can share a joint launch (module docstring)."""
    if not (getattr(row, "is_initialized", False) and row.cfg.compressed and row.pend_buffered
            and not row.is_sliding and not row.codec.tiered and not row.codec.pool_size
            and not row.sinks_dropped and row.sink_k.shape[2] == row.cfg.sinks):
        return False
    return len(row.packed.stores) == 1


class JointRows:
    """The shared allocations of a ragged layer's rows and the device counts a launch reads."""

    def __init__(self, layer, sink_k, sink_v, pend_k, pend_v, parts: dict, capacity: int, lo, hi) -> None:
        self.rows = layer.rows  # the rows it was built for (a new prompt makes new ones)
        self.stores = [row.packed.stores[0] for row in layer.rows]
        self.sink_k, self.sink_v = sink_k, sink_v  # (B, H, S, D) x 2
        self.pend_k, self.pend_v = pend_k, pend_v  # (B, H, window + block, D) x 2: the window buffers
        self.parts = parts  # store part name -> (B, H, rows for the capacity, ...)
        self.capacity = capacity  # packed tokens the allocation holds per row
        self.lo, self.hi = lo, hi  # (B,) int32: each row's live packed tokens [lo, hi) of the allocation
        self.counts: tuple[int, ...] | None = None  # the host copy of ``hi``
        self.generations = tuple(store.generation for store in self.stores)
        self.build_id = next(_BUILDS)
        self.kernel_part: dict | None = None  # the launch's packed arguments (triton_path)
        self.sync_counts()

    @classmethod
    def build(cls, layer, previous: "JointRows | None" = None) -> "JointRows | None":
        """Join ``layer``'s rows (None when one cannot join, or none holds packed tokens yet).
        The rows' tensors are copied into the shared allocations and become views of them; the
        device counts of ``previous`` are reused (a captured graph may read them)."""
        rows = layer.rows
        if not rows or os.environ.get("KVCALIB_JOINT_ROWS", "1").strip() == "0" or not all(
                row_joinable(row) for row in rows):
            return None
        stores = [row.packed.stores[0] for row in rows]
        template = next((s for s in stores if s.n), None)
        if template is None:
            return None
        b = len(rows)
        # tokens of the shared allocation: what each row's own growth rule would give it, and at
        # least what each row holds now (a row that has just grown keeps its room)
        cap = max(s.capacity_for(s.n) for s in stores)
        for s in stores:
            kc = s.parts["k_codes"].buf
            if kc is not None and not s.parts["k_codes"].front:
                cap = max(cap, kc.shape[2])
        cap = -(-cap // template.cfg.flush_block) * template.cfg.flush_block
        parts = {}
        for name, part in template.parts.items():
            if part.buf is None:
                continue
            like = part.buf  # (1, H, rows, ...)
            shared = like.new_zeros((b, like.shape[1], template.part_rows(name, cap), *like.shape[3:]))
            for i, s in enumerate(stores):
                buf = s.parts[name]
                live = buf.view()  # (1, H, n - front, ...) or None
                n = 0 if live is None else live.shape[2]
                if n:
                    shared[i:i + 1, :, :n] = live
                buf.buf, buf.n, buf.front = shared[i:i + 1], n, 0
            parts[name] = shared
        for s in stores:
            s.buffers_moved()
        sink_k = torch.cat([row.sink_k for row in rows])  # (B, H, S, D)
        sink_v = torch.cat([row.sink_v for row in rows])
        pend_k = torch.cat([row.pend_buf_k for row in rows])  # (B, H, window + block, D)
        pend_v = torch.cat([row.pend_buf_v for row in rows])
        for i, row in enumerate(rows):
            u = row.pend_k.shape[2]
            row.sink_k, row.sink_v = sink_k[i:i + 1], sink_v[i:i + 1]
            row.pend_buf_k, row.pend_buf_v = pend_k[i:i + 1], pend_v[i:i + 1]
            row.pend_k, row.pend_v = row.pend_buf_k[:, :, :u], row.pend_buf_v[:, :, :u]
        if previous is not None and previous.hi.shape[0] == b and previous.hi.device == sink_k.device:
            lo, hi = previous.lo, previous.hi
        else:
            lo = torch.zeros(b, dtype=torch.int32, device=sink_k.device)
            hi = torch.zeros(b, dtype=torch.int32, device=sink_k.device)
        return cls(layer, sink_k, sink_v, pend_k, pend_v, parts, cap, lo, hi)

    def valid(self, layer) -> bool:
        """Whether the rows still live in these allocations: no row reallocated its store (it
        outgrew the capacity) or replaced its window buffer, and the rows are the same."""
        if layer.rows is not self.rows:
            return False
        for row, store, gen in zip(self.rows, self.stores, self.generations):
            if store.generation != gen or row.packed.stores[0] is not store:
                return False
            if row.pend_buf_k is None or row.pend_buf_k._base is not self.pend_k or not row.pend_buffered:
                return False
            if row.sink_k._base is not self.sink_k:
                return False
        return True

    def sync_counts(self) -> None:
        """Write each row's live packed count into :attr:`hi` where it changed (after a flush;
        never inside a capture). A fill per changed row, not a copy from the host: a blocking copy
        from pageable host memory waits for the GPU to finish the steps queued before it."""
        counts = tuple(store.n for store in self.stores)
        old = self.counts
        if counts != old:
            for i, n in enumerate(counts):
                if old is None or old[i] != n:
                    self.hi[i].fill_(n)
            self.counts = counts

    @property
    def sinks(self) -> int:
        return self.sink_k.shape[2]

    def visibility(self) -> torch.Tensor:
        """A dynamic step's (B, S + U) bool over the virtual positions: each row's sinks and its
        pending tokens (the step's included); shared by the layers of a step with the same layout."""
        s, u = self.sinks, self.pend_k.shape[2]
        held = tuple(row.pend_k.shape[2] for row in self.rows)
        key = (self.pend_k.device, s, u, held)
        mask = _MASKS.get(key)
        if mask is None:
            if len(_MASKS) >= 64:
                _MASKS.clear()
            # (non-blocking: the copy is staged on the host, the GPU's queue is not waited for)
            ends = torch.tensor([s + h for h in held]).to(self.pend_k.device, non_blocking=True)[:, None]  # (B, 1)
            mask = torch.arange(s + u, device=self.pend_k.device)[None] < ends  # (B, S + U)
            _MASKS[key] = mask
        return mask
