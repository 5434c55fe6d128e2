"""The method contract: one base class that every compression method implements in one file.

A method (SKVQ's reordering, OTT's outlier pool, PATS's tiers...) is a :class:`Method` subclass in
its own module of :mod:`kvcalib.methods`, and that file declares its whole contract:

- what it **fits** from collected statistics (:meth:`Method._fit`: one layer's
  :class:`~kvcalib.stats.LayerStats` and :class:`~kvcalib.layout.LayerConfig` -> recipe tensors,
  named without the ``layers.{i}.`` prefix, e.g. ``"v.perm"``, ``"kv.outlier_pool"``); fitting
  is pure: no I/O, no global state, the seed is the only source of randomness;
- the **recipe tensors** it writes (:attr:`Method.tensors`: name, sides, dtype, shape, whether
  the runtime applies it or it only informs the search);
- its **state** at run time (:meth:`Method.load`: the layer's tensors validated into a
  :class:`MethodState`, or None when the method is off for the layer), and through the state's
  hooks: its **transform at encode / decode / attend** (reference path and kernel seams), the
  cache structure it asks for (a full-precision token pool, stored tiers), and the **bytes** it
  costs in the memory accounting;
- its **search switch** (:attr:`Method.search`) and its **CLI flags** (:attr:`Method.flags`,
  turned into a configured instance by :meth:`Method.from_flags`).

Everything else -- recipe loading, the codec, the cache, memory accounting, the search space,
export, the report and the CLI -- iterates :func:`kvcalib.methods.registry` and never names a
method. Modules of this layer import only :mod:`kvcalib.quant`, :mod:`kvcalib.layout`,
:mod:`kvcalib.stats` and :mod:`kvcalib.errors` (and the kernels, lazily, in kernel seams).

:meth:`Method.fit` validates the statistics (geometry, finiteness, reservoir) before
:meth:`Method._fit` runs and the produced tensors (declared names, finiteness) after, so every
method refuses the same bad input the same way.
"""

from __future__ import annotations

import abc
import ast
import functools
import math
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, ClassVar

import torch

from kvcalib.errors import CalibrationError, KvcalibError
from kvcalib.layout import LayerConfig
# the reservoir helpers live one layer below, where the shared scoring uses them; the methods take
# them from here with the rest of their contract
from kvcalib.reservoir import SIDES, check_side, fake_quantize, reservoir_to_bhtd, usable_tokens, validate_reservoir
from kvcalib.stats import LayerStats

__all__ = [
    "CalibrationError",
    "LayerGeometry",
    "Method",
    "MethodState",
    "TensorSpec",
    "Flag",
    "FitContext",
    "validate_layer_stats",
    "validate_reservoir",
    "reservoir_to_bhtd",
    "reservoir_moments",
    "reservoir_positions",
    "switch_section",
    "switch_lines",
    "fake_quantize",
    "usable_tokens",
    "check_side",
    "check_quantized_side",
    "scalar_value",
    "shape_symbols",
    "SIDES",
]

STAT_KEYS = ("min", "max", "mean", "absmax", "sq_mean")


@dataclass(frozen=True)
class LayerGeometry:
    """Shapes read off one layer's statistics."""

    heads: int  # H, kv heads
    head_dim: int  # D
    q_heads: int  # Hq = H * rep (0 when the reservoir holds no queries)
    blocks: int  # NB, reservoir blocks (0 = empty reservoir)
    block_len: int  # BL, consecutive tokens per block

    @property
    def rep(self) -> int:
        """Query heads per kv head (GQA ratio)."""
        return self.q_heads // self.heads if self.q_heads else 0


def check_quantized_side(cfg: LayerConfig, key: str) -> None:
    """For :meth:`Method.load`: refuse tensor ``key`` (``"k.clip"``...) on a side the layer keeps
    at 16 bits, where nothing is quantized and nothing would apply it (a ``ValueError`` naming it)."""
    side = key.split(".", 1)[0]
    if cfg.bits(side) >= 16:
        raise ValueError(f"{key}: the layer keeps {side.upper()} at 16 bits (nothing is quantized), so nothing "
                         "applies this tensor; remove it or quantize the side")


def scalar_value(t: torch.Tensor, key: str, what: str) -> float:
    """For :meth:`Method.load`: the value of a one-element tensor ``key`` holding ``what``, else a
    ``ValueError`` naming it."""
    if t.numel() != 1 or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{key} must be a scalar ({what}), got {t.dtype} of shape {tuple(t.shape)}")
    return float(t.reshape(-1)[0])


def validate_layer_stats(
    stats: LayerStats,
    heads: int | None = None,
    head_dim: int | None = None,
    *,
    need_reservoir: bool = False,
) -> LayerGeometry:
    """Check one layer's statistics are self-consistent, finite and of the expected geometry.

    Args:
        stats: the layer's statistics.
        heads, head_dim: the model's kv heads and head_dim when known (``ModelInfo``); a mismatch
            means statistics of another model and is refused.
        need_reservoir: refuse an empty reservoir (steps that fit on token blocks).

    Raises :class:`CalibrationError` naming the offending field.
    """
    if not isinstance(stats, LayerStats):
        raise CalibrationError(f"expected LayerStats, got {type(stats).__name__}")
    shape: tuple[int, ...] | None = None
    for side in SIDES:
        group = getattr(stats, side)
        for key in STAT_KEYS:
            t = group.get(key)
            if t is None:
                raise CalibrationError(f"statistics field {side}.{key} is missing: collect again")
            if t.dim() != 2:
                raise CalibrationError(f"statistics field {side}.{key} must be (H, D), got {tuple(t.shape)}")
            if shape is None:
                shape = tuple(t.shape)
            elif tuple(t.shape) != shape:
                raise CalibrationError(
                    f"statistics field {side}.{key} has shape {tuple(t.shape)}, the other fields {shape}: "
                    "the statistics file mixes models"
                )
            if not bool(torch.isfinite(t).all()):
                raise CalibrationError(f"statistics field {side}.{key} holds NaN or inf: collect again in fp32")
    h, d = shape  # type: ignore[misc]
    if heads is not None and h != heads:
        raise CalibrationError(f"statistics have {h} kv heads, the model has {heads}: statistics from another model")
    if head_dim is not None and d != head_dim:
        raise CalibrationError(f"statistics have head_dim {d}, the model has {head_dim}: statistics from another model")
    rk, rv, rq = stats.reservoir_k, stats.reservoir_v, stats.reservoir_q
    for name, r in (("reservoir_k", rk), ("reservoir_v", rv), ("reservoir_q", rq)):
        if r.dim() != 4:
            raise CalibrationError(f"{name} must be 4-D (NB, BL, heads, D), got {tuple(r.shape)}")
    nb, bl = int(rk.shape[0]), int(rk.shape[1])
    if tuple(rk.shape[2:]) != (h, d) or tuple(rv.shape) != tuple(rk.shape):
        raise CalibrationError(
            f"reservoir shapes k {tuple(rk.shape)} / v {tuple(rv.shape)} do not match the (H, D) = {(h, d)} "
            "of the statistics: statistics from another model"
        )
    hq = int(rq.shape[2])
    if rq.shape[0] != nb or rq.shape[1] != bl or rq.shape[3] != d or (hq and hq % h):
        raise CalibrationError(
            f"reservoir_q {tuple(rq.shape)} does not fit reservoir_k {tuple(rk.shape)}: expected "
            f"({nb}, {bl}, Hq, {d}) with Hq a multiple of {h}"
        )
    if need_reservoir:
        validate_reservoir(rk, "reservoir_k")
        validate_reservoir(rv, "reservoir_v")
    if not (isinstance(stats.scaling, int | float) and stats.scaling > 0 and stats.scaling < float("inf")):
        raise CalibrationError(f"statistics scaling must be a positive finite float, got {stats.scaling!r}")
    return LayerGeometry(heads=h, head_dim=d, q_heads=hq, blocks=nb, block_len=bl)


def reservoir_moments(reservoir: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-channel moments ``(H, D)`` (min/max/mean/absmax/sq_mean, float32) of a reservoir
    ``(NB, BL, H, D)``, with the streamed token ``count``: the statistics of a side a method moved
    to another basis (:meth:`Method.transform_stats`), where the streamed moments no longer apply."""
    x = reservoir.double().reshape(-1, reservoir.shape[2], reservoir.shape[3])  # (N, H, D)
    mn, mx = x.amin(0), x.amax(0)
    return {"count": count, "min": mn.float(), "max": mx.float(), "mean": x.mean(0).float(),
            "absmax": torch.maximum(mn.abs(), mx.abs()).float(), "sq_mean": (x ** 2).mean(0).float()}


def reservoir_positions(layer_stats: LayerStats) -> torch.Tensor:
    """RoPE positions of every reservoir token, int64 ``(NB, BL)`` (blocks are consecutive tokens
    from the recorded position of their first); refuses statistics without them."""
    nb, bl = layer_stats.reservoir_k.shape[:2]
    if layer_stats.positions is None:
        raise CalibrationError("the statistics do not record the reservoir's positions (an older kvcalib): "
                               "collect them again (kvcalib collect)")
    if tuple(layer_stats.positions.shape) != (nb,):
        raise CalibrationError(f"reservoir positions of shape {tuple(layer_stats.positions.shape)} do not fit "
                               f"{nb} reservoir blocks: collect again")
    return layer_stats.positions.long()[:, None] + torch.arange(bl)[None, :]  # (NB, BL)


# a TensorSpec shape's arithmetic: what the evaluator of :func:`_shape_alternatives` accepts
_SHAPE_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Pow: lambda a, b: a ** b}


def shape_symbols(side: str, cfg: LayerConfig, heads: int, head_dim: int) -> dict[str, int]:
    """The values the names of a :class:`TensorSpec` shape take for ``side`` of a layer at ``cfg``:
    ``H`` kv heads, ``D`` head_dim, ``bits`` the side's width, ``C`` its quantizer's parameter
    columns (``D`` per channel, ``D / group`` per token), ``R`` the rotary channels (at most ``D``:
    counted as ``D``, an upper bound)."""
    per_channel = cfg.per_channel(side)
    return {"H": heads, "D": head_dim, "bits": cfg.bits(side), "R": head_dim,
            "C": head_dim if per_channel else head_dim // cfg.group(side)}


@functools.lru_cache(maxsize=None)
def _shape_alternatives(shape: str) -> tuple[ast.expr, ...]:
    """A shape string (``"(H, D)"``, ``"(2**bits,)"``, ``"(H, D, D) | (D, D)"``) parsed into its
    alternatives (``|``: the fit writes one of them). Python's own parser reads it; only tuples,
    integers, names and ``+ - * / // **`` are then evaluated (:func:`_elements`), nothing runs."""
    try:
        tree = ast.parse(shape.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"tensor shape {shape!r} is not a shape expression") from None
    out: list[ast.expr] = []

    def split(node: ast.expr) -> None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            split(node.left)
            split(node.right)
        elif isinstance(node, ast.Tuple):
            out.append(node)
        else:
            raise ValueError(f"tensor shape {shape!r}: each alternative must be a tuple such as (H, D)")

    split(tree)
    return tuple(out)


def _elements(shape: str, symbols: dict[str, int]) -> int:
    """The most elements a tensor of ``shape`` holds (the largest alternative) given ``symbols``
    (:func:`shape_symbols`); a name or operation the evaluator does not know is a ``ValueError``
    (the method then overrides :meth:`Method.planned_side_bytes`)."""

    def value(node: ast.expr) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.Name):
            if node.id not in symbols:
                raise ValueError(f"tensor shape {shape!r}: unknown name {node.id!r} (known: {', '.join(symbols)})")
            return Fraction(symbols[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _SHAPE_OPS:
            return _SHAPE_OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"tensor shape {shape!r}: {ast.unparse(node)!r} is not integer arithmetic on its names")

    # a fractional dimension is rounded up: the count stays an upper bound
    return max(math.prod(math.ceil(value(dim)) for dim in alt.elts) for alt in _shape_alternatives(shape))


@dataclass(frozen=True)
class TensorSpec:
    """One recipe tensor a method writes, per layer: ``layers.{i}.{side}.{name}``.

    ``sides``: ``("k", "v")`` for tensors fitted per side, ``("kv",)`` for whole-layer tensors.
    ``applied``: the runtime reads it (else it only informs the search, the report or
    ``inspect``). ``dtype`` and ``shape`` document it; :meth:`Method.load` checks them.
    """

    name: str
    sides: tuple[str, ...]
    dtype: str
    shape: str
    doc: str
    applied: bool = True

    def keys(self) -> list[str]:
        """Unprefixed tensor names (``"k.clip"``, ``"v.clip"``)."""
        return [f"{side}.{self.name}" for side in self.sides]

    def max_bytes(self, symbols: dict[str, int]) -> int:
        """The most bytes one such tensor takes: its :attr:`dtype`'s size times the elements of
        the largest alternative of :attr:`shape` given ``symbols`` (:func:`shape_symbols`)."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {self.name}: dtype {self.dtype!r} is not a torch dtype")
        return _elements(self.shape, symbols) * dtype.itemsize


@dataclass(frozen=True)
class Flag:
    """One ``kvcalib export`` option a method adds (``--{name}``; underscores become dashes).

    ``kind`` is the option's type (``bool`` switches default to off; ``int``/``str`` default to
    None = not given). :meth:`Method.from_flags` turns the parsed values into a configured method.
    ``tag``: how a given value appears in an exported recipe's default name (a format string of the
    value, e.g. ``"ott{}"``); None: a switch shows its name, a valued flag nothing.
    """

    name: str
    kind: type
    help: str
    tag: str | None = None

    def name_tag(self, value: Any) -> str | None:
        """This flag's part of a recipe name for ``value`` (None: no part)."""
        if value is None or value is False:
            return None
        if self.tag is not None:
            return self.tag.format(value)
        return self.name if self.kind is bool else None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass
class FitContext:
    """What the fitting pipeline hands every method besides the statistics.

    ``fitted``: tensors fitted for this layer by earlier methods (unprefixed names); e.g. clipping
    is fitted on the permuted and centred data when a permutation or centering came first.
    ``codec``: a callable ``(tensors) -> LayerCodec`` building the layer's codec from fitted
    tensors (for methods that need the exact stored codes, e.g. Huffman), supplied by the
    pipeline so this layer never imports the codec.
    """

    fitted: dict[str, torch.Tensor]
    codec: Any = None


def _merge_kernel_values(cls, parts: dict[str, Any], what: str, chained: tuple[str, ...] = ()):
    """One ``cls`` value from the states' (``{method name: value}``, registry order): each field
    set by at most one method (two: a KvcalibError naming both), except the ``chained`` fields,
    which a later method's value replaces (a transform run on the earlier one's result)."""
    if len(parts) <= 1:
        return next(iter(parts.values()), None) or cls()
    names = [f.name for f in fields(cls)]
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for method, value in parts.items():
        for name in names:
            got = getattr(value, name)
            if got is None:
                continue
            if name in owner and name not in chained:
                raise KvcalibError(f"methods {owner[name]!r} and {method!r} both set the {what} kernels' "
                                   f"{name!r} for one side: a layer's states must not overlap")
            merged[name], owner[name] = got, method
    return cls(**merged)


@dataclass(frozen=True)
class KernelEncode:
    """What one method state hands the quantize-and-pack kernels (:mod:`kvcalib_kernels.quant_pack`)
    for one side's block (:meth:`MethodState.kernel_encode`). Every field is one method's (None:
    not set); the codec merges a layer's states (:meth:`merge`) and :meth:`kernel_args` is the one
    place they become the quantize kernels' keyword arguments (``LayerCodec._encode_triton``).

    - ``perm``: (H, D) int32 on the block's device, SKVQ's channel permutation (stored channel
      ``j`` of head ``h`` is input channel ``perm[h, j]``; reorder);
    - ``mean``: (B, 1, N, D) float32, TaDA's stored per-token mean (dequantized) the kernel
      subtracts before quantizing (center);
    - ``center``: int, the bits that mean is stored at, 8 or 16 (center; the kernels' ``supports``);
    - ``clip``: float in (0, 1], or float32 tensor broadcast over the block's groups ((1, H, 1, 1)
      per kv head) on the block's device: the range's clip scale (clip);
    - ``x``: (B, H, N, D), the block after a transform the kernels do not fuse, run at flush (a
      rotation, pre-RoPE keys): the later states and the kernels see it. Not a kernel argument:
      a later state's ``x`` (computed from this one) replaces it.
    """

    perm: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    center: int | None = None
    clip: float | torch.Tensor | None = None
    x: torch.Tensor | None = None

    @classmethod
    def merge(cls, parts: dict[str, "KernelEncode"]) -> "KernelEncode":
        """The states' values (``{method name: value}``) as one; a field two methods set raises."""
        return _merge_kernel_values(cls, parts, "quantize-and-pack", chained=("x",))

    def kernel_args(self) -> dict[str, Any]:
        """The quantize functions' keyword arguments (``quantize_pack_keys`` / ``_values``), the
        fields set only: ``clip``, ``perm``, ``mean`` (one absent: the kernel's default)."""
        args = {}
        if self.clip is not None:
            args["clip"] = self.clip
        if self.perm is not None:
            args["perm"] = self.perm
        if self.mean is not None:
            args["mean"] = self.mean
        return args


@dataclass(frozen=True)
class KernelAttend:
    """What one method state hands the decode-attention kernel
    (:func:`kvcalib_kernels.decode_attention.decode_attention`) for one side, K or V
    (:meth:`MethodState.kernel_attend`). Every field is one method's (None: not set); the codec
    merges a layer's states (:meth:`merge`) and :meth:`kernel_args` is the one place they become
    the kernel's keyword arguments (``{side}_perm``...), at the launch
    (``kvcalib.runtime.triton_path``: once per packed store, kept with it).

    - ``perm``: (H, D) int32 on the device, the side's SKVQ channel permutation (the kernel reads
      the query at each stored key channel's input channel, writes value channels back to their
      input positions; reorder);
    - ``rot``: ``(matrix, signs)`` on the device, the side's per-head rotation (stored tokens are
      ``x R``): ``matrix`` float32 (D, D) -- the shared Walsh-Hadamard matrix, applied as a fast
      transform -- or (H, D, D) fitted per kv head, ``signs`` float32 (H, D) random signs or None
      (:mod:`kvcalib.quant.rotation`; rotate).

    TaDA's means are not here: the kernel reads them from the packed store beside the codes.
    """

    perm: torch.Tensor | None = None
    rot: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @classmethod
    def merge(cls, parts: dict[str, "KernelAttend"]) -> "KernelAttend":
        """The states' values (``{method name: value}``) as one; a field two methods set raises."""
        return _merge_kernel_values(cls, parts, "decode-attention")

    def kernel_args(self, side: str) -> dict[str, Any]:
        """The decode kernel's keyword arguments for ``side`` ("k" or "v"), the fields set only:
        ``{side}_perm``, ``{side}_rot`` (one absent: the kernel's default, nothing to apply)."""
        args = {}
        if self.perm is not None:
            args[f"{side}_perm"] = self.perm
        if self.rot is not None:
            args[f"{side}_rot"] = self.rot
        return args


NO_KERNEL_ENCODE = KernelEncode()  # a state with nothing to pass (no allocation per call)
NO_KERNEL_ATTEND = KernelAttend()


class MethodState:
    """A method's fitted state for one layer, and the hooks that apply it.

    The codec calls the hooks of every active state in registry order on encode and in reverse
    order on decode; the cache asks for the structure they need; the memory accounting adds
    their bytes. Every hook defaults to "changes nothing", so a state overrides only what its
    method does. Tensors are ``(B, H, N, D)``: batch, kv heads, tokens, head_dim.
    """

    #: full-precision token pool per kv head the cache must keep (OTT); 0 = none. A state that asks
    #: for one also runs its selection for the cache and the simulation (``extra_capacity``,
    #: ``select``, ``trace``: :class:`kvcalib.methods.outliers.PoolState`), so neither imports the method
    pool_size: int = 0
    #: stored tiers ``[(first age, k_bits, v_bits), ...]`` youngest first (PATS); None = one tier
    stored_tiers: list[tuple[int, int, int]] | None = None
    #: its encode/decode read the block's RoPE positions, ``stored["positions"]`` (B|1, N) int64
    #: (what the model's forward gives each token: padding skipped), which the codec's callers pass
    needs_positions: bool = False

    # -- reference codec (the specification every kernel path is tested against)
    def encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        """``x`` (B, H, N, D) before quantization -> the tensor the next step quantizes.
        ``stored`` collects per-block side data the block keeps (e.g. TaDA's means)."""
        return x

    def decode(self, side: str, y: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        """Dequantized ``y`` (B, H, N, D) -> the next step's input (reverse of :meth:`encode`)."""
        return y

    def clip(self, side: str) -> float | torch.Tensor | None:
        """A clip scale for the quantizer's range (SKVQ), or None."""
        return None

    def fixed_grid(self, side: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantization grid fixed by calibration, ``(scale16, zero16)`` float16 ``(H, C)`` per kv
        head and parameter column (:func:`kvcalib.quant.uniform.quantize_fixed`), used instead of
        each group's min/max; None: min/max groups."""
        return None

    def levels(self, side: str) -> torch.Tensor | None:
        """Non-uniform quantization levels ``(2**bits,)`` in code units for the side's quantizer
        and dequantizer (:mod:`kvcalib.quant.uniform`), or None (the uniform grid)."""
        return None

    def pair8(self, side: str) -> Any:
        """8-bit scale/zero tables for the side's quantizer and dequantizer
        (:class:`kvcalib.quant.pair8.Pair8`), or None (float16 pairs)."""
        return None

    # -- kernel seams: a typed value of this state's kernel arguments, or None when the kernels
    # cannot apply this state
    def _transforms(self) -> bool:
        cls = type(self)
        return cls.encode is not MethodState.encode or cls.decode is not MethodState.decode

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        """This state's part of the quantize-and-pack kernels' arguments for block ``x`` (B, H, N, D)
        (:class:`KernelEncode`: only its own fields); may fill ``stored`` as :meth:`encode` does. A
        transform the kernels do not fuse may run here and hand its result on as ``x``: the block
        the later states and the kernels then see (e.g. a rotation at flush). Default: nothing to
        pass for a state without a transform, None (run the reference) for one with a transform
        the kernels do not know."""
        return None if self._transforms() else NO_KERNEL_ENCODE

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        """This state's part of the decode-attention kernel's arguments for ``side``
        (:class:`KernelAttend`: only its own fields, tensors on ``device``). Default as
        :meth:`kernel_encode`."""
        return None if self._transforms() else NO_KERNEL_ATTEND

    # -- memory accounting
    def bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> dict[str, float]:
        """Bytes this state adds to one sequence's layer cache holding ``kept`` tokens, ``packed``
        of them in packed storage, by component name."""
        return {}

    def shared_bytes(self, head_dim: int) -> dict[str, float]:
        """Tables the runtime keeps once for the whole model, however many layers use them (e.g.
        one Walsh-Hadamard matrix per head_dim), by a name that identifies the table: the memory
        accounting counts each name once. Default: none."""
        return {}


def switch_section(recipe: Any, info: Any, layers: list[dict[str, Any]], method: str, sides: tuple[str, ...],
                   kinds: dict[str, str], gain: str | None = None) -> dict[str, Any] | None:
    """An ``inspect`` section for a method switched per layer and side, whose fit records a gain:
    adds ``{side}_{method}`` (the label in ``kinds`` of the first applied tensor ``{side}.{name}``
    present, None when off) and ``{side}_{method}_gain`` (``{side}.{gain}``) to every row of
    ``layers``; returns ``{"on": {side: layers on}, "layers": n}``, None when the recipe never fitted
    the method."""
    seen = False
    on = dict.fromkeys(sides, 0)
    for row, tensors in zip(layers, recipe.layer_tensors(info.num_layers)):
        for side in sides:
            kind = next((label for name, label in kinds.items() if f"{side}.{name}" in tensors), None)
            g = None if gain is None else tensors.get(f"{side}.{gain}")  # (a method may record no gain)
            row[f"{side}_{method}"] = kind
            row[f"{side}_{method}_gain"] = None if g is None else float(g)
            on[side] += kind is not None
            seen |= g is not None or kind is not None
    return {"on": on, "layers": info.num_layers} if seen else None


def switch_lines(report: dict[str, Any], method: str, title: str, marks: dict[str, str]) -> list[str]:
    """The line of a :func:`switch_section`: layers on per side, then per layer each side's mark
    (``marks[label]``, ``-`` off) and measured gain."""
    sec = report.get(method)
    if not sec:
        return []
    sides = tuple(sec["on"])

    def fmt(row: dict[str, Any], side: str) -> str:
        mark = marks.get(row.get(f"{side}_{method}"), "-")
        gain = row.get(f"{side}_{method}_gain")
        return mark if gain is None else f"{mark}({gain:+.2f})"

    counts = " / ".join(f"{side.upper()} {sec['on'][side]}" for side in sides)
    legend = ", ".join(f"{m} {label}" for label, m in marks.items())
    gains = any(r.get(f"{side}_{method}_gain") is not None for r in report["layers"] for side in sides)
    return [f"{title} on {counts} of {sec['layers']} layers; {'|'.join(s.upper() for s in sides)} ({legend}, - off"
            f"{'; fitted gain' if gains else ''}) per layer: " + ", ".join(
                f"{r['layer']}: {'|'.join(fmt(r, side) for side in sides)}" for r in report["layers"])]


class Method(abc.ABC):
    """One compression method: fitting, recipe tensors, state and hooks, search switch, flags.

    Class attributes:
        name: registry key; also the search switch and provenance name.
        summary: one line for help texts and reports (what it does, which paper).
        order: pipeline position (later methods fit on what earlier ones fitted).
        tensors: every recipe tensor the method may write (:class:`TensorSpec`).
        needs_reservoir: whether fitting reads reservoir token blocks (an empty reservoir is
            then refused) rather than the per-channel moments only.
        search: ``"layer"``: a per-layer on/off switch of the search space (``layer_methods``);
            ``"chosen"``: applied to the search's chosen recipe only (it changes memory, never
            quality: Huffman codebooks); ``"global"``: one choice for the whole model, the search
            space's ``schedules`` (PATS), whose names, checks and scoring length the method declares
            (``search_off``, ``search_ages``, ``check_search_choice``, ``min_scoring_length``);
            None: not searched.
        search_default: in the default search space's ``layer_methods``.
        saves_bytes: switched on, it can store a layer in fewer bytes than the layout alone counts
            (8-bit scale pairs): the search's floor then also prices the space's floor point with
            it on every layer.
        letter: its tag on the bits-per-layer plot.
        flags: the ``kvcalib export`` options it adds.

    Configuration lives in the subclass's constructor (validated there); fitted state is only
    what :meth:`fit` returns.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    order: ClassVar[int] = 100
    tensors: ClassVar[tuple[TensorSpec, ...]] = ()
    needs_reservoir: ClassVar[bool] = True
    search: ClassVar[str | None] = None
    search_default: ClassVar[bool] = False
    saves_bytes: ClassVar[bool] = False
    letter: ClassVar[str] = ""
    flags: ClassVar[tuple[Flag, ...]] = ()

    # ------------------------------------------------------------------ declared tensors
    @classmethod
    def tensor_keys(cls) -> dict[str, TensorSpec]:
        """Unprefixed tensor name -> its spec (``"k.clip"`` -> the clip spec)."""
        return {key: spec for spec in cls.tensors for key in spec.keys()}

    # ------------------------------------------------------------------ memory, before the fit
    def planned_state_bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> float:
        """What the state this method's fit would give one layer at ``cfg`` adds to its cache
        (:meth:`MethodState.bytes`, all components), without fitting: for a method whose state
        changes the stored bytes per token (8-bit scale pairs give bytes back: negative). Default 0:
        a method whose state adds per-token bytes that depend on its fit (TaDA means, OTT pools) is
        fitted by the search instead."""
        return 0.0

    def planned_side_bytes(self, side: str, cfg: LayerConfig, heads: int, head_dim: int) -> int:
        """The most bytes of recipe tensors ``{side}.*`` this method's fit may write for one layer
        at ``cfg`` (bits, groups, axis), without fitting: what the search's allocation counts for a
        side method it does not fit per move (:meth:`kvcalib.optimize.objective.SearchObjective.effective_bits`).
        An upper bound: a fit that leaves the side alone writes less. Whole-layer (``kv``) tensors
        are not counted (the search fits those). Nothing for a side kept at 16 bits.

        Default: every declared tensor of the side at its declared shape's largest alternative
        (:meth:`TensorSpec.max_bytes`). A method whose tensors exclude each other, or whose
        configuration decides their size, overrides (a rotation stores a seed or a matrix)."""
        if cfg.bits(side) >= 16:
            return 0
        symbols = shape_symbols(side, cfg, heads, head_dim)
        return sum(spec.max_bytes(symbols) for spec in self.tensors if side in spec.sides)

    # ------------------------------------------------------------------ offline: fit
    def fit(
        self,
        layer_stats: LayerStats,
        layer_cfg: LayerConfig,
        seed: int = 0,
        fitted: dict[str, torch.Tensor] | None = None,
        *,
        heads: int | None = None,
        head_dim: int | None = None,
        context: FitContext | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fit this method on one layer.

        Args:
            layer_stats: the layer's statistics.
            layer_cfg: the layer's configuration (bits, groups, axis, window, sinks).
            seed: the only source of randomness.
            fitted: tensors already fitted for this layer by earlier methods (same unprefixed
                names); ignored when ``context`` is given (it carries them).
            heads, head_dim: the model's geometry when known; statistics of another shape are
                refused.
            context: the pipeline's :class:`FitContext`.

        Returns:
            ``{name: tensor}`` with names from :attr:`tensors`; possibly empty when the method
            does not apply to this layer (e.g. nothing is quantized).
        """
        if not isinstance(layer_cfg, LayerConfig):
            raise CalibrationError(f"layer_cfg must be a LayerConfig, got {type(layer_cfg).__name__}")
        geom = validate_layer_stats(layer_stats, heads, head_dim, need_reservoir=self.needs_reservoir)
        try:
            layer_cfg.check_head_dim(geom.head_dim)
        except ValueError as err:
            raise CalibrationError(f"{self.name}: layer config does not fit head_dim {geom.head_dim}: {err}") from None
        if context is None:
            context = FitContext(dict(fitted or {}))
        out = self._fit(layer_stats, layer_cfg, int(seed), context, geom)
        unknown = sorted(set(out) - set(self.tensor_keys()))
        if unknown:  # a programming error in the subclass, not user input
            raise RuntimeError(f"{type(self).__name__} produced undeclared tensors {unknown}")
        for key, t in out.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise RuntimeError(f"{type(self).__name__} produced non-finite {key}")
        return out

    @abc.abstractmethod
    def _fit(
        self,
        layer_stats: LayerStats,
        layer_cfg: LayerConfig,
        seed: int,
        context: FitContext,
        geom: LayerGeometry,
    ) -> dict[str, torch.Tensor]:
        """The fit itself, on validated input (``context.fitted``: earlier methods' tensors)."""

    def transform_stats(self, layer_stats: LayerStats, fitted: dict[str, torch.Tensor]) -> LayerStats:
        """The statistics as the methods fitted after this one must see them, given the tensors
        this method just fitted for the layer (``fitted``, unprefixed names): a method that changes
        the basis the quantizer works in (a rotation, keys before RoPE) returns the reservoir (and
        the moments) in that basis, so e.g. clip scales are fitted on the data the runtime
        quantizes. Default: unchanged."""
        return layer_stats

    def finish(self, recipe: Any, stats: LayerStats | Any) -> Any:
        """The whole fitted recipe after every layer's fit, for methods that need it all (e.g.
        codebooks of the codes the other methods produce). Default: unchanged."""
        return recipe

    # ------------------------------------------------------------------ recipe -> state
    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> MethodState | None:
        """This method's state for one layer from its tensors (unprefixed names, only those this
        method declares), or None when it is off there. Raise ``ValueError`` naming the tensor
        and the expected value for anything invalid (the recipe turns it into a RecipeError that
        names the layer). ``heads``/``head_dim`` are None for a model-agnostic preset.
        Default: a method with no applied tensors has no run-time state."""
        return None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> MethodState | None:
        """This method's state from the codec's keyword arguments (``LayerCodec(cfg, k_clip=...)``):
        pop the keywords it owns from ``arguments``, return its state or None."""
        return None

    # ------------------------------------------------------------------ kvcalib inspect
    #: ``inspect(recipe, info, context, layers, elements_per_layer) -> dict | None``: this method's
    #: section of the inspect report (None: the recipe does not use it); may add per-layer fields
    #: to ``layers``. ``elements_per_layer[i]``: the K/V elements layer i holds at ``context`` (the
    #: denominator of its effective bits; a sliding layer holds its window only). A method without
    #: a section leaves it None here.
    inspect: ClassVar[Any] = None

    @classmethod
    def inspect_lines(cls, report: dict[str, Any]) -> list[str]:
        """Human-readable lines of this method's section of an inspect report."""
        return []

    @classmethod
    def origin(cls, note: dict[str, Any]) -> str | None:
        """One line summarising ``provenance[name]`` when the method records a dict there
        (None: shown as it is)."""
        return None

    # ------------------------------------------------------------------ CLI
    @classmethod
    def from_flags(cls, values: dict[str, Any], layer: LayerConfig) -> "Method | None":
        """A configured instance from its ``kvcalib export`` flags (``values``: flag name -> parsed
        value, None/False when not given), or None when the flags leave it off. Raise
        :class:`~kvcalib.errors.KvcalibError` for a bad value, naming the flag and the fix."""
        flag = cls.flags[0].name if cls.flags else None
        return cls() if flag is not None and values.get(flag) else None

    @classmethod
    def export_layer(cls, values: dict[str, Any], window: int | None, sinks: int | None) -> tuple[int | None, int | None]:
        """Window and sinks ``kvcalib export`` should use given this method's flags (a method whose
        structure fixes them, e.g. a PATS preset, overrides; None = the command's default)."""
        return window, sinks

    def config(self) -> dict[str, Any]:
        """The method's configuration (recorded next to its outputs for provenance)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

