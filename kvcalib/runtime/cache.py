"""``CompressedCache``: a ``transformers.Cache`` holding packed 2/4/8-bit K/V per layer.

Per layer the cache keeps, for a batch (B, H kv-heads, D head_dim):

- sinks: the first S positions, full precision, (B, H, S, D);
- packed blocks: older tokens, flushed in blocks of ``flush_block`` tokens (a key group), through
  the layer's :class:`~kvcalib.runtime.codec.LayerCodec`;
- pending: every later token in full precision, (B, H, U, D), with window <= U < window + block
  after each flush.

Timing (this is what the decode-faithful simulation reproduces): ``update`` only appends; the
registered attention function attends over sinks + packed blocks + pending, and only *then* the
layer flushes what is due. So the prompt's own attention always sees full-precision prompt K/V,
and a decode step at position i sees the blocks flushed after step i-1.

Attention must go through :func:`kvcalib.runtime.attention.kvcalib_attention` (the model's
``attn_implementation="kvcalib"``); :meth:`CompressedCache.from_recipe` switches the model to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcalib.errors import KvcalibError
from kvcalib.recipe import LayerConfig, Recipe, resolve_recipe
from kvcalib.runtime.codec import LayerCodec, PackedBlock

LAYER_ATTR = "_kvcalib_layer"  # attribute on the key tensor returned by update()


class GrowBuffer:
    """A tensor that grows along dim 2 with capacity doubling (amortised O(1) appends)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.n = 0  # used entries along dim 2
        self.front = 0  # entries dropped from the front (sliding layers)

    def append(self, x: torch.Tensor) -> None:
        """Append ``x`` (B, H, N, ...) along dim 2."""
        need = self.n + x.shape[2]
        if self.buf is None or need > self.buf.shape[2]:
            live = self.n - self.front
            cap = max(live + x.shape[2], 2 * live, 16)
            new = x.new_empty((*x.shape[:2], cap, *x.shape[3:]))
            if live:
                new[:, :, :live] = self.buf[:, :, self.front:self.n]
            self.n, self.front, self.buf = live, 0, new
            need = live + x.shape[2]
        self.buf[:, :, self.n:need] = x
        self.n = need

    def drop_front(self, count: int) -> None:
        self.front = min(self.n, self.front + count)

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


class PackedStore:
    """All flushed tokens of one layer, K and V, in contiguous growable buffers."""

    def __init__(self, cfg: LayerConfig) -> None:
        self.cfg = cfg
        self.start = 0  # absolute position of the first live packed token
        self.n = 0  # live packed tokens
        self.parts = {name: GrowBuffer() for name in
                      ("k_codes", "k_scale", "k_zero", "k_raw", "v_codes", "v_scale", "v_zero", "v_raw",
                       "k_mean", "v_mean", "k_mean_codes", "k_mean_scale", "k_mean_zero",
                       "v_mean_codes", "v_mean_scale", "v_mean_zero")}

    def append(self, start: int, k: PackedBlock, v: PackedBlock, n: int) -> None:
        if self.n == 0:
            self.start = start
        for side, blk in (("k", k), ("v", v)):
            if blk.quantized is not None:
                self.parts[f"{side}_codes"].append(blk.quantized.codes)
                self.parts[f"{side}_scale"].append(blk.quantized.scale)
                self.parts[f"{side}_zero"].append(blk.quantized.zero)
            else:
                self.parts[f"{side}_raw"].append(blk.raw)
            if blk.mean is not None:
                self.parts[f"{side}_mean"].append(blk.mean)
            if blk.mean_q is not None:
                self.parts[f"{side}_mean_codes"].append(blk.mean_q.codes)
                self.parts[f"{side}_mean_scale"].append(blk.mean_q.scale)
                self.parts[f"{side}_mean_zero"].append(blk.mean_q.zero)
        self.n += n

    def _scale_rows(self, side: str, tokens: int) -> int:
        """Rows of the scale tensor along dim 2 for ``tokens`` tokens."""
        if side == "k" and self.cfg.k_axis == "channel":
            return tokens // self.cfg.k_group
        return tokens

    def drop_front(self, tokens: int) -> None:
        """Forget the oldest ``tokens`` packed tokens (a multiple of the flush block)."""
        tokens = min(tokens, self.n)
        for side in ("k", "v"):
            for name in ("codes", "raw", "mean", "mean_codes", "mean_scale", "mean_zero"):
                self.parts[f"{side}_{name}"].drop_front(tokens)
            rows = self._scale_rows(side, tokens)
            self.parts[f"{side}_scale"].drop_front(rows)
            self.parts[f"{side}_zero"].drop_front(rows)
        self.start += tokens
        self.n -= tokens

    def view(self) -> PackedView:
        p = {k: b.view() for k, b in self.parts.items() if "mean" not in k}
        return PackedView(self.cfg, self.start, self.n, **p)

    def centred(self) -> bool:
        return any(self.parts[n].buf is not None for n in ("k_mean", "v_mean", "k_mean_codes", "v_mean_codes"))

    def block(self, side: str, a: int, b: int) -> PackedBlock:
        """Tokens [a, b) (relative to the live start) of one side, as a PackedBlock of views."""
        from kvcalib.quant.uniform import QuantizedTensor

        raw = self.parts[f"{side}_raw"].view()
        if raw is not None:
            return PackedBlock(None, raw[:, :, a:b])
        bits = self.cfg.k_bits if side == "k" else self.cfg.v_bits
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

    def nbytes(self) -> dict[str, int]:
        out = {"k_packed": 0, "k_scales": 0, "v_packed": 0, "v_scales": 0}
        for side in ("k", "v"):
            out[f"{side}_packed"] += self.parts[f"{side}_codes"].nbytes() + self.parts[f"{side}_raw"].nbytes()
            out[f"{side}_scales"] += self.parts[f"{side}_scale"].nbytes() + self.parts[f"{side}_zero"].nbytes()
            mean = sum(self.parts[f"{side}_{n}"].nbytes() for n in ("mean", "mean_codes", "mean_scale", "mean_zero"))
            if mean:
                out[f"{side}_mean"] = mean
        return out


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
        self.packed = PackedStore(cfg)
        self.valid: torch.Tensor | None = None  # (B, n_seen) bool: False = padding
        self.awaiting_attention = False

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
        """Record which positions are real tokens: ``key_visible`` (B, n_seen) bool is True where
        any query of this step may attend to the key. Padding is never visible."""
        if self.valid is None:
            if bool(key_visible.all()):
                return
            self.valid = torch.ones((key_visible.shape[0], self.n_seen), dtype=torch.bool, device=self.device)
        start = self.valid.shape[1] - key_visible.shape[1]
        self.valid[:, start:] &= key_visible.to(self.valid.device)

    def segments(self, block_tokens: int = 256, dtype: torch.dtype = torch.float32):
        """Yield (start, K (B,H,N,D), V (B,H,N,D)) in ``dtype`` over everything cached, in
        position order, dequantizing packed blocks a few at a time (never the whole cache)."""
        if self.sink_k.shape[-2] and not self.sinks_dropped:
            yield 0, self.sink_k.to(dtype), self.sink_v.to(dtype)
        step = max(self.cfg.flush_block, block_tokens // self.cfg.flush_block * self.cfg.flush_block)
        for a in range(0, self.packed.n, step):
            b = min(a + step, self.packed.n)
            yield (self.packed.start + a, self.codec.decode_keys(self.packed.block("k", a, b), dtype),
                   self.codec.decode_values(self.packed.block("v", a, b), dtype))
        if self.pend_k.shape[-2]:
            yield self.pend_start, self.pend_k.to(dtype), self.pend_v.to(dtype)

    @property
    def n_packed(self) -> int:
        return self.packed.n

    def packed_view(self) -> PackedView:
        """Contiguous views of the packed tokens, for the Triton path."""
        return self.packed.view()

    def flush(self) -> None:
        """Move due pending tokens into packed storage; drop what a sliding window no longer needs."""
        self.awaiting_attention = False
        cfg = self.cfg
        if cfg.compressed:
            block = cfg.flush_block
            due = (self.pend_k.shape[-2] - cfg.window) // block * block
            if due > 0:
                for off in range(0, due, block):
                    k_blk = self.pend_k[:, :, off:off + block]  # (B, H, G, D)
                    v_blk = self.pend_v[:, :, off:off + block]
                    valid = (None if self.valid is None else
                             self.valid[:, self.pend_start + off:self.pend_start + off + block])  # (B, G)
                    self.packed.append(self.pend_start + off, self.codec.encode_keys(k_blk, valid),
                                       self.codec.encode_values(v_blk, valid), block)
                self.pend_k = self.pend_k[:, :, due:].clone()
                self.pend_v = self.pend_v[:, :, due:].clone()
                self.pend_start += due
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
                cut = self.pend_k.shape[-2] - self.sliding_window
                self.pend_k = self.pend_k[:, :, cut:].clone()
                self.pend_v = self.pend_v[:, :, cut:].clone()
                self.pend_start += cut

    # ------------------------------------------------------------------ memory
    def nbytes(self) -> dict[str, int]:
        """Actual bytes held, by component."""
        if not self.is_initialized:
            return {}
        def size(t: torch.Tensor) -> int:
            return int(t.numel() * t.element_size())
        out = {
            "sinks": size(self.sink_k) + size(self.sink_v),
            "window": size(self.pend_k) + size(self.pend_v),
            **self.packed.nbytes(),
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
        from kvcalib.runtime.state import build_codecs

        recipe = resolve_recipe(recipe)
        info = model_info(model.config, getattr(model.config, "_name_or_path", "model") or "model")
        recipe.check_model(info)
        configs = recipe.layer_configs(info.num_layers)
        if switch_attention:
            use_kvcalib_attention(model)
        return cls(configs, build_codecs(recipe, configs, info.head_dim), list(info.sliding_window), recipe)

    def nbytes(self) -> dict[str, int]:
        """Actual bytes the cache holds (all layers), by component."""
        total: dict[str, int] = {}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] = total.get(k, 0) + v
        return total

    def effective_bits(self) -> float:
        """8 x held bytes / (2 x layers x kv_heads x head_dim x T x batch) at the current length.

        Full-precision segments count at their real element size (fp32 on CPU doubles them);
        ``Recipe.memory`` gives the accounting at 16-bit storage for any context.
        """
        held = sum(self.nbytes().values())
        elements = 0
        for layer in self.layers:
            if layer.is_initialized:
                b, h, _, d = layer.sink_k.shape
                elements += 2 * b * h * d * layer.n_seen
        return 8.0 * held / max(elements, 1)
