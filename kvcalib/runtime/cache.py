"""``CompressedCache``: a ``transformers.Cache`` holding packed 2/4/8-bit K/V per layer.

Per layer the cache keeps, for a batch (B, H kv-heads, D head_dim):

- sinks: the first S positions, full precision, (B, H, S, D);
- packed blocks: older tokens, flushed in blocks of ``flush_block`` tokens (a key group), through
  the layer's :class:`~kvcalib.codec.LayerCodec`, held in one store per PATS tier
  (:mod:`kvcalib.runtime.tiers`; one store without a schedule);
- pending: every later token in full precision, (B, H, U, D), with window <= U < window + block
  after each flush; on a compressed layer a view of a fixed buffer of ``window + block`` tokens
  (``pend_buf_k``/``pend_buf_v``; a prompt's longer window sits apart until its flush);
- OTT (when the codec's ``pool_size`` > 0, :mod:`kvcalib.runtime.outlier_pool`): the outlier
  pool and extra pool in full precision, and one quant mask per packed block.

A flush of one block (:meth:`CompressedLayer._flush_block`): choose its outliers (OTT), encode K
and V without them, store codes + mask. After the flushes of a step, :meth:`PackedTiers.advance`
requantizes the blocks whose tier now says fewer bits (PATS).

Timing (this is what the decode-faithful simulation reproduces): ``update`` only takes the new
tokens in (:attr:`CompressedLayer.incoming`); the registered attention function tells the layer
which of them are real (:meth:`CompressedLayer.commit`), attends over sinks + packed blocks +
pending, and only *then* the layer flushes what is due. So the prompt's own attention always sees
full-precision prompt K/V, and a decode step at position i sees the blocks flushed after step i-1.

Padding (left or right): a row holds exactly what the same prompt alone would hold. Padding is
never stored: the first time a step brings padding, the layer becomes *ragged*
(:attr:`CompressedLayer.rows`): one unpadded single-row layer per batch row, each fed only its
row's real tokens (a contiguous run of absolute positions ``[row_first[b], row_end[b])``), so its
sinks are the row's first real tokens and its window, flush blocks, OTT pools and PATS ages count
that row's tokens only -- the same code, on the same tensors, as the prompt alone. Attention runs
row by row over them (a query at a padding position gets zeros); the kernel is then launched once
per row. The rows are split in one place, :func:`kvcalib.runtime.backend.decode_attention`
(through :meth:`CompressedLayer.attend_rows`; in static mode each row over its own device state):
every attention path below it reads one unpadded layer (:meth:`CompressedLayer.require_dense`).
A layer whose rows are all real stays dense (one batched layer, as before). Where the kernel runs
a decode step, rows whose layout allows it are *joined* instead (:mod:`kvcalib.runtime.joint`,
:meth:`CompressedLayer.joined`): their tensors become views of shared batched allocations and
one launch reads every row, each with its own counts and visibility on the device; in static
mode (:attr:`CompressedLayer.joint_static`) the step writes every row's token at its own slot,
and a CUDA graph of it outlives the rows' flushes as a dense stable-launch layer's does.

Attention must go through :func:`kvcalib.runtime.attention.kvcalib_attention` (the model's
``attn_implementation="kvcalib"``); :meth:`CompressedCache.from_recipe` switches the model to it.

Static mode (:meth:`CompressedCache.make_static`, used by :mod:`kvcalib.runtime.graphs` to replay
decode steps from CUDA graphs): a step writes its token into the pending buffer at the slot a
device tensor names (:class:`~kvcalib.runtime.static.StaticState`), attention reads the whole
buffer under a device visibility mask, and nothing on the host changes during the step: the
driver advances the bookkeeping (:meth:`CompressedCache.advance_static`) and flushes between
steps, so between two flushes every step launches the same kernels on the same buffers. A PATS
layer's block moving down a tier is a flush for that purpose (:meth:`CompressedLayer.flush_due`).

Static and dynamic decoding are one computation (issue 35): a dynamic decode step writes its
token into the same buffer and launches the kernel on the same whole buffer under the visibility
mask a static step would compute (:meth:`CompressedLayer.decode_visibility`), so the two modes
differ only in who keeps the position, the host or the device (``test_graph_decode`` checks the
logits bit for bit). Before, a dynamic step concatenated the window into a tensor of its own and
launched the kernel without a mask over exactly its tokens: another compiled variant and, for
short windows, another number of partial results to merge.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig, held_elements
from kvcalib.recipe import Recipe, resolve_recipe
from kvcalib.codec import LayerCodec
from kvcalib.runtime.attention import LAYER_ATTR, use_kvcalib_attention
from kvcalib.runtime.joint import JointRows
from kvcalib.runtime.layer_graphs import LayerGraphs
from kvcalib.runtime.outlier_pool import OutlierPool, pack_keep
from kvcalib.runtime.static import StaticState
from kvcalib.runtime.store import GrowBuffer, PackedStore, PackedView  # noqa: F401  (re-exported)
from kvcalib.runtime.tiers import PackedTiers

# decode steps' visibility masks (CompressedLayer.decode_visibility), by (device, length, position,
# window): the layers of one step share one
_DECODE_MASKS: dict[tuple, torch.Tensor] = {}


# batch x kv heads x packed tokens up to which a layer's decode launch is stable (stable_launch):
# ~25 us of GPU work per call on an H100 (batch 8 / 4k or batch 1 / 32k, Mistral-7B shape), under
# the host time of an eager layer step (40-60 us)
STABLE_LAUNCH_MAX_WORK = 8 * 8 * 8192
BUFFER_SLACK = 4096  # free full-precision slots the fixed window buffer may hold beyond 3x its tokens


class Segment(NamedTuple):
    """A run of cached tokens for attention, in the attention's dtype.

    ``k``, ``v``: (B, H, N, D). Contiguous segments hold absolute positions ``[start, start + N)``;
    the outlier pools instead give ``positions`` (B, H, N) int32 (-1 = empty slot). ``keep``
    (B, H, N) bool, when given, masks slots out (False: an OTT pool entrant's packed slot).
    """

    start: int
    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class CompressedLayer(CacheLayerMixin):
    """One layer's compressed cache. See the module docstring for layout and timing."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cfg: LayerConfig, codec: LayerCodec | None = None, layer_idx: int = 0,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.codec = codec or LayerCodec(cfg)
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.n_seen = 0  # tokens cached so far (absolute positions 0..n_seen-1)
        self.sink_k: torch.Tensor | None = None  # (B, H, S', D)
        self.sink_v: torch.Tensor | None = None
        self.sinks_dropped = False  # a sliding layer drops sinks once out of its window
        self.pend_k: torch.Tensor | None = None  # (B, H, U, D)
        self.pend_v: torch.Tensor | None = None
        self.pend_start = 0  # absolute position of pend_k[:, :, 0]
        self.packed = PackedTiers(cfg, self.codec)  # one store per PATS tier
        self.outliers = OutlierPool(self.codec.pool)  # OTT pools (inactive at pool 0)
        self.incoming: tuple[torch.Tensor, torch.Tensor] | None = None  # update()'s K/V before commit()
        # ragged mode (module docstring): one unpadded single-row layer per batch row, each row's real
        # tokens at absolute positions [row_first[b], row_end[b]) (row_first None: none yet), and
        # the real run [a, c) of the last committed chunk per row (None: none in it)
        self.rows: list[CompressedLayer] | None = None
        self.row_first: list[int | None] = []
        self.row_end: list[int] = []
        self.chunk_rows: list[tuple[int, int] | None] = []
        self.chunk_len = 0  # tokens of the last committed chunk
        # the rows' tensors in shared allocations, read by one kernel launch (runtime/joint.py), and
        # whether static mode runs them so (then the device tensors below are (B,) / (B, S + U))
        self.joint: JointRows | None = None
        self.joint_static = False
        self.awaiting_attention = False
        self.static: StaticState | None = None  # set in static mode (module docstring)
        # the pending window's fixed buffer (B, H, window + block, D), compressed layers: pend_k/pend_v are
        # views of its first tokens whenever they fit (pend_buffered), in both modes (module docstring)
        self.pend_buf_k: torch.Tensor | None = None
        self.pend_buf_v: torch.Tensor | None = None
        self.pend_buffered = False
        # eager decode steps through per-layer static steps and CUDA graphs (runtime/layer_graphs.py):
        # the cache's shared LayerGraphs (None: never), whether it holds this layer in static mode,
        # this layer's graph for the current flush period, and why it never can (None: it may)
        self.graphs: LayerGraphs | None = None
        self.graph_owned = False
        self.graph_entry = None
        self.graph_refused: str | None = None
        self.graph_warm = False  # ran a static step (its kernels are compiled): capture without one
        self.graph_retried = False  # a capture of it failed once
        # static mode of a stable-launch layer (:attr:`stable_launch`): pend_start on the device (1,)
        # int64, the step's slot in the pending buffer (1,) int64 and its visibility mask (1, S + U)
        # bool over the virtual positions (sinks, then the buffer's slots), both refreshed by the step
        self.pend_start_dev: torch.Tensor | None = None
        self.static_slot: torch.Tensor | None = None
        self.static_mask: torch.Tensor | None = None
        self._slot_rel: torch.Tensor | None = None  # (1, S + U) int64: virtual position - S

    # ------------------------------------------------------------------ Cache API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros((b, h, 0, d))
        self.sink_k, self.sink_v = empty, empty.clone()
        self.pend_k, self.pend_v = empty.clone(), empty.clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take new K/V (B, H, T_new, D) in (stored by :meth:`commit`, once attention knows which
        of them are padding). Returns the new states tagged with this layer.

        A decode step that runs as a per-layer static step (:mod:`kvcalib.runtime.layer_graphs`)
        stores nothing here either: its attention writes the token."""
        graphs = self.graphs
        if graphs is not None and (self.static is None or self.graph_owned) and graphs.take(self, key_states):
            setattr(key_states, LAYER_ATTR, self)
            return key_states, value_states
        if self.static is not None:
            return self._update_static(key_states, value_states)
        if self.awaiting_attention:
            raise KvcalibError(
                "CompressedCache was updated twice without kvcalib attention in between: the model "
                "must run with attn_implementation='kvcalib' (build the cache with "
                "CompressedCache.from_recipe(model, recipe), which switches it)."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.incoming = (key_states, value_states)
        self.n_seen += key_states.shape[-2]
        self.awaiting_attention = True
        setattr(key_states, LAYER_ATTR, self)
        return key_states, value_states

    @property
    def ragged(self) -> bool:
        """Whether the layer holds one unpadded layer per row (padding was seen; module docstring)."""
        return self.rows is not None

    def commit(self, real: torch.Tensor | None = None, real_rows: list[list[bool]] | None = None) -> None:
        """Store the tokens :meth:`update` took in. ``real`` (B|1, T_new) bool: which of them are
        real tokens (False = padding); None = all. A row's real tokens must stay one contiguous
        run (left padding, right padding, or both); padding is never stored. ``real_rows``:
        ``real.tolist()`` when the caller has it (the attention entry makes it once per forward,
        not once per layer: each is a device-to-host copy that waits for the GPU)."""
        if self.incoming is None:
            return
        k, v = self.incoming
        self.incoming = None
        b, t_new = k.shape[0], k.shape[-2]
        if real is not None and real_rows is None:
            real_rows = real.tolist()  # one device-to-host copy for the whole chunk
        if real_rows is not None and len(real_rows) != b:
            real_rows = real_rows * b  # (1, T_new) broadcast over the batch
        if self.rows is None:
            if real_rows is None or all(all(r) for r in real_rows):
                self._append(k, v)
                return
            self._become_ragged(b, self.n_seen - t_new)
        start = self.n_seen - t_new  # absolute position of the chunk's first token
        runs = [(0, t_new)] * b if real_rows is None else _real_runs(real_rows)
        self.chunk_rows, self.chunk_len = runs, t_new
        for i, (row, run) in enumerate(zip(self.rows, runs)):
            if run is None:
                continue
            a, c = run
            if self.row_first[i] is None:
                self.row_first[i] = start + a
            elif self.row_end[i] != start + a:
                raise KvcalibError(
                    f"batch row {i} has padding between real tokens (real tokens up to position {self.row_end[i]}, "
                    f"then again from {start + a}): CompressedCache keeps each row's tokens as one run; pad prompts "
                    "on the left for generation (tokenizer.padding_side = 'left')")
            self.row_end[i] = start + c
            row.update(k[i:i + 1, :, a:c], v[i:i + 1, :, a:c])
            row.commit()

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Dense mode: the first S tokens go to the sinks, the rest to the pending window."""
        t_new = key_states.shape[-2]
        n_before = self.n_seen - t_new
        n_sink_free = max(0, self.cfg.sinks - n_before) if self.cfg.compressed else 0
        take = min(n_sink_free, t_new)
        if take:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :take]], dim=-2)
            self.pend_start += take
        if t_new == take:
            return
        u, t = self.pend_k.shape[-2], t_new - take
        if self.pend_buffered and u + t <= self.static_capacity:  # a decode step: written in place
            self.pend_buf_k[:, :, u:u + t] = key_states[:, :, take:]
            self.pend_buf_v[:, :, u:u + t] = value_states[:, :, take:]
            self.pend_k, self.pend_v = self.pend_buf_k[:, :, :u + t], self.pend_buf_v[:, :, :u + t]
        else:  # a prompt: the window grows past the buffer until the flush after its attention
            self._put_pending(torch.cat([self.pend_k, key_states[:, :, take:]], dim=-2),
                              torch.cat([self.pend_v, value_states[:, :, take:]], dim=-2))

    def _put_pending(self, k: torch.Tensor, v: torch.Tensor, force_buffer: bool = False) -> None:
        """Make ``k``/``v`` (B, H, u, D) the pending window: views of the fixed buffer of
        :attr:`static_capacity` tokens when the layer is compressed and they fit (then a decode
        step writes its token in place, and the kernel reads the same buffer under the same
        visibility mask in dynamic and static mode: one computation), else tensors of their own
        (a prompt longer than the buffer, until its flush; 16-bit layers)."""
        u = k.shape[-2]
        # a window far longer than what is pending (a recipe may keep 100k tokens in full precision)
        # allocates no window-sized buffer for a short prompt: its tokens stay tensors of their own
        # until the buffer is at most BUFFER_SLACK tokens larger than them (or static mode needs it)
        slack_ok = force_buffer or self.static_capacity - u <= max(BUFFER_SLACK, 3 * u)
        if not (self.cfg.compressed and u <= self.static_capacity and slack_ok):
            self.pend_k, self.pend_v, self.pend_buffered = k.contiguous(), v.contiguous(), False
            return
        b, h, _, d = k.shape
        if self.pend_buf_k is None or self.pend_buf_k.shape[:2] != (b, h) or self.pend_buf_k.dtype != k.dtype:
            self.pend_buf_k = k.new_zeros((b, h, self.static_capacity, d))
            self.pend_buf_v = v.new_zeros((b, h, self.static_capacity, d))
        self.pend_buf_k[:, :, :u] = k
        self.pend_buf_v[:, :, :u] = v
        self.pend_k, self.pend_v, self.pend_buffered = self.pend_buf_k[:, :, :u], self.pend_buf_v[:, :, :u], True

    def _become_ragged(self, batch: int, held: int) -> None:
        """Switch to one layer per row (module docstring); the ``held`` tokens cached so far (all
        real) move into the rows as they are."""
        rows = []
        for i in range(batch):
            row = CompressedLayer(self.cfg, self.codec, self.layer_idx, self.sliding_window)
            if held:
                self._copy_row_into(row, i, held)
            rows.append(row)
        self.rows = rows
        self.row_first = [0 if held else None] * batch
        self.row_end = [held] * batch
        self.chunk_rows = [None] * batch
        empty = self.sink_k[:, :, :0]  # (B, H, 0, D): the dense parts hold nothing from now on
        self.sink_k = self.sink_v = self.pend_k = self.pend_v = empty
        self.pend_buf_k = self.pend_buf_v = None
        self.pend_buffered = False
        self.packed = PackedTiers(self.cfg, self.codec)
        self.outliers = OutlierPool(self.codec.pool)

    def _copy_row_into(self, row: "CompressedLayer", i: int, held: int) -> None:
        """Make the empty single-row layer ``row`` hold batch row ``i`` of this dense layer (its
        ``held`` tokens, all real)."""
        one = slice(i, i + 1)
        row.dtype, row.device, row.is_initialized = self.dtype, self.device, True
        row.n_seen, row.pend_start, row.sinks_dropped = held, self.pend_start, self.sinks_dropped
        row.sink_k, row.sink_v = self.sink_k[one].clone(), self.sink_v[one].clone()
        row._put_pending(self.pend_k[one].clone(), self.pend_v[one].clone())
        for src, dst in zip(self.packed.stores, row.packed.stores):
            tokens = dst.capacity_for(src.n)  # the store's capacity rule: the row can launch stably
            for name, buf in src.parts.items():
                view = buf.view()
                if view is not None:
                    dst.parts[name].append(view[one].clone(), dst.part_rows(name, tokens))
            dst.start, dst.n = src.start, src.n
        row.outliers.copy_row(self.outliers, i)

    def _update_static(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Static mode: write the step's token (B, H, 1, D) at its slot of the pending buffer, the
        slot read from the device (``static.position - pend_start``); no host state changes."""
        if key_states.shape[-2] != 1:
            raise KvcalibError("a static (CUDA-graph) CompressedCache takes one token per step: leave static mode "
                               "(cache.make_dynamic()) before a prefill")
        if self.joint_static:  # each row's token at its own slot of the shared window buffers
            slot = torch.sub(self.static.position, self.pend_start_dev, out=self.static_slot)  # (B,)
            torch.le(self._slot_rel, slot[:, None], out=self.static_mask)  # (B, S + U)
            joint = self.joint
            joint.pend_k[self._batch_index, :, slot] = key_states[:, :, 0].to(joint.pend_k.dtype)  # (B, H, D)
            joint.pend_v[self._batch_index, :, slot] = value_states[:, :, 0].to(joint.pend_v.dtype)
            setattr(key_states, LAYER_ATTR, self)
            return key_states, value_states
        if self.rows is not None:  # every row takes its token (static mode refuses rows that ended)
            for i, row in enumerate(self.rows):
                row._update_static(key_states[i:i + 1], value_states[i:i + 1])
            setattr(key_states, LAYER_ATTR, self)
            return key_states, value_states
        if self.pend_start_dev is not None:  # stable launch: pend_start read from the device too
            slot = torch.sub(self.static.position, self.pend_start_dev, out=self.static_slot)  # (1,)
            torch.le(self._slot_rel, slot, out=self.static_mask)  # sinks, then the slots up to this one
        else:
            slot = self.static.position - self.pend_start  # (1,) int64 on the device
        self.pend_buf_k.index_copy_(2, slot, key_states.to(self.pend_buf_k.dtype))
        self.pend_buf_v.index_copy_(2, slot, value_states.to(self.pend_buf_v.dtype))
        setattr(key_states, LAYER_ATTR, self)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # masks span all absolute positions; dropped (sliding) positions are masked anyway
        return self.n_seen + query_length, 0

    def get_seq_length(self, *args) -> int:
        return self.n_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        graphs = self.graphs
        if graphs is not None:
            graphs.release(self)
        self.__init__(self.cfg, self.codec, self.layer_idx, self.sliding_window)
        self.graphs = graphs

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KvcalibError("beam search is not supported by CompressedCache: use greedy or sampling decoding.")

    # ------------------------------------------------------------------ attention side
    def mark_padding(self, key_visible: torch.Tensor) -> None:
        """:meth:`commit` the tokens :meth:`update` took in, their padding read from ``key_visible``
        (B, m) bool over the last m positions (m >= the new tokens): False = padding."""
        if self.incoming is not None:
            self.commit(key_visible[:, key_visible.shape[1] - self.incoming[0].shape[-2]:])

    def padding_mask(self) -> torch.Tensor | None:
        """(B, n_seen) bool, False at padding (the 2D attention mask of what is cached), or None
        when every cached position of every row is a real token."""
        if self.rows is None:
            return None
        pos = torch.arange(self.n_seen, device=self.device)[None]  # (1, n_seen)
        first = torch.tensor([[self.n_seen if f is None else f] for f in self.row_first], device=self.device)
        end = torch.tensor([[e] for e in self.row_end], device=self.device)  # (B, 1)
        return (pos >= first) & (pos < end)

    def row_queries(self, i: int, tq: int) -> tuple[int, int] | None:
        """Which of a step's ``tq`` queries (the last ``tq`` tokens of the last committed chunk) are
        row ``i``'s real tokens: ``(a, c)``, or None (all padding)."""
        run = self.chunk_rows[i]
        if run is None:
            return None
        skip = self.chunk_len - tq  # chunk tokens before the first query
        a, c = max(0, run[0] - skip), run[1] - skip
        return (a, c) if c > a else None

    def row_visible(self, visible: torch.Tensor | None, i: int, queries: tuple[int, int]) -> torch.Tensor | None:
        """Row ``i``'s part of ``visible`` (B|1, Tq, n_seen) over absolute positions, for its own
        layer: (1, c - a, held) bool, its real ``queries`` (a, c) over its real tokens."""
        if visible is None:
            return None
        a, c = queries
        first = self.row_first[i]
        return visible[i if visible.shape[0] > 1 else 0, a:c, first:self.row_end[i]][None]

    def require_dense(self, reader: str) -> None:
        """Raise unless this layer is one unpadded layer (not ragged): what ``reader`` (an attention
        path over the layer's own tensors) can read. A ragged layer's own tensors hold nothing."""
        if self.rows is not None:
            raise KvcalibError(f"{reader} reads one unpadded layer, and layer {self.layer_idx} is a padded batch's "
                               "(one layer per row): attend it through kvcalib.runtime.backend.decode_attention, "
                               "which splits the rows, or read layer.rows[b]")

    def attend_rows(self, query: torch.Tensor, visible: torch.Tensor | None, attend,
                    out_dtype: torch.dtype) -> torch.Tensor | None:
        """Attention of a ragged layer, row by row: ``attend(query_i, row_layer, visible_i)`` on
        each row's real queries (``query`` (B, Hq, Tq, D); ``visible`` (B|1, Tq, n_seen) or None,
        sliced by :meth:`row_visible`) must return (1, Tq_i, Hq, D) or None (then None is
        returned). Returns (B, Tq, Hq, D) in ``out_dtype``; queries at padding get zeros. Called
        by :func:`kvcalib.runtime.backend.decode_attention` only (the one place rows are split)."""
        b, hq, tq, d = query.shape
        out = query.new_zeros((b, tq, hq, d), dtype=out_dtype)  # (B, Tq, Hq, D)
        for i, row in enumerate(self.rows):
            run = self.row_queries(i, tq)
            if run is None:
                continue
            a, c = run
            part = attend(query[i:i + 1, :, a:c], row, self.row_visible(visible, i, run))  # (1, c - a, Hq, D)
            if part is None:
                return None
            out[i, a:c] = part[0].to(out_dtype)
        return out

    def segments(self, block_tokens: int = 256, dtype: torch.dtype = torch.float32):
        """Yield :class:`Segment` s in ``dtype`` over everything cached: sinks, packed blocks in
        position order (dequantized a few at a time, never the whole cache; OTT slots masked by
        ``keep``), the outlier pools (``positions``), then the pending window."""
        self.require_dense("the reference attention (segments)")
        if self.sink_k.shape[-2] and not self.sinks_dropped:
            yield Segment(0, self.sink_k.to(dtype), self.sink_v.to(dtype))
        step = max(self.cfg.flush_block, block_tokens // self.cfg.flush_block * self.cfg.flush_block)
        for store, a, b in self.packed.runs(step):
            pos = self.rope_positions(store.start + a, b - a)  # (B|1, N) or None
            yield Segment(store.start + a, self.codec.decode_keys(store.block("k", a, b), dtype, pos),
                          self.codec.decode_values(store.block("v", a, b), dtype, pos), store.keep(a, b))
        pool = self.outliers.segment(dtype)
        if pool is not None:
            pk, pv, pos = pool  # (B, H, P + E, D) x 2, (B, H, P + E)
            yield Segment(0, pk, pv, positions=pos)
        if self.pend_k.shape[-2]:
            yield Segment(self.pend_start, self.pend_k.to(dtype), self.pend_v.to(dtype))

    @property
    def n_packed(self) -> int:
        """Packed tokens held (per row: the most any row holds, when ragged)."""
        if self.rows is not None:
            return max(row.n_packed for row in self.rows)
        return self.packed.n

    @property
    def uses_tiers(self) -> bool:
        """PATS tiers: one packed store per bit width (the kernel reads them with one split launch
        per store; in static mode a tier move counts as a flush, :meth:`flush_due`)."""
        return self.codec.tiered

    def packed_view(self) -> PackedView:
        """Contiguous views of the packed tokens (untiered layers only; the Triton path reads
        each PATS store's own ``view()``)."""
        return self.packed.view()

    def rope_positions(self, start: int, n: int) -> torch.Tensor | None:
        """RoPE positions (1, n) int64 of absolute positions [start, start + n), as the model's
        forward gives them, for a codec whose states read them (``codec.needs_positions``); None
        otherwise. A dense layer holds no padding and a padded batch's row layer counts from its
        row's first real token, which is where generate()'s ``attention_mask.cumsum(-1) - 1``
        starts too, so the positions are the layer's own."""
        if not self.codec.needs_positions:
            return None
        return torch.arange(start, start + n, device=self.device)[None]  # (1, n)

    def _flush_block(self, off: int, block: int) -> None:
        """Pending tokens [off, off + block) -> packed storage: OTT selection, then encode."""
        start = self.pend_start + off  # absolute position of the block's first token
        k_blk = self.pend_k[:, :, off:off + block]  # (B, H, G, D)
        v_blk = self.pend_v[:, :, off:off + block]  # (B, H, G, D)
        keep = self.outliers.select(k_blk, v_blk, start)  # (B, H, G): False = into the pool; or None
        pos = self.rope_positions(start, block)  # (1, G) or None
        k_packed = self.codec.encode_keys(k_blk, None, keep, pos)  # (a dense layer holds no padding)
        v_packed = self.codec.encode_values(v_blk, None, keep, pos)
        self.packed.append(start, k_packed, v_packed, block, None if keep is None else pack_keep(keep))

    def flush(self) -> None:
        """Move due pending tokens into packed storage, move aged blocks down their PATS tiers;
        drop what a sliding window no longer needs."""
        self.commit()  # tokens taken in without attention (direct callers): all real
        self.awaiting_attention = False
        if not self.is_initialized:  # a row that has seen only padding so far
            return
        if self.rows is not None:
            for row in self.rows:
                row.flush()
            if self.joint_static:  # the graph reads the new counts and window starts from the device
                joint = self.joined()
                if joint is None:  # cannot happen to a joined layout; static mode then ends (layer_graphs)
                    self.joint_static = False
                else:
                    joint.sync_counts()
                    starts = self._row_pend_starts()
                    for i, (new, old) in enumerate(zip(starts, self._joint_pend_starts)):
                        if new != old:  # a fill, not a copy from the host (JointRows.sync_counts says why)
                            self.pend_start_dev[i].fill_(new)
                    self._joint_pend_starts = starts
            return
        cfg = self.cfg
        if cfg.compressed:
            block = cfg.flush_block
            due = (self.pend_k.shape[-2] - cfg.window) // block * block
            if due > 0:
                if self.outliers.active or self.codec.tiered:
                    for off in range(0, due, block):  # pools select per group; tiers age per block
                        self._flush_block(off, block)
                else:  # one encode for all due groups (one kernel launch on GPU, not one per group)
                    self._flush_block(0, due)
                self._drop_pending(due)
            self.packed.advance(self.n_seen)
        if self.sliding_window is not None:
            oldest_needed = self.n_seen - self.sliding_window + 1  # next query's first visible key
            stale = (oldest_needed - self.packed.start) // cfg.flush_block * cfg.flush_block
            if self.packed.n and stale > 0:
                self.packed.drop_front(min(stale, self.packed.n))
            if self.sink_k.shape[-2] and self.sink_k.shape[-2] <= oldest_needed:
                self.sinks_dropped = True
                self.sink_k = self.sink_k[:, :, :0]
                self.sink_v = self.sink_v[:, :, :0]
            if not cfg.compressed and self.pend_k.shape[-2] > self.sliding_window:
                self._drop_pending(self.pend_k.shape[-2] - self.sliding_window)

    def _drop_pending(self, count: int) -> None:
        """Forget the oldest ``count`` pending tokens (flushed or out of the window). In the fixed
        buffer the rest shifts to its front (its address must not change: static mode)."""
        rest = self.pend_k.shape[-2] - count
        if self.pend_buffered:
            self.pend_buf_k[:, :, :rest] = self.pend_buf_k[:, :, count:count + rest].clone()
            self.pend_buf_v[:, :, :rest] = self.pend_buf_v[:, :, count:count + rest].clone()
            self.pend_k, self.pend_v = self.pend_buf_k[:, :, :rest], self.pend_buf_v[:, :, :rest]
        else:
            self._put_pending(self.pend_k[:, :, count:], self.pend_v[:, :, count:])
        self.pend_start += count
        if self.pend_start_dev is not None:
            self.pend_start_dev.fill_(self.pend_start)

    # ------------------------------------------------------------------ static mode
    @property
    def static_capacity(self) -> int:
        """Pending tokens a static buffer must hold: the window plus one flush block (the most
        there can be right before a flush)."""
        return self.cfg.window + self.cfg.flush_block

    def static_length(self) -> int:
        """Positions a static step's visibility mask must span for this layer (its rows' own
        positions when ragged)."""
        if self.rows is not None:
            return max((row.static_length() for row in self.rows if row.is_initialized), default=0)
        return self.pend_start + self.static_capacity

    def static_blocker(self) -> str | None:
        """Why this layer cannot enter static mode now (None: it can)."""
        if not getattr(self, "is_initialized", False):
            return "the layer holds nothing yet (run the prompt first)"
        if self.rows is not None:
            for i, row in enumerate(self.rows):
                if self.row_first[i] is not None and self.row_end[i] != self.n_seen:
                    return (f"batch row {i} ended with padding (right padding) and cannot take more tokens: pad "
                            "prompts on the left for generation")
                why = row.static_blocker()
                if why is not None:
                    return f"batch row {i}: {why}"
            return None
        if not self.cfg.compressed:
            return "the layer keeps full precision (its window grows without bound)"
        if self.n_seen < self.cfg.sinks:
            return f"only {self.n_seen} of the {self.cfg.sinks} sink tokens seen"
        if self.pend_k.shape[-2] >= self.static_capacity:
            return "a flush is due"
        return None

    def waiting_for_tokens(self) -> bool:
        """Whether the layer (or one of its rows) cannot enter static mode only because it holds
        too few tokens yet (the sinks are filling): decoding goes on dynamically until it can."""
        if self.rows is not None:
            return any(row.waiting_for_tokens() for row in self.rows)
        return not getattr(self, "is_initialized", False) or self.n_seen < self.cfg.sinks

    def make_static(self, state: StaticState) -> None:
        """Enter static mode: move the pending window into a fixed buffer (module docstring). A
        ragged layer's rows each read their own positions (``state.child``: the row's first real
        token is its position 0)."""
        why = self.static_blocker()
        if why is not None:
            raise KvcalibError(f"layer {self.layer_idx} cannot decode in static (CUDA-graph) mode: {why}")
        if self.rows is not None:
            if self.joined() is not None:
                self._make_joint_static()
            else:
                for first, row in zip(self.row_first, self.rows):
                    row.make_static(state.child(first))
        elif not self.pend_buffered:  # e.g. restored from a snapshot: into the buffer (it fits: no flush due)
            self._put_pending(self.pend_k, self.pend_v, force_buffer=True)
        if self.is_sliding and self.rows is None:
            state.window_visible(self.sliding_window)  # its mask exists before any capture
        if self.rows is None and self.stable_launch:
            dev, held = self.device, self.sink_k.shape[2]
            self.pend_start_dev = torch.full((1,), self.pend_start, dtype=torch.long, device=dev)
            self.static_slot = torch.zeros((1,), dtype=torch.long, device=dev)
            self._slot_rel = torch.arange(held + self.static_capacity, device=dev)[None] - held  # (1, S + U)
            self.static_mask = torch.zeros(self._slot_rel.shape, dtype=torch.bool, device=dev)  # (1, S + U)
        self.static = state
        self.awaiting_attention = False

    def make_dynamic(self) -> None:
        """Leave static mode (the pending window stays in its buffer: dynamic decode steps use it too)."""
        if self.static is None:
            return
        if self.rows is not None:
            for row in self.rows:
                row.make_dynamic()
        self.static = None
        self.joint_static = False
        self.pend_start_dev = self.static_slot = self.static_mask = self._slot_rel = None

    def joined(self) -> JointRows | None:
        """A ragged layer's rows in shared allocations for one kernel launch (:mod:`kvcalib.runtime.joint`),
        joined now if they were not (or no longer are: a row outgrew the allocation); None when
        they cannot join (then each row is launched on its own). Called where the kernel runs."""
        joint = self.joint
        if joint is not None and joint.valid(self):
            return joint
        self.joint = JointRows.build(self, joint)
        return self.joint

    def _row_pend_starts(self) -> list[int]:
        """Each row's first pending position, in the batch's positions."""
        return [first + row.pend_start for first, row in zip(self.row_first, self.rows)]

    def _make_joint_static(self) -> None:
        """Static mode of a joined ragged layer: the step writes each row's token at its slot of the
        shared window buffers, ``position - pend_start_dev`` (B,), and its visibility rows
        ``static_mask`` (B, S + U) over the virtual positions (the stable-launch layout, one row each)."""
        joint, dev = self.joint, self.device
        b, s, u = len(self.rows), joint.sinks, joint.pend_k.shape[2]
        self._joint_pend_starts = self._row_pend_starts()
        self.pend_start_dev = torch.tensor(self._joint_pend_starts, dtype=torch.long).to(dev)  # (B,) int64
        self.static_slot = torch.zeros((b,), dtype=torch.long, device=dev)
        self._slot_rel = torch.arange(s + u, device=dev)[None] - s  # (1, S + U)
        self.static_mask = torch.zeros((b, s + u), dtype=torch.bool, device=dev)  # (B, S + U)
        self._batch_index = torch.arange(b, device=dev)  # (B,)
        self.joint_static = True

    def advance_static(self) -> None:
        """Host bookkeeping of one static step (its token is already in the buffer)."""
        self.n_seen += 1
        if self.rows is not None:
            self.chunk_rows, self.chunk_len = [(0, 1)] * len(self.rows), 1
            for i, row in enumerate(self.rows):
                self.row_end[i] += 1
                row.advance_static()
            return
        u = self.pend_k.shape[-2] + 1
        self.pend_k, self.pend_v = self.pend_buf_k[:, :, :u], self.pend_buf_v[:, :, :u]

    def flush_due(self, ahead: int = 0) -> bool:
        """Whether :meth:`flush` would change packed storage now: pending tokens due for packing, or
        (PATS) a block due to move down a tier. The static driver flushes exactly then, so a
        tiered layer's stores stay fixed between two flushes (one captured graph per period).
        ``ahead``: the same question once that many more tokens are counted (the layer-graph
        driver asks ``ahead=1`` before a step: is this step the period's last?)."""
        if self.rows is not None:
            return any(row.flush_due(ahead) for row in self.rows)
        if not self.cfg.compressed:
            return False
        return (self.pend_k.shape[-2] + ahead - self.cfg.window >= self.cfg.flush_block
                or (self.uses_tiers and self.packed.move_due(self.n_seen + ahead)))

    @property
    def stable_launch(self) -> bool:
        """Whether this layer's decode launch stays the same across flushes: a dense, global,
        untiered layer without OTT pools, its pending window in the fixed buffer. Its kernel reads
        the packed store's whole allocation with the live count on the device
        (:meth:`~kvcalib.runtime.store.PackedStore.capacity_view`) and the window at a *virtual*
        position: the sinks at ``[0, S)``, the buffer's slots at ``[S, S + U)``, visible up to the
        step's token (:meth:`decode_visibility`; in static mode :attr:`static_mask`, computed on
        the device from :attr:`pend_start_dev`). Positions only select what is visible there (a
        global layer reads no mask over its packed tokens, no pool positions), so the virtual
        layout computes what the absolute one did, and a CUDA graph of the step outlives a flush
        (it changes the packed count and pend_start, both read from the device), until the store
        is reallocated (:data:`~kvcalib.runtime.store.GROWTH`).

        Only while the kernel's work is small (:data:`STABLE_LAUNCH_MAX_WORK`): reading the whole
        allocation with a range costs 8-29% more GPU time per call (``benchmarks/stable_launch.py``,
        H100), hidden behind the host time of an eager step when the call is short, not when the
        GPU is the bound (batch 8 / 32k, Mistral-7B shape: 114 -> 132 us). The switch falls at a
        flush (the packed count is all that changes), the same in dynamic and static mode."""
        if self.rows is not None:  # a padded batch's rows: joined in static mode (joint.py)
            return self.joint_static
        if not (self.cfg.compressed and self.pend_buffered and not self.is_sliding
                and not self.codec.tiered and not self.codec.pool_size):
            return False
        b, h = self.pend_buf_k.shape[:2]
        return b * h * self.packed.n <= STABLE_LAUNCH_MAX_WORK

    def decode_visibility(self) -> tuple[torch.Tensor, bool]:
        """What a decode step's query (position ``n_seen - 1``) sees of this dense layer, in the
        layout the fixed pending buffer gives the kernel: (1, pend_start + static_capacity) bool
        over positions -- the values a static step's :class:`StaticState` holds -- and whether
        the packed tokens read it too (a sliding window's bound). A dense layer holds no padding,
        so nothing else is hidden. Shared by the layers of one step (one small op per step).
        A stable-launch layer (:attr:`stable_launch`): (1, S + static_capacity) over its virtual
        positions, the first S + U true (U pending tokens, the step's included)."""
        if self.stable_launch:
            held, u = self.sink_k.shape[2], self.pend_k.shape[-2]
            key = (self.device, "stable", held, self.static_capacity, u)
            mask = _DECODE_MASKS.get(key)
            if mask is None:
                if len(_DECODE_MASKS) >= 64:
                    _DECODE_MASKS.clear()
                mask = torch.arange(held + self.static_capacity, device=self.device)[None] < held + u  # (1, S + U)
                _DECODE_MASKS[key] = mask
            return mask, False
        length = self.pend_start + self.static_capacity
        key = (self.device, length, self.n_seen - 1, self.sliding_window)
        mask = _DECODE_MASKS.get(key)
        if mask is None:
            if len(_DECODE_MASKS) >= 64:
                _DECODE_MASKS.clear()
            pos = torch.arange(length, device=self.device)[None]  # (1, L)
            mask = pos <= self.n_seen - 1
            if self.sliding_window is not None:
                mask &= pos > self.n_seen - 1 - self.sliding_window
            _DECODE_MASKS[key] = mask
        return mask, self.sliding_window is not None

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> dict[str, int]:
        """Actual bytes held, by component (a ragged layer: its rows' together; padding is not held)."""
        if not self.is_initialized:
            return {}
        if self.rows is not None:
            total: dict[str, int] = {}
            for row in self.rows:
                for k, v in row.nbytes().items():
                    total[k] = total.get(k, 0) + v
            return total

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else int(t.numel() * t.element_size())
        return {
            "sinks": size(self.sink_k) + size(self.sink_v),
            "window": size(self.pend_k) + size(self.pend_v),  # the pending tokens
            # the rest of the window's fixed buffer (held, not in Recipe.memory's accounting): its
            # free slots, or all of it while a prompt's window is past it (until its flush)
            "window_free": size(self.pend_buf_k) + size(self.pend_buf_v)
            - (size(self.pend_k) + size(self.pend_v) if self.pend_buffered else 0),
            **self.packed.nbytes(),  # codes, scales, means, OTT masks (all tiers)
            **self.outliers.nbytes(),  # OTT pools, positions, counters
        }

    def cached_elements(self) -> int:
        """K and V elements the cache stands for (effective bits' denominator): 2 x rows x kv heads
        x head_dim x the tokens this layer must hold (min(T, window) on a sliding layer,
        :func:`~kvcalib.layout.held_elements`), real tokens only (a padded row counts its own)."""
        if not self.is_initialized:
            return 0
        if self.rows is not None:
            return sum(row.cached_elements() for row in self.rows)
        b, h, _, d = self.sink_k.shape
        return b * held_elements(h, d, self.n_seen, [self.sliding_window])


def _reachable_tensors(root: Any, seen: set[int]):
    """Yield every tensor reachable from ``root`` through lists, tuples, sets, dicts and kvcalib's
    own objects (their attributes), each object once (``seen``: ids, shared across calls). Foreign
    objects (a CUDA graph, a model) are not entered: what they hold is not the cache's."""
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif (type(obj).__module__ or "").startswith("kvcalib."):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, name, None))


def _real_runs(real: list[list[bool]]) -> list[tuple[int, int] | None]:
    """Per row of ``real`` (B lists of T bools): the run ``(a, c)`` of its True entries, or None
    when it has none; raises when a row's real tokens are not contiguous (padding between them)."""
    rows = []
    for i, r in enumerate(real):
        idx = [t for t, x in enumerate(r) if x]
        if not idx:
            rows.append(None)
            continue
        a, c = idx[0], idx[-1] + 1
        if c - a != len(idx):
            raise KvcalibError(f"batch row {i} has padding between real tokens (positions {a}..{c - 1} of the step "
                               "are not all real): CompressedCache keeps each row's tokens as one run; pad prompts on "
                               "the left for generation (tokenizer.padding_side = 'left')")
        rows.append((a, c))
    return rows


class CompressedCache(Cache):
    """A transformers Cache with one :class:`CompressedLayer` per model layer.

    Build it with :meth:`from_recipe` (recommended) or from explicit layer configs. Works with
    ``model.generate(..., past_key_values=cache)`` for batches (left or right padding), GQA,
    MQA and sliding-window layers.
    """

    def __init__(self, layer_configs: list[LayerConfig], codecs: list[LayerCodec] | None = None,
                 sliding_windows: list[int | None] | None = None, recipe: Recipe | None = None,
                 layer_graphs: str = "auto") -> None:
        n = len(layer_configs)
        codecs = codecs or [LayerCodec(c) for c in layer_configs]
        sliding_windows = sliding_windows or [None] * n
        layers = [CompressedLayer(c, codecs[i], i, sliding_windows[i]) for i, c in enumerate(layer_configs)]
        super().__init__(layers=layers)
        self.recipe = recipe
        # eager decode steps: each layer's attention a static step replayed from its own CUDA graph
        # ("auto": on CUDA with the Triton kernels; "off"; "eager": static steps, no capture)
        self.layer_graphs = LayerGraphs(layer_graphs)
        for layer in layers:
            layer.graphs = self.layer_graphs

    @classmethod
    def from_recipe(cls, model: Any, recipe: "Recipe | str", *, switch_attention: bool = True,
                    layer_graphs: str = "auto") -> "CompressedCache":
        """Cache for ``model`` following ``recipe`` (a Recipe, a path, or a preset name).

        Validates that the recipe fits the model (refuses another model's recipe) and, unless
        ``switch_attention=False``, sets the model's attention to kvcalib's. ``layer_graphs``:
        how eager decode steps run each layer's attention (:mod:`kvcalib.runtime.layer_graphs`):
        ``"auto"`` (a CUDA graph per layer on CUDA), ``"off"``, ``"eager"`` (no capture).
        """
        from kvcalib.models import model_info
        from kvcalib.recipe import build_codecs

        recipe = resolve_recipe(recipe)
        info = model_info(model.config, getattr(model.config, "_name_or_path", "model") or "model")
        recipe.check_model(info)
        configs = recipe.layer_configs(info.num_layers)
        if switch_attention:
            use_kvcalib_attention(model)
        return cls(configs, build_codecs(recipe, configs, info.head_dim), list(info.sliding_window), recipe,
                   layer_graphs=layer_graphs)

    # ------------------------------------------------------------------ static mode (CUDA graphs)
    def static_blockers(self) -> list[str]:
        """Why the cache cannot enter static mode now, one line per layer that cannot (empty: it can)."""
        return [f"layer {layer.layer_idx}: {why}" for layer in self.layers
                if (why := layer.static_blocker()) is not None]

    def make_static(self, position: torch.Tensor) -> StaticState:
        """Enter (or refresh, after a flush) static mode; ``position`` (1,) int64 on the cache's
        device holds the next token's absolute position. Returns the shared state."""
        self.layer_graphs.release_all()  # the caller's steps own static mode from here
        blockers = self.static_blockers()
        if blockers:
            raise KvcalibError("the cache cannot decode in static (CUDA-graph) mode: " + "; ".join(blockers))
        length = max(layer.static_length() for layer in self.layers)
        state = StaticState.create(position, length)
        for layer in self.layers:
            layer.make_static(state)
        return state

    def make_dynamic(self) -> None:
        for layer in self.layers:
            layer.make_dynamic()

    def advance_static(self) -> None:
        """Host bookkeeping after a static step ran (eagerly or replayed)."""
        for layer in self.layers:
            layer.advance_static()

    def flush_due(self) -> bool:
        return any(layer.flush_due() for layer in self.layers)

    def flush(self) -> None:
        """Flush every layer (static mode defers the flush of a step to its driver)."""
        self.layer_graphs.release_all()  # a flush changes what a layer's graph baked in
        for layer in self.layers:
            layer.flush()

    def nbytes(self) -> dict[str, int]:
        """Actual bytes the cache holds (all layers), by component."""
        total: dict[str, int] = {}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] = total.get(k, 0) + v
        return total

    def allocated_bytes(self) -> dict[str, int]:
        """Device memory the cache's tensors occupy, every byte: each distinct storage reachable
        from its layers (and their per-layer CUDA graphs' input and output buffers) counted once and
        whole. Where :meth:`nbytes` counts the live tokens (what :meth:`effective_bits` and the
        recipe's accounting divide), this adds what the allocations hold beyond them: a packed
        store's capacity past its live tokens (``store.GROWTH``, at least ``MIN_SLACK_BLOCKS``
        blocks, so that a flush appends in place), the joined rows of a padded batch each holding the
        capacity of the row that needs most (``joint.py``), static mode's device counters. Views of
        one allocation (a joined row's tensors, the window's pending tokens in its fixed buffer) are
        not counted twice.

        ``kv``: everything but the codecs' fitted tensors; ``side``: those (rotation matrices, clip
        scales, channel orders, codebooks: fixed in size, whatever the context). Only tensors on the
        layers' device count (a recipe's CPU copy is not the cache's)."""
        devices = {layer.device for layer in self.layers if layer.is_initialized}
        seen: set[int] = set()
        storages: set[tuple[torch.device, int]] = set()
        out = {"kv": 0, "side": 0}
        # the codecs first, so that their tensors count as side bytes wherever else they are reached
        roots = [("side", [layer.codec for layer in self.layers]), ("kv", [self.layers, self.layer_graphs])]
        for part, objs in roots:
            for t in _reachable_tensors(objs, seen):
                storage = t.untyped_storage()
                key = (t.device, storage.data_ptr())
                if t.device not in devices or key in storages:
                    continue
                storages.add(key)
                out[part] += int(storage.nbytes())
        return out

    def effective_bits(self) -> float:
        """8 x held bytes / (2 x kv_heads x head_dim x the sum over layers and rows of the tokens
        each must hold) at the current length: a sliding-window layer counts min(T, window)
        (``kvcalib.layout.ACCOUNTING``, as ``Recipe.memory``), real tokens only (padding is neither
        held nor counted).

        Full-precision segments count at their real element size (fp32 on CPU doubles them);
        ``Recipe.memory`` gives the accounting at 16-bit storage for any context.
        """
        held = sum(self.nbytes().values())
        elements = sum(layer.cached_elements() for layer in self.layers)
        return 8.0 * held / max(elements, 1)

    def padding_mask(self) -> torch.Tensor | None:
        """(B, T) bool over the cached positions, False at padding; None when there is none."""
        for layer in self.layers:
            if layer.is_initialized and layer.rows is not None:
                return layer.padding_mask()
        return None
