"""How one layer turns a block of full-precision K/V into packed storage and back.

The codec is the single place that knows a layer's quantization layout; the cache stores what it
returns and the attention reads blocks back through it. Fitted state from the recipe enters as
the layer's method states (:class:`~kvcalib.methods.base.MethodState`, one per active method of
:func:`kvcalib.methods.registry`), and the codec applies them without naming any:

- encode a side: every state's ``encode`` in registry order (e.g. TaDA's centering stores a
  per-token mean and passes the deviations on, SKVQ's reordering permutes channels), then the
  uniform quantizer with the states' clip scale, ranges over the tokens the padding mask and the
  OTT keep mask leave;
- decode: dequantize, then every state's ``decode`` in reverse order;
- the cache structure the states ask for: a full-precision token pool (:attr:`pool_size`, OTT)
  and stored tiers (:attr:`tiers`, PATS: :meth:`requantize` moves a block down,
  :meth:`roundtrip_tiers` is what the simulation sees at every tier).

Packed layout (the PyTorch reference the Triton kernels follow):

- keys, ``k_axis="channel"``: codes (B, H, N, D*kb/8) uint8 planar-packed along channels;
  scale/zero (B, H, N/k_group, D) float16, one per channel per group of k_group tokens.
- keys, ``k_axis="token"``: codes as above; scale/zero (B, H, N, D/k_group) float16.
- values: codes (B, H, N, D*vb/8); scale/zero (B, H, N, D/v_group) float16.
- 16 bits: the block is kept as it came (model dtype), (B, H, N, D).

Encoding runs the fused Triton kernels (:mod:`kvcalib_kernels.quant_pack`: centering, permutation,
clip, padding and OTT range masks in one pass per side, no device sync) when the backend choice of
:mod:`kvcalib.accel` picks Triton for the block's tensor (:func:`use_triton_encode`), the kernels
cover the side's layout, and every active state gives its kernel arguments
(``MethodState.kernel_encode``, a :class:`~kvcalib.methods.base.KernelEncode` of its own fields:
a method the kernels do not know gives None); otherwise, and for
PATS requantization, the PyTorch reference, which is the specification: both give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcalib.accel import interpreting, triton_chosen
from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig
from kvcalib.methods import KernelAttend, KernelEncode, MethodState, registry
from kvcalib.quant.packing import SUPPORTED_BITS
from kvcalib.quant.transforms import apply_perm
from kvcalib.quant.uniform import QuantizedTensor, dequantize, dequantize_keys, dequantize_values, quantize_fixed, \
    quantize_keys, quantize_values, requantize


@dataclass
class PackedBlock:
    """One side (K or V) of a flushed block: a QuantizedTensor, or raw full-precision values,
    plus the per-token side data a state stored with it (TaDA's mean over heads)."""

    quantized: QuantizedTensor | None
    raw: torch.Tensor | None  # (B, H, N, D) when not quantized
    mean: torch.Tensor | None = None  # (B, 1, N, D) float16 when centred (16-bit mean)
    mean_q: QuantizedTensor | None = None  # (B, 1, N, D) as 8-bit per-token codes (8-bit mean)

    def nbytes(self) -> int:
        n = int(self.quantized.nbytes()) if self.quantized is not None else int(self.raw.numel() * self.raw.element_size())  # type: ignore[union-attr]
        if self.mean is not None:
            n += int(self.mean.numel() * self.mean.element_size())
        if self.mean_q is not None:
            n += int(self.mean_q.nbytes())
        return n

    @property
    def stored(self) -> dict[str, Any]:
        """The side data as the states' ``decode`` reads it."""
        return {"mean": self.mean, "mean_q": self.mean_q}


def _range_mask(valid: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor | None:
    """Tokens that set a group's range: ``valid`` (B, N) padding mask and/or ``keep`` (B, H, N)
    OTT quant mask -> bool broadcastable to (B, H, N), or None (every token)."""
    m = None if valid is None else valid[:, None, :]  # (B, 1, N)
    if keep is not None:
        m = keep if m is None else m & keep  # (B, H, N)
    return m


def quantize_reference(x: torch.Tensor, bits: int, group: int, per_channel: bool,
                       clip: float | torch.Tensor = 1.0, valid: torch.Tensor | None = None, *,
                       perm: torch.Tensor | None = None, mean: torch.Tensor | None = None) -> QuantizedTensor:
    """``x`` (B, H, N, D) centred on ``mean`` (float32 (B, 1, N, D), from
    :func:`~kvcalib.methods.center.center_reference`), channels permuted by ``perm`` ((H, D):
    stored channel j = input channel perm[h, j]), then quantized: keys per channel over groups of
    ``group`` tokens (``per_channel``) or per token over groups of ``group`` channels, ranges over
    ``valid`` (bool, broadcastable to (B, H, N)). The specification of
    :func:`kvcalib_kernels.quant_pack.quantize_pack_keys` / ``..._values`` (same arguments)."""
    if mean is not None:
        x = x.float() - mean  # (B, H, N, D) deviations from the stored mean
    if perm is not None:
        x = apply_perm(x, perm)
    return (quantize_keys if per_channel else quantize_values)(x, bits, group, clip=clip, valid=valid)


def use_triton_encode(x: torch.Tensor) -> bool:
    """Whether blocks of ``x`` (B, H, N, D) encode through the Triton kernels: the backend choice
    attention uses (:func:`kvcalib.accel.triton_chosen`, ``KVCALIB_BACKEND``). ``reference``:
    never; ``auto``: CUDA tensors when triton imports; ``triton``: CUDA tensors, or any under
    ``TRITON_INTERPRET=1`` (the CPU tests), else the reference. No device sync."""
    if not triton_chosen(x):
        return False
    return x.is_cuda or interpreting()


def load_states(cfg: LayerConfig, tensors: dict[str, torch.Tensor], heads: int | None = None,
                head_dim: int | None = None, prefix: str = "") -> dict[str, MethodState]:
    """The active states of one layer from its fitted tensors (unprefixed names, ``"k.clip"``...):
    each method's :meth:`~kvcalib.methods.base.Method.load` on the tensors it declares. A
    ``ValueError`` names the tensor (with ``prefix``, e.g. ``"layers.3."``, in front); a tensor no
    method declares, or one under the wrong side, is refused."""
    methods = registry()
    owner = {key: name for name, m in methods.items() for key in m.tensor_keys()}
    for key in sorted(set(tensors) - set(owner)):
        kind = key.split(".", 1)[-1]
        right = sorted(k for k in owner if k.split(".", 1)[-1] == kind)
        if right:
            raise ValueError(f"{prefix}{key}: {kind} belongs under {' / '.join(prefix + k for k in right)}")
        raise ValueError(f"{prefix}{key} is not a tensor any method of this kvcalib applies (known: "
                         f"{', '.join(sorted({k.split('.', 1)[-1] for k in owner}))})")
    states = {}
    for name, method in methods.items():
        mine = {k: t for k, t in tensors.items() if owner[k] == name}
        try:
            state = method.load(mine, cfg, heads, head_dim) if mine else None
        except ValueError as err:
            raise ValueError(f"{prefix}{err}") from None
        if state is not None:
            states[name] = state
    return states


class LayerCodec:
    """Quantize/dequantize blocks for one layer according to its LayerConfig and method states.

    Build it from fitted tensors (``LayerCodec.from_tensors(cfg, {"k.clip": ...})``, what a recipe
    does), from states (``states={name: MethodState}``), or with the methods' keyword arguments
    (``LayerCodec(cfg, k_clip=0.9, v_perm=perm, outlier_pool=3, schedule=sched)``: each method
    takes the keywords it owns, :meth:`~kvcalib.methods.base.Method.from_arguments`).
    """

    def __init__(self, cfg: LayerConfig, states: dict[str, MethodState] | None = None, **arguments: Any) -> None:
        self.cfg = cfg
        states = dict(states or {})
        for name, method in registry().items():
            state = method.from_arguments(cfg, arguments)
            if state is not None:
                states[name] = state
        if arguments:
            raise TypeError(f"LayerCodec got keyword arguments no method takes: {sorted(arguments)}")
        order = list(registry())
        self.states: dict[str, MethodState] = {n: states[n] for n in sorted(states, key=order.index)}
        self._encoders = list(self.states.values())  # registry order; decode runs them reversed
        pools = [s for s in self.states.values() if s.pool_size]
        if len(pools) > 1:
            raise KvcalibError("two methods ask for a full-precision token pool on one layer: keep one")
        # the state that asked for the pool runs its selection (the cache) and its trace (the simulation)
        self.pool: MethodState | None = pools[0] if pools else None
        self.pool_size = pools[0].pool_size if pools else 0
        if self.pool_size and not cfg.compressed:
            raise KvcalibError(f"an outlier pool ({self.pool_size}) needs a compressed layer; this layer keeps "
                               "K and V at 16 bits: set the pool to 0")
        tiered = [s.stored_tiers for s in self.states.values() if s.stored_tiers is not None]
        if len(tiered) > 1:
            raise KvcalibError("two methods set stored tiers on one layer: keep one")
        # stored tiers, youngest first: (first age, k_bits, v_bits); one entry without a schedule
        self.tiers = list(tiered[0]) if tiered and cfg.compressed else [(cfg.window, cfg.k_bits, cfg.v_bits)]
        if self.tiered and any(self._levels(side) is not None or self._fixed(side) is not None
                               or self._pair(side) is not None for side in ("k", "v")):
            raise KvcalibError("non-uniform levels, fixed grids and 8-bit scale pairs are fitted for the layer's bits; "
                               "a schedule stores older blocks at fewer bits: use one or the other on a layer")
        for side in ("k", "v"):
            if self._pair(side) is not None and self._fixed(side) is not None:
                raise KvcalibError("a fixed grid stores one scale per column and 8-bit pairs one per group: keep one "
                                   f"on the {side} side")

    @classmethod
    def from_tensors(cls, cfg: LayerConfig, tensors: dict[str, torch.Tensor], heads: int | None = None,
                     head_dim: int | None = None, prefix: str = "") -> "LayerCodec":
        """The codec of one layer from its fitted tensors (:func:`load_states`)."""
        return cls(cfg, load_states(cfg, tensors, heads, head_dim, prefix))

    def state(self, name: str) -> MethodState | None:
        """The active state of method ``name`` on this layer, or None."""
        return self.states.get(name)

    @property
    def tiered(self) -> bool:
        """Whether stored blocks move to fewer bits as they age (more than one stored tier)."""
        return len(self.tiers) > 1

    def _bits_group(self, side: str) -> tuple[int, int]:
        return self.cfg.bits(side), self.cfg.group(side)

    def _clip(self, side: str) -> float | torch.Tensor:
        clips = [c for s in self._encoders if (c := s.clip(side)) is not None]
        if len(clips) > 1:
            raise KvcalibError("two methods set a clip scale for one side: keep one")
        return clips[0] if clips else 1.0

    @property
    def needs_positions(self) -> bool:
        """Whether some state reads the blocks' RoPE positions (pass ``positions`` to encode and
        decode: :attr:`MethodState.needs_positions`)."""
        return any(s.needs_positions for s in self.states.values())

    def _side_data(self, positions: torch.Tensor | None) -> dict[str, Any]:
        if positions is None and self.needs_positions:
            raise KvcalibError("this layer's codec reads the tokens' RoPE positions (keys stored before RoPE): "
                               "this path does not give them; use a recipe without pre-RoPE keys here")
        return {} if positions is None else {"positions": positions}

    def _fixed(self, side: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        grids = [g for s in self.states.values() if (g := s.fixed_grid(side)) is not None]
        if len(grids) > 1:
            raise KvcalibError("two methods fix the quantization grid of one side: keep one")
        return grids[0] if grids else None

    def _levels(self, side: str) -> torch.Tensor | None:
        levels = [lv for s in self.states.values() if (lv := s.levels(side)) is not None]
        if len(levels) > 1:
            raise KvcalibError("two methods set quantization levels for one side: keep one")
        return levels[0] if levels else None

    def _pair(self, side: str) -> Any:
        pairs = [p for s in self.states.values() if (p := s.pair8(side)) is not None]
        if len(pairs) > 1:
            raise KvcalibError("two methods set 8-bit scale pairs for one side: keep one")
        return pairs[0] if pairs else None

    def _encode(self, side: str, x: torch.Tensor, valid: torch.Tensor | None,
                keep: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> PackedBlock:
        """x (B, H, N, D) -> PackedBlock: the states' transforms, then the clip-quantizer (ranges
        over :func:`_range_mask`'s tokens); through the Triton kernels where they cover the side
        and every state (:func:`use_triton_encode`), else the reference (same bytes).
        ``positions`` (B|1, N) int64: the tokens' RoPE positions, for states that read them."""
        bits, group = self._bits_group(side)
        if bits >= 16:
            return PackedBlock(None, x)
        per_channel = self.cfg.per_channel(side)
        m = _range_mask(valid, keep)  # (B, 1|H, N) or None
        levels, fixed, pair = self._levels(side), self._fixed(side), self._pair(side)
        # the kernels fit min/max uniform grids with float16 pairs only
        if use_triton_encode(x) and levels is None and fixed is None and pair is None:
            out = self._encode_triton(side, x, m, bits, group, per_channel, positions)
            if out is not None:
                return out
        stored = self._side_data(positions)
        for state in self._encoders:
            x = state.encode(side, x, stored)  # (B, H, N, D)
        if fixed is not None:
            q = quantize_fixed(x, bits, group, per_channel, *fixed, levels=levels)
        else:
            q = (quantize_keys if per_channel else quantize_values)(x, bits, group, clip=self._clip(side), valid=m,
                                                                    levels=levels, pair=pair)
        return PackedBlock(q, None, stored.get("mean"), stored.get("mean_q"))

    def _encode_triton(self, side: str, x: torch.Tensor, m: torch.Tensor | None, bits: int, group: int,
                       per_channel: bool, positions: torch.Tensor | None = None) -> PackedBlock | None:
        """:meth:`_encode` through :mod:`kvcalib_kernels.quant_pack` (validate=False: no device
        sync); None when the kernels do not cover this side's layout or one of its states."""
        from kvcalib_kernels import quant_pack

        if quant_pack.supports(shape=tuple(x.shape), dtype=x.dtype, bits=bits, group=group,
                               per_channel=per_channel) is not None:
            return None
        stored = self._side_data(positions)
        parts: dict[str, KernelEncode] = {}
        for name, state in self.states.items():  # registry order
            got = state.kernel_encode(side, x, stored)
            if got is None:
                return None
            if got.x is not None:  # a transform run at flush (a rotation): later states and the kernel see its block
                x = got.x  # (B, H, N, D)
            parts[name] = got
        args = KernelEncode.merge(parts)  # each field one method's
        perm = args.perm
        if quant_pack.supports(shape=tuple(x.shape), dtype=x.dtype, bits=bits, group=group, per_channel=per_channel,
                               center=args.center or 0,
                               perm_heads=None if perm is None else perm.shape[0]) is not None:
            return None
        quantize = quant_pack.quantize_pack_keys if per_channel else quant_pack.quantize_pack_values
        q = quantize(x, bits, group, valid=m, validate=False, **args.kernel_args())
        return PackedBlock(q, None, stored.get("mean"), stored.get("mean_q"))

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        """Every state's decode-attention kernel arguments for ``side`` merged into one
        :class:`~kvcalib.methods.base.KernelAttend` (a field two methods set raises), or None when
        some state's transform is unknown to the kernel (the reference then runs). Its
        ``kernel_args(side)`` are the kernel's keyword arguments (``k_perm``...)."""
        parts: dict[str, KernelAttend] = {}
        for name, state in self.states.items():  # registry order
            got = state.kernel_attend(side, device)
            if got is None:
                return None
            parts[name] = got
        return KernelAttend.merge(parts)

    def _decode(self, side: str, block: PackedBlock, dtype: torch.dtype,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if block.raw is not None:
            return block.raw.to(dtype)
        out = (dequantize_keys if self.cfg.per_channel(side) else dequantize_values)(
            block.quantized, self._levels(side), self._pair(side))  # (B, H, N, D)
        stored = {**block.stored, **self._side_data(positions)}
        for state in reversed(self._encoders):
            out = state.decode(side, out, stored)
        return out.to(dtype)

    def requantize(self, side: str, block: PackedBlock, bits: int, valid: torch.Tensor | None = None,
                   keep: torch.Tensor | None = None) -> PackedBlock:
        """A stored block's side at fewer ``bits`` (PATS tier move), same layout, groups, side
        data and permutation: :func:`~kvcalib.quant.uniform.requantize` on the codes, with the
        same range mask as at the first quantization (``valid`` (B, N), ``keep`` (B, H, N))."""
        if block.quantized is None:
            raise KvcalibError(f"the {side} side is stored at 16 bits: a schedule cannot requantize it")
        qt, m = block.quantized, _range_mask(valid, keep)
        q = self._requantize_triton(qt, bits, m) if use_triton_encode(qt.codes) else None
        if q is None:
            q = requantize(qt, bits, valid=m)
        return PackedBlock(q, None, block.mean, block.mean_q)

    @staticmethod
    def _requantize_triton(qt, bits: int, m: torch.Tensor | None):
        """:func:`~kvcalib.quant.uniform.requantize` with the quantize-and-pack kernel for the
        second step (the same bytes: the kernels are bit-exact with the reference quantizers):
        dequantize in torch, then quantize the stored-order values at ``bits``, no clip. None when
        the kernels do not cover the layout. A tier move at a flush was ~2 ms per layer and side in
        torch on an H200 (most of a PATS flush at 32k)."""
        from kvcalib_kernels import quant_pack

        if isinstance(bits, bool) or bits not in SUPPORTED_BITS or bits >= qt.bits:
            return None  # the reference names the problem
        per_channel = qt.axis == "token"  # keys per channel over token groups
        x = dequantize(qt)  # (B, H, T, D) float32, stored channel order
        if quant_pack.supports(shape=tuple(x.shape), dtype=x.dtype, bits=bits, group=qt.group,
                               per_channel=per_channel) is not None:
            return None
        quantize = quant_pack.quantize_pack_keys if per_channel else quant_pack.quantize_pack_values
        return quantize(x, bits, qt.group, 1.0, m, validate=False)

    # -- keys
    def encode_keys(self, k: torch.Tensor, valid: torch.Tensor | None = None,
                    keep: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> PackedBlock:
        """k (B, H, N, D) -> packed block; ``valid`` (B, N) bool excludes padding from ranges,
        ``keep`` (B, H, N) bool excludes OTT pool entrants (False) per kv head; ``positions``
        (B|1, N) int64 the tokens' RoPE positions (needed when :attr:`needs_positions`)."""
        return self._encode("k", k, valid, keep, positions)

    def decode_keys(self, block: PackedBlock, dtype: torch.dtype = torch.float32,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
        """Packed block -> (B, H, N, D) in ``dtype`` (original channel order, mean added back);
        ``positions`` as at :meth:`encode_keys`."""
        return self._decode("k", block, dtype, positions)

    # -- values
    def encode_values(self, v: torch.Tensor, valid: torch.Tensor | None = None,
                      keep: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> PackedBlock:
        """v (B, H, N, D) -> packed block (per token over channel groups); masks as encode_keys."""
        return self._encode("v", v, valid, keep, positions)

    def decode_values(self, block: PackedBlock, dtype: torch.dtype = torch.float32,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        return self._decode("v", block, dtype, positions)

    # -- fake quantization (simulation): the values decoding would see, (B, H, N, D) float32
    def roundtrip_keys(self, k: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode_keys(self.encode_keys(k, positions=positions), _out_dtype(k), positions)

    def roundtrip_values(self, v: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode_values(self.encode_values(v, positions=positions), _out_dtype(v), positions)

    def roundtrip_tiers(self, side: str, x: torch.Tensor, keep: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """What decoding sees of ``x`` (B, H, N, D) (whole flush blocks) at each stored tier:
        one tensor (B, H, N, D) per entry of :attr:`tiers`, reached as the cache reaches it --
        encoded at the first tier's bits, then requantized at every tier whose bits for this side
        are lower (PATS's chain, ``Schedule.bits_chain``). ``keep`` (B, H, N): OTT quant mask."""
        dtype = _out_dtype(x)
        blk = self._encode(side, x, None, keep, positions)
        bits = self._bits_group(side)[0]
        out = [self._decode(side, blk, dtype, positions)]
        for _, kb, vb in self.tiers[1:]:
            new = kb if side == "k" else vb
            if new < bits:
                blk, bits = self.requantize(side, blk, new, None, keep), new
                out.append(self._decode(side, blk, dtype, positions))
            else:
                out.append(out[-1])
        return out


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (exactness tests); everything else decodes to float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
