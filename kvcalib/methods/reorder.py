"""SKVQ channel reordering: permute channels so similar channels share a quantization group.

Where it matters. A permutation of channels changes nothing for keys quantized per channel
(KIVI layout, ``k_axis="channel"``: every channel has its own scale/zero). It matters where one
(scale, zero) spans ``group`` channels of a token: values always, and keys with
``k_axis="token"``. There, a group holding one large-range channel and several small ones
wastes the small ones' resolution; grouping channels of similar range fixes that (SKVQ 3.1).

Fitting (per kv head, :func:`fit_channel_permutation`):

1. features per channel ``(D, F)``: ``[min, max, mean, std, absmax]`` (:func:`channel_features`),
   divided by the head's largest ``absmax`` (one common factor per head, so the geometry between
   features is kept and KMeans' tolerance is meaningful);
2. scikit-learn KMeans with ``C = D // group`` clusters, ``random_state=seed``;
3. KMeans clusters have unequal sizes, groups must hold exactly ``group`` channels: the
   **balanced assignment** is the optimal capacity-constrained one, i.e. the assignment of
   channels to clusters minimising the total squared distance to the assigned centroid subject
   to every cluster receiving exactly ``group`` channels. It is solved exactly as a linear
   assignment problem (Hungarian algorithm, ``scipy.optimize.linear_sum_assignment``) between
   the D channels and ``group`` copies of each of the C centroids;
4. groups are ordered by their centroid's range feature (``max - min``, ascending, ties by
   centroid index), channels inside a group by original index; the permutation is the
   concatenation.

What it improves: the *relative* error of the small-range channels, which no longer share a
range with large ones (a planted 0.05-vs-400 scale mix: per-channel relative error falls by
>1000x). The *absolute* error is dominated by the largest channels and barely changes. The
features are linear (not log) on purpose: KMeans then spends its clusters where the absolute
ranges differ most, i.e. it first isolates large-range (outlier) channels.

Fallbacks (documented, never NaN): one group per head (``group == D``), or fewer distinct
feature vectors than clusters (e.g. all-constant or all-zero channels), give the channels
sorted by their range feature with a stable sort (identity when all channels are alike):
KMeans cannot find ``C`` clusters in fewer distinct points, and sorting by range is the 1-D
clustering that remains meaningful.

Convention (what the runtime must do with ``{k|v}.perm``, int64 ``(H, D)``)::

    apply_perm(x, perm)[..., h, t, j] = x[..., h, t, perm[h, j]]

``perm[h, j]`` is the original channel stored at position ``j`` of kv head ``h``.
:func:`apply_perm` and its kin live in :mod:`kvcalib.quant.transforms`: the codec's reference
quantizer and the methods fitted after this one permute as the runtime does.

- values (``v.perm``): permute every value vector of head ``h`` with ``apply_perm`` before it is
  quantized and stored (keep the full-precision segments, sinks, window and outlier pool, in
  the same permuted order, so one output un-permutation serves all segments). The attention
  output then comes out permuted: ``o = apply_perm(o_perm, invert_perm(perm))`` where query head
  ``i`` uses kv head ``i // rep`` (``apply_perm`` expands ``(H, D)`` to ``Hq = H * rep`` heads).
- keys (``k.perm``, only with ``k_axis="token"``): permute stored keys the same way and permute
  the query with the same (expanded) permutation before the dot product; scores are unchanged
  because ``sum_j q[perm[j]] k[perm[j]] = sum_c q[c] k[c]``. Keys are post-RoPE as cached, so
  the permutation is applied after RoPE to both.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import torch

from kvcalib.layout import LayerConfig
from kvcalib.methods.base import (
    CalibrationError,
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
    check_quantized_side,
    check_side,
    reservoir_to_bhtd,
)
from kvcalib.quant.transforms import apply_perm, center, check_perm, invert_perm
from kvcalib.stats import LayerStats

__all__ = [
    "FEATURES",
    "channel_features",
    "channel_features_from_tokens",
    "fit_channel_permutation",
    "apply_perm",
    "invert_perm",
    "check_perm",
    "PermState",
    "ReorderMethod",
]

FEATURES = ("min", "max", "mean", "std", "absmax")
_RANGE = (0, 1)  # indices of min and max in FEATURES: the range feature is max - min


def _normalise(feats: torch.Tensor) -> torch.Tensor:
    """Divide each head's features ``(H, D, F)`` by that head's largest |feature| (zero heads stay 0)."""
    scale = feats.abs().amax(dim=(1, 2), keepdim=True)  # (H, 1, 1)
    return feats / torch.where(scale > 0, scale, torch.ones_like(scale))


def channel_features(layer_stats: LayerStats, side: str, centered: bool = False) -> torch.Tensor:
    """Per-channel features of one layer's K or V, float64 ``(H, D, F)``, F = len(FEATURES).

    From the streamed moments ``min/max/mean/sq_mean/absmax`` (``std = sqrt(max(E[x^2] - mean^2,
    0))``). With ``centered=True`` (TaDA centering is on for this side) the moments of the
    centred deviations are not in the statistics, so the features are computed from the
    centred reservoir instead (:func:`channel_features_from_tokens`).
    """
    check_side(side)
    if centered:
        res = reservoir_to_bhtd(getattr(layer_stats, f"reservoir_{side}"))  # (NB, H, BL, D)
        if res.shape[1] < 2:
            raise CalibrationError("centered features need at least 2 kv heads (centering is off for H=1)")
        _, dev = center(res)  # (NB, H, BL, D)
        return channel_features_from_tokens(dev.transpose(1, 2).reshape(-1, res.shape[1], res.shape[3]))
    s = getattr(layer_stats, side)
    mean = s["mean"].double()  # (H, D)
    var = (s["sq_mean"].double() - mean**2).clamp_min(0.0)  # (H, D); rounding can make it < 0
    feats = torch.stack([s["min"].double(), s["max"].double(), mean, var.sqrt(), s["absmax"].double()], -1)
    if not bool(torch.isfinite(feats).all()):
        raise CalibrationError(f"statistics of {side} hold NaN or inf: collect again in fp32")
    return _normalise(feats)  # (H, D, F)


def channel_features_from_tokens(x: torch.Tensor) -> torch.Tensor:
    """Features ``(H, D, F)`` float64 of token vectors ``x (N, H, D)`` (same definition as above)."""
    if x.dim() != 3 or x.shape[0] == 0:
        raise CalibrationError(f"token features need x of shape (N>0, H, D), got {tuple(x.shape)}")
    x = x.double()
    if not bool(torch.isfinite(x).all()):
        raise CalibrationError("token vectors hold NaN or inf")
    mn, mx = x.amin(0), x.amax(0)  # (H, D)
    feats = torch.stack([mn, mx, x.mean(0), x.std(0, unbiased=False), torch.maximum(mn.abs(), mx.abs())], -1)
    return _normalise(feats)


def _sorted_by_range(x: torch.Tensor) -> torch.Tensor:
    """Stable sort of channels by the range feature; x ``(D, F)`` -> int64 ``(D,)``."""
    key = x[:, _RANGE[1]] - x[:, _RANGE[0]]  # (D,)
    return torch.sort(key, stable=True).indices


def fit_channel_permutation(features: torch.Tensor, group: int, seed: int = 0, n_init: int = 3) -> torch.Tensor:
    """Per kv head: equal-size groups of ``group`` channels of similar features (module docstring).

    Args:
        features: float ``(H, D, F)``, e.g. :func:`channel_features` (F >= 2; the first two are
            min and max, used for the range key).
        group: channels per quantization group; ``D % group == 0``.
        seed: KMeans ``random_state``.
        n_init: KMeans restarts.

    Returns:
        int64 ``(H, D)``: row ``h`` is a permutation of ``range(D)``; positions
        ``[g*group, (g+1)*group)`` form quantization group ``g``.
    """
    if not isinstance(features, torch.Tensor) or features.dim() != 3 or not features.is_floating_point():
        raise CalibrationError(
            f"features must be a float tensor (H, D, F), got {tuple(getattr(features, 'shape', ()))}"
        )
    h, d, f = features.shape
    if h == 0 or d == 0 or f < 2:
        raise CalibrationError(f"features of shape {(h, d, f)}: need H, D >= 1 and F >= 2 (min, max, ...)")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or group > d or d % group:
        raise CalibrationError(f"group must divide head_dim {d} (1 <= group <= {d}), got {group!r}")
    if not bool(torch.isfinite(features).all()):
        raise CalibrationError("channel features hold NaN or inf: the statistics are corrupt; collect again")
    if n_init < 1:
        raise CalibrationError(f"n_init must be >= 1, got {n_init}")
    n_clusters = d // group
    x_all = features.double().cpu()  # (H, D, F)
    perms = []
    for head in range(h):
        x = x_all[head]  # (D, F)
        distinct = torch.unique(x, dim=0).shape[0]
        if n_clusters == 1 or distinct < n_clusters:
            perms.append(_sorted_by_range(x) if n_clusters > 1 else torch.arange(d))
            continue
        perms.append(_balanced_kmeans(x, n_clusters, group, seed, n_init))
    return torch.stack(perms).long()  # (H, D)


def _balanced_kmeans(x: torch.Tensor, n_clusters: int, group: int, seed: int, n_init: int) -> torch.Tensor:
    """KMeans on ``x (D, F)`` then the optimal equal-size assignment; int64 ``(D,)`` permutation."""
    import numpy as np
    from scipy.optimize import linear_sum_assignment
    from sklearn.cluster import KMeans

    xn = x.numpy()  # (D, F)
    with warnings.catch_warnings():  # near-duplicate points: KMeans warns, the assignment copes
        warnings.simplefilter("ignore")
        km = KMeans(n_clusters=n_clusters, random_state=seed, n_init=n_init).fit(xn)
    centers = km.cluster_centers_  # (C, F)
    cost = ((xn[:, None, :] - centers[None, :, :]) ** 2).sum(-1)  # (D, C)
    slots = np.repeat(np.arange(n_clusters), group)  # (D,) slot -> cluster
    rows, cols = linear_sum_assignment(cost[:, slots])  # channel rows[i] -> slot cols[i]
    assign = np.empty(xn.shape[0], dtype=np.int64)
    assign[rows] = slots[cols]  # (D,) cluster of each channel, exactly `group` per cluster
    crange = centers[:, _RANGE[1]] - centers[:, _RANGE[0]]  # (C,)
    order = np.lexsort((np.arange(n_clusters), crange))  # ascending range, ties by index
    perm = np.concatenate([np.flatnonzero(assign == c) for c in order])  # channels ascending inside a group
    return torch.from_numpy(perm)


class PermState(MethodState):
    """Channel permutations of one layer, int64 ``(H, D)`` per permuted side (the convention above)."""

    def __init__(self, perms: dict[str, torch.Tensor]) -> None:
        self.perm = {side: p.long() for side, p in perms.items() if p is not None}  # side -> (H, D)
        self.inv = {side: invert_perm(p) for side, p in self.perm.items()}  # side -> (H, D)
        self._device: dict[tuple[str, torch.device], torch.Tensor] = {}

    def encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        return apply_perm(x, self.perm[side]) if side in self.perm else x

    def decode(self, side: str, y: torch.Tensor, stored: dict[str, Any]) -> torch.Tensor:
        return apply_perm(y, self.inv[side]) if side in self.inv else y

    def device_perm(self, side: str, device: torch.device) -> torch.Tensor | None:
        """The side's permutation on ``device`` as int32 (H, D), copied once per device (the
        quantize-and-pack and decode-attention kernels read it); None when not permuted."""
        if side not in self.perm:
            return None
        key = (side, device)
        if key not in self._device:
            self._device[key] = self.perm[side].to(device=device, dtype=torch.int32).contiguous()
        return self._device[key]

    def kernel_encode(self, side: str, x: torch.Tensor, stored: dict[str, Any]) -> KernelEncode | None:
        perm = self.device_perm(side, x.device)
        if perm is None:
            return NO_KERNEL_ENCODE
        if perm.shape[-1] != x.shape[-1]:
            return None  # the reference names the mismatch
        return KernelEncode(perm=perm)  # (H, D) int32: the kernel gathers the input channels

    def kernel_attend(self, side: str, device: torch.device) -> KernelAttend | None:
        perm = self.device_perm(side, device)
        return NO_KERNEL_ATTEND if perm is None else KernelAttend(perm=perm)


class ReorderMethod(Method):
    """SKVQ channel reordering for the sides whose groups span channels.

    Produces ``v.perm`` when values are quantized (``v_bits < 16``) with more than one channel
    group, and ``k.perm`` when keys are quantized per token (``k_axis="token"``) with more than
    one group. Per-channel keys (KIVI layout) get no permutation: it would change nothing.
    With centering fitted before (``{side}.center > 0`` in the fitted tensors), features come
    from the centred reservoir.
    """

    name: ClassVar[str] = "reorder"
    summary: ClassVar[str] = "SKVQ channel reordering (KMeans) so similar channels share a group"
    order: ClassVar[int] = 20
    tensors: ClassVar[tuple[TensorSpec, ...]] = (
        TensorSpec("perm", ("k", "v"), "int64", "(H, D)",
                   "channel permutation per kv head (keys: k_axis='token' only); permute x and q, "
                   "un-permute the output"),
    )
    needs_reservoir: ClassVar[bool] = False
    search: ClassVar[str | None] = "layer"
    letter: ClassVar[str] = "r"
    flags: ClassVar[tuple[Flag, ...]] = (Flag("reorder", bool, "SKVQ channel reordering (KMeans) for per-token groups."),)

    def __init__(self, n_init: int = 3) -> None:
        if isinstance(n_init, bool) or not isinstance(n_init, int) or n_init < 1:
            raise ValueError(f"n_init must be a positive int, got {n_init!r}")
        self.n_init = n_init

    def _fit(self, layer_stats: LayerStats, layer_cfg: LayerConfig, seed: int,
             context: FitContext, geom: LayerGeometry) -> dict[str, torch.Tensor]:
        out = {}
        sides = []
        if layer_cfg.v_bits < 16 and geom.head_dim // layer_cfg.v_group > 1:
            sides.append(("v", layer_cfg.v_group))
        if layer_cfg.k_bits < 16 and layer_cfg.k_axis == "token" and geom.head_dim // layer_cfg.k_group > 1:
            sides.append(("k", layer_cfg.k_group))
        for side, group in sides:
            centered = float(context.fitted.get(f"{side}.center", torch.tensor(0.0))) > 0 and geom.heads > 1
            if centered and geom.blocks == 0:
                raise CalibrationError("centered reordering needs a non-empty reservoir")
            feats = channel_features(layer_stats, side, centered=centered)  # (H, D, F)
            out[f"{side}.perm"] = fit_channel_permutation(feats, group, seed, self.n_init)  # (H, D)
        return out

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], cfg: LayerConfig, heads: int | None,
             head_dim: int | None) -> PermState | None:
        perms = {}
        for side in ("k", "v"):
            t = tensors.get(f"{side}.perm")
            if t is None:
                continue
            check_quantized_side(cfg, f"{side}.perm")
            ok = t.dim() == 2 and t.shape[0] >= 1 and not t.is_complex() and not t.is_floating_point() and t.dtype != torch.bool and bool(
                (torch.sort(t.long(), dim=-1).values == torch.arange(t.shape[-1])).all())
            if not ok or (head_dim is not None and t.shape[-1] != head_dim) or (heads is not None and t.shape[0] != heads):
                raise ValueError(f"{side}.perm must be an (H, head_dim) = ({heads}, {head_dim}) permutation per head, "
                                 f"got {t.dtype} {tuple(t.shape)}")
            perms[side] = t
        return PermState(perms) if perms else None

    @classmethod
    def from_arguments(cls, cfg: LayerConfig, arguments: dict[str, Any]) -> PermState | None:
        perms = {side: arguments.pop(f"{side}_perm", None) for side in ("k", "v")}
        perms = {side: p for side, p in perms.items() if p is not None}
        return PermState(perms) if perms else None
