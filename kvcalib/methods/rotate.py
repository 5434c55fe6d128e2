"""Rotate each kv head's K and/or V by an orthogonal matrix before quantizing (QuaRot, TurboQuant,
RotateKV; vLLM's and llama.cpp's Hadamard flags).

A token's channels often hold a few outliers; an orthogonal rotation spreads them over all
channels, so each head's channels come out near-Gaussian and of similar range, which suits a
min/max quantizer over groups of channels (values, per-token keys). Keys quantized per channel
over token groups (KIVI) already give each outlier channel its own range: there a rotation can
cost more than it saves, so the fit measures it per layer and side, and leaves the side alone
where the reservoir's error does not fall (the search may still switch it per layer).

Rotations (:mod:`kvcalib.quant.rotation`): ``R_h = diag(signs_h) M_h``, ``x' = x R_h``.

- ``kind="hadamard"`` (default): ``M = H_D / sqrt(D)`` (Walsh-Hadamard, shared by the heads) with
  random signs per head from a seed. Only the seed is stored: ``{k|v}.rotate`` int64 ``(3,)`` =
  (seed, kv heads, head_dim), the geometry so the signs can be drawn without the model.
- ``kind="pca"``: fitted per layer from the reservoir: each head's eigenbasis of its channel
  covariance (decorrelates the channels), then the random-sign Walsh-Hadamard (evens their
  variances out): ``{k|v}.rotation`` float32 ``(H, D, D)``.
- ``kind="learned"`` (issue 53 item 1; SpinQuant / OSCAR): per layer and side, the random-sign
  Walsh-Hadamard times an orthogonal matrix optimised on the reservoir, ``R = diag(s) H Q(A)`` with
  the Cayley map ``Q(A) = (I - A)^-1 (I + A)`` of a skew-symmetric ``A`` (so every step stays
  orthogonal), from ``A = 0`` (the Hadamard rotation itself), by Adam on the error the fit scores
  (the attention output error of each reservoir block, or the side's squared error without
  queries) with the rounding passed straight through (:func:`fit_learned_rotation`). One matrix
  per layer and side, shared by its kv heads (fitted on all of them at once, from head 0's signs):
  kept where its reservoir error is below the Hadamard rotation's, as ``{k|v}.rotation``
  ``(D, D)`` (decoded in the kernel through the general matrix path, read with a head stride of
  0); else the side gets the Hadamard seed. ``kind="learned-head"``: the same with one matrix per
  kv head, ``(H, D, D)``: H times the bytes. On SmolLM2 at 8k (docs/results.md) the shared one
  kept most of the per-head one's perplexity gain for a third of the bytes (0.08 bits against
  0.25), but not its copying gain.

Runtime contract:

- reference codec: encode ``x -> x R`` before every later step (centering, permutation, clip and
  quantizer then work in the rotated basis), decode ``y -> y R^T`` after them;
- quantize-and-pack kernels: the state rotates the flushed block and hands it on
  (``kernel_encode`` returns it as the ``x`` of its :class:`~kvcalib.methods.base.KernelEncode`);
- decode kernel: the stored tokens are never rotated back one by one. Keys: the packed tokens
  are scored with the query rotated once per step (``q R . k R = q . k``); values: the packed
  tokens' part of the output is accumulated in the rotated basis and rotated back once per step
  (``kernel_attend``'s ``rot``, the kernel's ``k_rot`` / ``v_rot`` of
  :func:`kvcalib_kernels.decode_attention.decode_attention`). The
  full-precision sinks, window and pools are stored unrotated and attended as they are.

Memory, each thing once (:meth:`kvcalib.recipe.Recipe.memory`): the recipe's tensors are counted
as ``recipe_state`` (the seed, 24 bytes with the geometry; a fitted ``rotation``, ``(H, D, D)``
or ``(D, D)``, whose float32 tensor is itself the matrix the runtime rotates by); ``bytes`` adds
per layer only the device tables the runtime derives from them, beyond them: the float32 signs
``(H, D)`` a seed draws; ``shared_bytes`` one Walsh-Hadamard matrix per head_dim for the whole
model, where some side rotates by a seed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig
from kvcalib.methods.base import (
    FitContext,
    Flag,
    KernelAttend,
    KernelEncode,
    LayerGeometry,
    Method,
    MethodState,
    NO_KERNEL_ATTEND,
    NO_KERNEL_ENCODE,
    TensorSpec,
    reservoir_moments,
    reservoir_to_bhtd,
    shape_symbols,
    switch_lines,
    switch_section,
)
from kvcalib.quant.rotation import check_rotation, hadamard, is_hadamard, is_power_of_two, random_signs, rotate, unrotate
from kvcalib.reservoir import causal_probs, quantization_errors, usable_tokens
from kvcalib.stats import LayerStats

__all__ = ["KINDS", "side_seed", "fit_pca_rotation", "rotate_reservoir", "rotation_errors", "RotateState",
           "RotateMethod"]

KINDS = ("hadamard", "pca", "learned", "learned-head")
_FP32 = 4  # bytes of the float32 tables the runtime keeps on the device
# the learned rotation's optimiser: Adam steps and learning rate on the Cayley generator. Not tuned:
# on the tests' outlier reservoir they take the 2-bit value error from the Hadamard rotation's 3,414
# to 240; on SmolLM2-135M's reservoirs a fit takes ~1.5 s a side on the idle 2-core CPU (15-19 s shared)
LEARN_STEPS = 80
LEARN_LR = 5e-3


def side_seed(seed: int, side: str) -> int:
    """The seed of one side's random signs: K and V of a layer get different signs."""
    return 2 * int(seed) + (side == "v")


def fit_pca_rotation(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Per head, the eigenbasis of the channel covariance of ``x`` (NB, H, T, D), then the
    random-sign Walsh-Hadamard: float32 ``(H, D, D)`` orthogonal, ``x' = x @ M_h``."""
    nb, h, t, d = x.shape
    tokens = x.double().transpose(0, 1).reshape(h, nb * t, d)  # (H, N, D)
    centred = tokens - tokens.mean(1, keepdim=True)
    cov = centred.transpose(1, 2) @ centred / max(1, nb * t)  # (H, D, D)
    _, vecs = torch.linalg.eigh(cov)  # (H, D, D), columns = eigenvectors, ascending eigenvalues
    had = hadamard(d).double()  # (D, D)
    # x U diag(s) Hn: decorrelate, then spread every principal direction over all channels
    return (vecs.flip(-1) @ (signs.double()[:, :, None] * had)).float()  # (H, D, D)


def _ste_fake_quantize(x: torch.Tensor, side: str, bits: int, group: int, k_axis: str) -> torch.Tensor:
    """:func:`kvcalib.reservoir.fake_quantize`'s min/max grid on ``x (NB, H, T, D)`` with the
    rounding passed straight through (its gradient taken as 1), so the error reaches the rotation
    through each group's range: float32 ``(NB, H, T, D)``."""
    nb, h, t, d = x.shape
    qmax = (1 << bits) - 1
    if side == "k" and k_axis == "channel":
        g = x.reshape(nb, h, t // group, group, d)  # per channel over groups of tokens
        lo, hi = g.amin(3, keepdim=True), g.amax(3, keepdim=True)
    else:
        g = x.reshape(nb, h, t, d // group, group)  # per token over groups of channels
        lo, hi = g.amin(4, keepdim=True), g.amax(4, keepdim=True)
    scale = ((hi - lo) / qmax).clamp_min(1e-8)
    code = (g - lo) / scale
    code = code + (code.round().clamp(0, qmax) - code).detach()
    return (code * scale + lo).reshape(nb, h, t, d)


def fit_learned_rotation(layer_stats: LayerStats, side: str, bits: int, group: int, k_axis: str,
                         signs: torch.Tensor, steps: int = LEARN_STEPS, lr: float = LEARN_LR,
                         shared: bool = False) -> torch.Tensor:
    """The ``kind="learned"`` rotation of one side (module docstring): float32 ``(H, D, D)``
    orthogonal, ``x' = x @ M_h``, from ``diag(signs_h) H`` optimised on the reservoir; with
    ``shared`` one ``(D, D)`` matrix for every kv head, from ``diag(signs_0) H``, fitted on all of
    them at once."""
    rk, rv, rq = layer_stats.reservoir_k, layer_stats.reservoir_v, layer_stats.reservoir_q
    _, bl, h, d = rk.shape
    t = usable_tokens(bl, side, group, k_axis)
    k = reservoir_to_bhtd(rk)[:, :, :t].float()  # (NB, H, T, D)
    v = reservoir_to_bhtd(rv)[:, :, :t].float()  # (NB, H, T, D)
    x = k if side == "k" else v
    with_queries = rq.shape[2] > 0
    if with_queries:
        q = reservoir_to_bhtd(rq)[:, :, :t].float()  # (NB, Hq, T, D)
        rep = q.shape[1] // h
        v_rep = v.repeat_interleave(rep, dim=1)  # (NB, Hq, T, D)
        probs = causal_probs(q, k.repeat_interleave(rep, dim=1), layer_stats.scaling)  # (NB, Hq, T, T)
        o_ref = probs @ v_rep  # (NB, Hq, T, D)
    start = signs.float()[:, :, None] * hadamard(d)  # (H, D, D): diag(s_h) H
    if shared:
        start = start[:1]  # (1, D, D): broadcast over the heads
    gen = torch.zeros(start.shape[0], d, d, requires_grad=True)  # the Cayley generator's free part
    opt = torch.optim.Adam([gen], lr=lr)
    eye = torch.eye(d)

    def rotation() -> torch.Tensor:
        skew = gen - gen.transpose(1, 2)  # (H, D, D)
        return start @ torch.linalg.solve(eye - skew, eye + skew)  # (H, D, D) orthogonal

    with torch.enable_grad():
        for _ in range(steps):
            m = rotation()
            xr = x @ m  # (NB, H, T, D) in the rotated basis
            err = _ste_fake_quantize(xr, side, bits, group, k_axis) - xr  # (NB, H, T, D)
            if not with_queries:
                loss = err.pow(2).sum()
            elif side == "k":  # scores q . k = (q M)(k M)^T: the output error of the quantized keys
                qr = q @ (m if shared else m.repeat_interleave(rep, dim=0))  # (NB, Hq, T, D)
                kh = (xr + err).repeat_interleave(rep, dim=1)  # (NB, Hq, T, D)
                loss = (causal_probs(qr, kh, layer_stats.scaling) @ v_rep - o_ref).pow(2).sum()
            else:  # the output error P (V_hat - V), in the rotated basis (the same norm)
                loss = (probs @ err.repeat_interleave(rep, dim=1)).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        m = rotation().double()
        # re-orthogonalise in float64: the float32 solve leaves ~1e-6 that RotateMethod.load checks
        u, _, vh = torch.linalg.svd(m)
        fitted = (u @ vh).float()  # (H, D, D) | (1, D, D)
        return fitted[0] if shared else fitted


def rotate_reservoir(reservoir: torch.Tensor, matrix: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """A reservoir ``(NB, BL, Hx, D)`` rotated per head, float32 ``(NB, BL, Hx, D)`` (``Hx`` kv heads
    or a multiple: query heads rotate with their kv head's rotation)."""
    return rotate(reservoir.float().transpose(1, 2), matrix, signs).transpose(1, 2).contiguous()


def rotation_errors(layer_stats: LayerStats, side: str, bits: int, group: int, k_axis: str,
                    matrix: torch.Tensor, signs: torch.Tensor | None) -> tuple[float, float]:
    """Quantization error of ``side`` on the reservoir without and with the rotation:
    ``(plain, rotated)``, summed over the kv heads. Scored as clipping scores its alphas (the
    attention output error of each block's own causal attention when queries were collected,
    else the side's squared error): the rotation is orthogonal, so the output error in the
    rotated basis equals the one the model sees."""
    rk, rv, rq = layer_stats.reservoir_k, layer_stats.reservoir_v, layer_stats.reservoir_q
    objective = "output" if rq.shape[2] else "mse"
    plain = quantization_errors(rk, rv, rq, layer_stats.scaling, bits, group, side, (1.0,), k_axis=k_axis,
                        objective=objective)
    if side == "k":  # keys and queries rotate together: the scores stay q . k
        rk, rq = rotate_reservoir(rk, matrix, signs), (rotate_reservoir(rq, matrix, signs) if rq.shape[2] else rq)
    else:
        rv = rotate_reservoir(rv, matrix, signs)
    rotated = quantization_errors(rk, rv, rq, layer_stats.scaling, bits, group, side, (1.0,), k_axis=k_axis,
                          objective=objective)
    return float(plain.sum()), float(rotated.sum())


class RotateState(MethodState):
    """The rotation of each rotated side of one layer: ``side -> (matrix (D, D) | (H, D, D), signs
    (H, D) | None)`` float32 (the module docstring's contract). ``stored``: the sides whose
    matrix is a recipe tensor itself (``{side}.rotation``), counted as the recipe's state and not
    again as a device table (:meth:`bytes`)."""

    def __init__(self, rotations: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                 stored: frozenset[str] = frozenset()) -> None:
        self.rot = dict(rotations)
        self.stored = frozenset(stored)
        self._device: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def device_rotation(self, side: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The side's rotation on ``device``, copied once per device."""
        key = (side, device)
        if key not in self._device:
            m, s = self.rot[side]
            # the Walsh-Hadamard matrix as the shared per-device tensor (the kernel then rotates
            # the query with a fast transform instead of a product: kvcalib.quant.rotation.is_hadamard)
            m_dev = hadamard(m.shape[-1], device) if is_hadamard(m) else m.to(device).contiguous()
            self._device[key] = (m_dev, None if s is None else s.to(device).contiguous())
        return self._device[key]

    def encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        return rotate(x, *self.device_rotation(side, x.device)) if side in self.rot else x  # (B, H, N, D)

    def decode(self, side: str, y: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        return unrotate(y, *self.device_rotation(side, y.device)) if side in self.rot else y  # (B, H, N, D)

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        if side not in self.rot:
            return NO_KERNEL_ENCODE
        return KernelEncode(x=rotate(x, *self.device_rotation(side, x.device)))  # (B, H, N, D) float32, rotated at flush

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        return KernelAttend(rot=self.device_rotation(side, device)) if side in self.rot else NO_KERNEL_ATTEND

    def bytes(self, cfg: LayerConfig, heads: int, head_dim: int, kept: int, packed: int) -> dict[str, float]:
        # the device tables of this layer beyond the recipe's tensors (which Recipe.memory counts as
        # recipe_state): the signs a seed draws; a stored float32 matrix is the table itself (the
        # device holds one copy), so it is not counted again here
        if not packed:
            return {}
        total = 0.0
        for side, (m, s) in self.rot.items():
            if cfg.bits(side) >= 16:
                continue
            derived = m.dim() == 3 and side not in self.stored
            total += (m.numel() * _FP32 if derived else 0) + (0 if s is None else s.numel() * _FP32)
        return {"rotate_tables": total} if total else {}

    def shared_bytes(self, head_dim: int) -> dict[str, float]:
        # the Walsh-Hadamard matrix, one per head_dim (a stored (D, D) matrix is the recipe's own)
        shared = any(m.dim() == 2 and side not in self.stored for side, (m, _) in self.rot.items())
        return {f"rotate_hadamard_d{head_dim}": float(head_dim * head_dim * _FP32)} if shared else {}


class RotateMethod(Method):
    """Per-head orthogonal rotation of K and/or V before quantizing, where it lowers the error.

    For each quantized side: ``{side}.rotate_gain`` = ``1 - rotated / plain`` error on the
    reservoir (:func:`rotation_errors`); the side is rotated (``{side}.rotate``: the seed, or
    ``{side}.rotation``: the fitted matrices) where the gain exceeds ``min_gain``. Walsh-Hadamard
    needs a power-of-two head_dim; other shapes leave the side unrotated (gain 0).
    """

    name: ClassVar[str] = "rotate"
    summary: ClassVar[str] = "per-head random-sign Walsh-Hadamard (or fitted) rotation before quantizing"
    order: ClassVar[int] = 5
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("rotate", ("k", "v"), "int64", "(3,)",
                   "random-sign Walsh-Hadamard rotation: (seed, kv heads, head_dim)"),
        TensorSpec("rotation", ("k", "v"), "float32", "(H, D, D) | (D, D)",
                   "fitted orthogonal rotation per kv head, or one every kv head shares"),
        TensorSpec("rotate_gain", ("k", "v"), "float32", "()",
                   "relative reservoir error reduction from rotating", applied=False),
    )
    search: ClassVar[str | None] = "layer"
    # in the default space: searched with clip it halved the held-out loss at the same bits, at
    # 256-token windows (+4.89% -> +2.90%, make demo's search) and at 8k/16k (docs/results.md)
    search_default: ClassVar[bool] = True
    letter: ClassVar[str] = "R"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag("rotate", str, "Rotate K/V per head before quantizing where it lowers the error: hadamard (random "
             "signs, only a seed stored), pca (a fitted matrix per head), learned (the Hadamard rotation "
             "optimised on the reservoir's attention error: one matrix per layer and side where it beats "
             "Hadamard) or learned-head (the same, one matrix per kv head).",
             tag="rot-{}"),
    )

    def __init__(self, kind: str = "hadamard", min_gain: float = 0.0) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not -1.0 < float(min_gain) < 1.0:
            raise ValueError(f"min_gain must lie in (-1, 1), got {min_gain!r}")
        self.kind = kind
        self.min_gain = float(min_gain)

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for side in ("k", "v"):
            bits = layer_cfg.bits(side)
            if bits >= 16:
                continue
            if not is_power_of_two(geom.head_dim):
                out[f"{side}.rotate_gain"] = torch.tensor(0.0)
                continue
            s = side_seed(seed, side)
            signs = random_signs(geom.heads, geom.head_dim, s)  # (H, D)
            group, k_axis = layer_cfg.group(side), layer_cfg.k_axis
            if self.kind == "pca":
                res = reservoir_to_bhtd(getattr(layer_stats, f"reservoir_{side}"))  # (NB, H, BL, D)
                matrix, rot_signs = fit_pca_rotation(res, signs), None  # (H, D, D)
            else:
                matrix, rot_signs = hadamard(geom.head_dim), signs
            plain, rotated = rotation_errors(layer_stats, side, bits, group, k_axis, matrix, rot_signs)
            fitted_matrix = self.kind == "pca"
            if self.kind.startswith("learned"):  # kept only where it beats the Hadamard rotation it starts from
                learned = fit_learned_rotation(layer_stats, side, bits, group, k_axis, signs,
                                               shared=self.kind == "learned")  # (D, D) | (H, D, D)
                _, learned_err = rotation_errors(layer_stats, side, bits, group, k_axis, learned, None)
                if learned_err < rotated:
                    matrix, rotated, fitted_matrix = learned, learned_err, True
            gain = 0.0 if plain <= 0 else 1.0 - rotated / plain
            out[f"{side}.rotate_gain"] = torch.tensor(gain, dtype=torch.float32)
            if gain > self.min_gain:
                if fitted_matrix:
                    out[f"{side}.rotation"] = matrix
                else:
                    out[f"{side}.rotate"] = torch.tensor([s, geom.heads, geom.head_dim], dtype=torch.int64)
        return out

    def transform_stats(self, layer_stats: LayerStats, fitted: dict[str, torch.Tensor]) -> LayerStats:
        heads, head_dim = layer_stats.k["min"].shape
        state = self.load(fitted, LayerConfig(), int(heads), int(head_dim))
        if state is None:
            return layer_stats
        res = {"k": layer_stats.reservoir_k, "v": layer_stats.reservoir_v}
        rq = layer_stats.reservoir_q
        moments = {"k": layer_stats.k, "v": layer_stats.v}
        for side, (m, s) in state.rot.items():
            res[side] = rotate_reservoir(res[side], m, s)  # (NB, BL, H, D)
            moments[side] = reservoir_moments(res[side], moments[side]["count"])
            if side == "k" and rq.shape[2]:
                rq = rotate_reservoir(rq, m, s)  # scores q . k unchanged
        return replace(layer_stats, k=moments["k"], v=moments["v"], reservoir_k=res["k"], reservoir_v=res["v"],
                       reservoir_q=rq)

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> RotateState | None:
        rot: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        stored: set[str] = set()
        for side in ("k", "v"):
            seed_t, matrix = tensors.get(f"{side}.rotate"), tensors.get(f"{side}.rotation")
            if seed_t is not None and matrix is not None:
                raise ValueError(f"{side}.rotate and {side}.rotation are both set: a side has one rotation")
            if seed_t is not None:
                if seed_t.shape != (3,) or seed_t.is_floating_point() or seed_t.dtype == torch.bool:
                    raise ValueError(f"{side}.rotate must be int64 (3,) = (seed, kv heads, head_dim), got "
                                     f"{seed_t.dtype} {tuple(seed_t.shape)}")
                seed, h, d = (int(v) for v in seed_t.tolist())
                if h < 1 or (heads is not None and h != heads) or (head_dim is not None and d != head_dim):
                    raise ValueError(f"{side}.rotate is for {h} kv heads of head_dim {d}, the model has "
                                     f"{heads} of {head_dim}")
                if not is_power_of_two(d):
                    raise ValueError(f"{side}.rotate: a Walsh-Hadamard rotation needs head_dim a power of two, "
                                     f"got {d}")
                rot[side] = (hadamard(d), random_signs(h, d, seed))
            elif matrix is not None:
                try:
                    check_rotation(matrix, None, heads, head_dim)
                except ValueError as err:
                    raise ValueError(f"{side}.rotation: {err}") from None
                eye = torch.eye(matrix.shape[-1], dtype=torch.float64)
                if float((matrix.double() @ matrix.double().transpose(-1, -2) - eye).abs().max()) > 1e-4:
                    raise ValueError(f"{side}.rotation is not orthogonal (M M^T != I): re-export the recipe")
                rot[side] = (matrix.float(), None)
                stored.add(side)
        return RotateState(rot, frozenset(stored)) if rot else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> RotateState | None:
        """``k_rotate=(matrix, signs)`` / ``v_rotate=...`` (:mod:`kvcalib.quant.rotation`)."""
        rot = {}
        for side in ("k", "v"):
            given = arguments.pop(f"{side}_rotate", None)
            if given is None:
                continue
            matrix, signs = given
            check_rotation(matrix, signs)
            rot[side] = (matrix.float(), None if signs is None else signs.float())
        return RotateState(rot) if rot else None

    def matrix_bytes(self, heads: int, head_dim: int) -> int:
        """The most bytes this kind stores for one rotated side: a float32 ``(D, D)`` for
        ``learned``, ``(H, D, D)`` for ``learned-head`` and ``pca``, none for ``hadamard`` (a seed)."""
        if self.kind == "hadamard":
            return 0
        return (1 if self.kind == "learned" else heads) * head_dim * head_dim * _FP32

    def planned_side_bytes(self, side: str, cfg: LayerConfig, heads: int, head_dim: int) -> int:
        """A rotated side stores its gain and one rotation: the seed (``(3,)`` int64) or this kind's
        matrix (:meth:`matrix_bytes`), never both (``load`` refuses both), so the larger of the
        two; a ``learned`` side the learned matrix does not pay for keeps the seed."""
        if cfg.bits(side) >= 16:
            return 0
        specs = {spec.name: spec for spec in self.tensors}
        symbols = shape_symbols(side, cfg, heads, head_dim)
        seed, gain = specs["rotate"].max_bytes(symbols), specs["rotate_gain"].max_bytes(symbols)
        return gain + max(seed, self.matrix_bytes(heads, head_dim))

    @classmethod
    def from_flags(cls, values: dict[str, Any], layer: LayerConfig) -> "RotateMethod | None":
        kind = values.get("rotate")
        if kind is None:
            return None
        if kind not in KINDS:
            raise KvcalibError(f"--rotate {kind!r} is not a rotation kind: use one of {', '.join(KINDS)}.")
        return cls(kind=kind)

    @classmethod
    def inspect(cls, recipe: Any, info: Any, context: int, layers: list[dict[str, Any]],
                elements_per_layer: list[int]) -> dict[str, Any] | None:
        """Which sides are rotated, by which kind, and the reservoir gain the fit measured (a
        stored ``(D, D)`` matrix is a learned one shared by the heads; ``(H, D, D)`` one per head)."""
        section = switch_section(recipe, info, layers, cls.name, ("k", "v"),
                                 {"rotate": "hadamard", "rotation": "pca"}, "rotate_gain")
        for row, tensors in zip(layers, recipe.layer_tensors(info.num_layers)):
            for side in ("k", "v"):
                matrix = tensors.get(f"{side}.rotation")
                if matrix is not None and matrix.dim() == 2:
                    row[f"{side}_{cls.name}"] = "learned"
        return section

    @classmethod
    def inspect_lines(cls, report: dict[str, Any]) -> list[str]:
        return switch_lines(report, cls.name, "rotation", {"hadamard": "H", "pca": "P", "learned": "L"})
