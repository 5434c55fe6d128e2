"""``CompressedCache``: a ``transformers.Cache`` holding packed 2/4/8-bit K/V per layer.

Per layer the cache keeps, for a batch (B, H kv-heads, D head_dim):

- sinks: the first S positions, full precision, (B, H, S, D);
- packed blocks: older tokens, flushed in blocks of ``flush_block`` tokens (a key group), through
  the layer's :class:`~kvcalib.codec.LayerCodec`, held in one store per PATS tier
  (:mod:`kvcalib.runtime.tiers`; one store without a schedule);
- pending: every later token in full precision, (B, H, U, D), with window <= U < window + block
  after each flush;
- OTT (when the codec's ``pool_size`` > 0, :mod:`kvcalib.runtime.outlier_pool`): the outlier
  pool and extra pool in full precision, and one quant mask per packed block.

A flush of one block (:meth:`CompressedLayer._flush_block`): choose its outliers (OTT), encode K
and V without them, store codes + mask. After the flushes of a step, :meth:`PackedTiers.advance`
requantizes the blocks whose tier now says fewer bits (PATS).

Timing (this is what the decode-faithful simulation reproduces): ``update`` only appends; the
registered attention function attends over sinks + packed blocks + pending, and only *then* the
layer flushes what is due. So the prompt's own attention always sees full-precision prompt K/V,
and a decode step at position i sees the blocks flushed after step i-1.

Attention must go through :func:`kvcalib.runtime.attention.kvcalib_attention` (the model's
``attn_implementation="kvcalib"``); :meth:`CompressedCache.from_recipe` switches the model to it.

Static mode (:meth:`CompressedCache.make_static`, used by :mod:`kvcalib.runtime.graphs` to replay
decode steps from CUDA graphs): the pending window lives in a fixed buffer of ``window +
flush_block`` tokens, a step writes its token at the slot a device tensor names
(:class:`~kvcalib.runtime.static.StaticState`), attention reads the whole buffer under a device
visibility mask, and nothing on the host changes during the step: the driver advances the
bookkeeping (:meth:`CompressedCache.advance_static`) and flushes between steps, so between two
flushes every step launches the same kernels on the same buffers. A PATS layer's block moving
down a tier is a flush for that purpose (:meth:`CompressedLayer.flush_due`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig, held_elements
from kvcalib.recipe import Recipe, resolve_recipe
from kvcalib.codec import LayerCodec
from kvcalib.runtime.outlier_pool import OutlierPool, pack_keep
from kvcalib.runtime.static import StaticState
from kvcalib.runtime.store import GrowBuffer, PackedStore, PackedView  # noqa: F401  (re-exported)
from kvcalib.runtime.tiers import PackedTiers

LAYER_ATTR = "_kvcalib_layer"  # attribute on the key tensor returned by update()


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
        self.outliers = OutlierPool(self.codec.pool_size)  # OTT pools (inactive at pool 0)
        self.valid: torch.Tensor | None = None  # (B, n_seen) bool: False = padding
        self.awaiting_attention = False
        self.static: StaticState | None = None  # set in static mode (module docstring)
        self.pend_buf_k: torch.Tensor | None = None  # static mode: (B, H, window + block, D)
        self.pend_buf_v: torch.Tensor | None = None

    # ------------------------------------------------------------------ Cache API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros((b, h, 0, d))
        self.sink_k, self.sink_v = empty, empty.clone()
        self.pend_k, self.pend_v = empty.clone(), empty.clone()
        self.valid = None  # created on the first padding seen; None = every position is real
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new K/V (B, H, T_new, D). Returns the new states tagged with this layer."""
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
        t_new = key_states.shape[-2]
        n_sink_free = max(0, self.cfg.sinks - self.n_seen) if self.cfg.compressed else 0
        take = min(n_sink_free, t_new)
        if take:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :take]], dim=-2)
            self.pend_start += take
        if t_new > take:
            self.pend_k = torch.cat([self.pend_k, key_states[:, :, take:]], dim=-2)
            self.pend_v = torch.cat([self.pend_v, value_states[:, :, take:]], dim=-2)
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones((self.valid.shape[0], t_new))], dim=1)
        self.n_seen += t_new
        self.awaiting_attention = True
        setattr(key_states, LAYER_ATTR, self)
        return key_states, value_states

    def _update_static(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Static mode: write the step's token (B, H, 1, D) at its slot of the pending buffer, the
        slot read from the device (``static.position - pend_start``); no host state changes."""
        if key_states.shape[-2] != 1:
            raise KvcalibError("a static (CUDA-graph) CompressedCache takes one token per step: leave static mode "
                               "(cache.make_dynamic()) before a prefill")
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
        self.__init__(self.cfg, self.codec, self.layer_idx, self.sliding_window)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KvcalibError("beam search is not supported by CompressedCache: use greedy or sampling decoding.")

    # ------------------------------------------------------------------ attention side
    def mark_padding(self, key_visible: torch.Tensor) -> None:
        """Record which positions are real tokens: ``key_visible`` (B, m) bool over the last m
        positions (all ``n_seen``, or those a sliding window still shows) is True where any query
        of this step may attend to the key. Padding is never visible."""
        if self.valid is None:
            if bool(key_visible.all()):
                return
            self.valid = torch.ones((key_visible.shape[0], self.n_seen), dtype=torch.bool, device=self.device)
        start = self.valid.shape[1] - key_visible.shape[1]
        self.valid[:, start:] &= key_visible.to(self.valid.device)

    def segments(self, block_tokens: int = 256, dtype: torch.dtype = torch.float32):
        """Yield :class:`Segment` s in ``dtype`` over everything cached: sinks, packed blocks in
        position order (dequantized a few at a time, never the whole cache; OTT slots masked by
        ``keep``), the outlier pools (``positions``), then the pending window."""
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
        """RoPE positions (B|1, n) int64 of absolute positions [start, start + n), as the model's
        forward gives them (padding skipped: generate()'s ``attention_mask.cumsum(-1) - 1``), for a
        codec whose states read them (``codec.needs_positions``); None otherwise."""
        if not self.codec.needs_positions:
            return None
        if self.valid is None:
            return torch.arange(start, start + n, device=self.device)[None]  # (1, n)
        return (self.valid.long().cumsum(1) - 1)[:, start:start + n].clamp_min(0)  # (B, n)

    def _flush_block(self, off: int, block: int) -> None:
        """Pending tokens [off, off + block) -> packed storage: OTT selection, then encode."""
        start = self.pend_start + off  # absolute position of the block's first token
        k_blk = self.pend_k[:, :, off:off + block]  # (B, H, G, D)
        v_blk = self.pend_v[:, :, off:off + block]  # (B, H, G, D)
        valid = None if self.valid is None else self.valid[:, start:start + block]  # (B, G) padding
        keep = self.outliers.select(k_blk, v_blk, start, valid)  # (B, H, G): False = into the pool; or None
        pos = self.rope_positions(start, block)  # (B|1, G) or None
        k_packed = self.codec.encode_keys(k_blk, valid, keep, pos)
        v_packed = self.codec.encode_values(v_blk, valid, keep, pos)
        self.packed.append(start, k_packed, v_packed, block, None if keep is None else pack_keep(keep))

    def flush(self) -> None:
        """Move due pending tokens into packed storage, move aged blocks down their PATS tiers;
        drop what a sliding window no longer needs."""
        self.awaiting_attention = False
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
            self.packed.advance(self.n_seen, self.valid)
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
        """Forget the oldest ``count`` pending tokens (flushed or out of the window). Static mode
        shifts the rest to the front of the same buffer (its address must not change)."""
        rest = self.pend_k.shape[-2] - count
        if self.static is not None:
            self.pend_buf_k[:, :, :rest] = self.pend_buf_k[:, :, count:count + rest].clone()
            self.pend_buf_v[:, :, :rest] = self.pend_buf_v[:, :, count:count + rest].clone()
            self.pend_k, self.pend_v = self.pend_buf_k[:, :, :rest], self.pend_buf_v[:, :, :rest]
        else:
            self.pend_k = self.pend_k[:, :, count:].clone()
            self.pend_v = self.pend_v[:, :, count:].clone()
        self.pend_start += count

    # ------------------------------------------------------------------ static mode
    @property
    def static_capacity(self) -> int:
        """Pending tokens a static buffer must hold: the window plus one flush block (the most
        there can be right before a flush)."""
        return self.cfg.window + self.cfg.flush_block

    def static_blocker(self) -> str | None:
        """Why this layer cannot enter static mode now (None: it can)."""
        if not getattr(self, "is_initialized", False):
            return "the layer holds nothing yet (run the prompt first)"
        if not self.cfg.compressed:
            return "the layer keeps full precision (its window grows without bound)"
        if self.n_seen < self.cfg.sinks:
            return f"only {self.n_seen} of the {self.cfg.sinks} sink tokens seen"
        if self.pend_k.shape[-2] >= self.static_capacity:
            return "a flush is due"
        return None

    def make_static(self, state: StaticState) -> None:
        """Enter static mode: move the pending window into a fixed buffer (module docstring)."""
        why = self.static_blocker()
        if why is not None:
            raise KvcalibError(f"layer {self.layer_idx} cannot decode in static (CUDA-graph) mode: {why}")
        if self.static is None:
            b, h, u, d = self.pend_k.shape
            self.pend_buf_k = self.pend_k.new_zeros((b, h, self.static_capacity, d))
            self.pend_buf_v = self.pend_v.new_zeros((b, h, self.static_capacity, d))
            self.pend_buf_k[:, :, :u] = self.pend_k
            self.pend_buf_v[:, :, :u] = self.pend_v
            self.pend_k, self.pend_v = self.pend_buf_k[:, :, :u], self.pend_buf_v[:, :, :u]
        if self.is_sliding:
            state.window_visible(self.sliding_window)  # its mask exists before any capture
        self.static = state
        self.awaiting_attention = False

    def make_dynamic(self) -> None:
        """Leave static mode: the pending window becomes a tensor of its own again."""
        if self.static is None:
            return
        self.pend_k, self.pend_v = self.pend_k.clone(), self.pend_v.clone()
        self.pend_buf_k = self.pend_buf_v = None
        self.static = None

    def advance_static(self) -> None:
        """Host bookkeeping of one static step (its token is already in the buffer)."""
        u = self.pend_k.shape[-2] + 1
        self.pend_k, self.pend_v = self.pend_buf_k[:, :, :u], self.pend_buf_v[:, :, :u]
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones((self.valid.shape[0], 1))], dim=1)
        self.n_seen += 1

    def flush_due(self) -> bool:
        """Whether :meth:`flush` would change packed storage now: pending tokens due for packing, or
        (PATS) a block due to move down a tier. The static driver flushes exactly then, so a
        tiered layer's stores stay fixed between two flushes (one captured graph per period)."""
        if not self.cfg.compressed:
            return False
        return (self.pend_k.shape[-2] - self.cfg.window >= self.cfg.flush_block
                or (self.uses_tiers and self.packed.move_due(self.n_seen)))

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> dict[str, int]:
        """Actual bytes held, by component."""
        if not self.is_initialized:
            return {}
        def size(t: torch.Tensor) -> int:
            return int(t.numel() * t.element_size())
        out = {
            "sinks": size(self.sink_k) + size(self.sink_v),
            # static mode holds the whole fixed buffer, used or not
            "window": (size(self.pend_buf_k) + size(self.pend_buf_v)) if self.static is not None
            else size(self.pend_k) + size(self.pend_v),
            **self.packed.nbytes(),  # codes, scales, means, OTT masks (all tiers)
            **self.outliers.nbytes(),  # OTT pools, positions, counters
            "padding_mask": 0 if self.valid is None else size(self.valid),
        }
        return out


class CompressedCache(Cache):
    """A transformers Cache with one :class:`CompressedLayer` per model layer.

    Build it with :meth:`from_recipe` (recommended) or from explicit layer configs. Works with
    ``model.generate(..., past_key_values=cache)`` for batches (left or right padding), GQA,
    MQA and sliding-window layers.
    """

    def __init__(self, layer_configs: list[LayerConfig], codecs: list[LayerCodec] | None = None,
                 sliding_windows: list[int | None] | None = None, recipe: Recipe | None = None) -> None:
        n = len(layer_configs)
        codecs = codecs or [LayerCodec(c) for c in layer_configs]
        sliding_windows = sliding_windows or [None] * n
        layers = [CompressedLayer(c, codecs[i], i, sliding_windows[i]) for i, c in enumerate(layer_configs)]
        super().__init__(layers=layers)
        self.recipe = recipe

    @classmethod
    def from_recipe(cls, model: Any, recipe: "Recipe | str", *, switch_attention: bool = True) -> "CompressedCache":
        """Cache for ``model`` following ``recipe`` (a Recipe, a path, or a preset name).

        Validates that the recipe fits the model (refuses another model's recipe) and, unless
        ``switch_attention=False``, sets the model's attention to kvcalib's.
        """
        from kvcalib.models import model_info
        from kvcalib.runtime.attention import use_kvcalib_attention
        from kvcalib.recipe import build_codecs

        recipe = resolve_recipe(recipe)
        info = model_info(model.config, getattr(model.config, "_name_or_path", "model") or "model")
        recipe.check_model(info)
        configs = recipe.layer_configs(info.num_layers)
        if switch_attention:
            use_kvcalib_attention(model)
        return cls(configs, build_codecs(recipe, configs, info.head_dim), list(info.sliding_window), recipe)

    # ------------------------------------------------------------------ static mode (CUDA graphs)
    def static_blockers(self) -> list[str]:
        """Why the cache cannot enter static mode now, one line per layer that cannot (empty: it can)."""
        return [f"layer {layer.layer_idx}: {why}" for layer in self.layers
                if (why := layer.static_blocker()) is not None]

    def make_static(self, position: torch.Tensor) -> StaticState:
        """Enter (or refresh, after a flush) static mode; ``position`` (1,) int64 on the cache's
        device holds the next token's absolute position. Returns the shared state."""
        blockers = self.static_blockers()
        if blockers:
            raise KvcalibError("the cache cannot decode in static (CUDA-graph) mode: " + "; ".join(blockers))
        length = max(layer.pend_start + layer.static_capacity for layer in self.layers)
        state = StaticState.create(position, length, self.layers[0].valid)
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
        for layer in self.layers:
            layer.flush()

    def nbytes(self) -> dict[str, int]:
        """Actual bytes the cache holds (all layers), by component."""
        total: dict[str, int] = {}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] = total.get(k, 0) + v
        return total

    def effective_bits(self) -> float:
        """8 x held bytes / (2 x kv_heads x head_dim x batch x the sum over layers of the tokens
        each must hold) at the current length T: a sliding-window layer counts min(T, window)
        (``kvcalib.layout.ACCOUNTING``, as ``Recipe.memory``).

        Full-precision segments count at their real element size (fp32 on CPU doubles them);
        ``Recipe.memory`` gives the accounting at 16-bit storage for any context.
        """
        held = sum(self.nbytes().values())
        elements = 0
        for layer in self.layers:
            if layer.is_initialized:
                b, h, _, d = layer.sink_k.shape
                elements += b * held_elements(h, d, layer.n_seen, [layer.sliding_window])
        return 8.0 * held / max(elements, 1)
