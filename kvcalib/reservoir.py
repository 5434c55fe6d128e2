"""The reservoir of token blocks as the methods fit on it: its checks and layout, the quantizer's view
of a side given what earlier methods fitted, and the quantization error of a side on it.

Several methods score candidates the same way (clipping its alphas, the rotation its basis, the
error-bounded quantizer and the levels the data their quantizer sees); the shared measure lives
here, below the methods, so that methods compose through the pipeline's fitted tensors
(``{side}.center``, ``{side}.perm``, ``{side}.clip``) instead of importing each other.
Reservoirs are ``(NB, BL, H, D)``: blocks of ``BL`` consecutive tokens, kv (or query) heads, head_dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcalib.errors import CalibrationError
from kvcalib.layout import LayerConfig
from kvcalib.quant.transforms import apply_perm, center, check_perm
from kvcalib.quant.uniform import quantize_dequantize_keys, quantize_dequantize_values
from kvcalib.stats import LayerStats

__all__ = ["SIDES", "OBJECTIVES", "check_side", "validate_reservoir", "reservoir_to_bhtd", "usable_tokens",
           "fake_quantize", "check_grid", "causal_probs", "quantization_errors", "quantizer_input"]

SIDES = ("k", "v")
OBJECTIVES = ("output", "mse")
_SCORE_BUDGET = 1 << 22  # attention-score elements per chunk of blocks (16 MiB in float32)


def check_side(side: str) -> str:
    if side not in SIDES:
        raise CalibrationError(f"side must be 'k' or 'v', got {side!r}")
    return side


def validate_reservoir(
    reservoir: torch.Tensor, name: str, heads: int | None = None, head_dim: int | None = None
) -> tuple[int, int, int, int]:
    """Check a reservoir ``(NB, BL, H, D)``: 4-D, floating, non-empty, finite. Returns its shape."""
    if not isinstance(reservoir, torch.Tensor) or not reservoir.is_floating_point():
        raise CalibrationError(f"{name} must be a floating tensor (NB, BL, H, D), got {type(reservoir).__name__}"
                               f"{'' if not isinstance(reservoir, torch.Tensor) else ' ' + str(reservoir.dtype)}")
    if reservoir.dim() != 4:
        raise CalibrationError(f"{name} must have shape (NB, BL, H, D), got {tuple(reservoir.shape)}")
    nb, bl, h, d = reservoir.shape
    if nb == 0 or bl == 0:
        raise CalibrationError(
            f"{name} is empty (shape {tuple(reservoir.shape)}): collect statistics with "
            "--reservoir-blocks >= 1 and enough samples to fill at least one block"
        )
    if heads is not None and h != heads:
        raise CalibrationError(f"{name} has {h} heads, expected {heads}: statistics from another model?")
    if head_dim is not None and d != head_dim:
        raise CalibrationError(f"{name} has head_dim {d}, expected {head_dim}: statistics from another model?")
    if not bool(torch.isfinite(reservoir).all()):
        raise CalibrationError(
            f"{name} holds NaN or inf: collect again in float32 (--dtype fp32) or check the model"
        )
    return nb, bl, h, d


def reservoir_to_bhtd(reservoir: torch.Tensor) -> torch.Tensor:
    """``(NB, BL, H, D)`` float16 reservoir -> ``(NB, H, BL, D)`` float32 (blocks become the batch)."""
    return reservoir.float().transpose(1, 2).contiguous()


def usable_tokens(block_len: int, side: str, group: int, k_axis: str = "channel") -> int:
    """Tokens of a block that quantize: keys per channel need whole groups of ``group`` tokens.

    Per-channel keys (``side="k"``, ``k_axis="channel"``) use the first ``(BL // group) * group``
    tokens; every other layout quantizes each token alone and uses all ``BL``. Raises when a
    block is shorter than one key group.
    """
    if check_side(side) == "k" and k_axis == "channel":
        n = (block_len // group) * group
        if n == 0:
            raise CalibrationError(
                f"reservoir blocks of {block_len} tokens are shorter than one key group ({group} tokens): "
                f"collect with --block-len >= {group}"
            )
        return n
    return block_len


def fake_quantize(
    x: torch.Tensor,
    side: str,
    bits: int,
    group: int,
    k_axis: str = "channel",
    clip: float | torch.Tensor = 1.0,
    valid: torch.Tensor | None = None,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """What decoding sees for ``x (..., T, D)`` stored in the runtime's layout, float32 ``(..., T, D)``.

    Keys with ``k_axis="channel"``: per channel over groups of ``group`` consecutive tokens
    (``T % group == 0``). Keys with ``k_axis="token"`` and values: per token over groups of
    ``group`` channels. ``levels``: non-uniform levels ``(2**bits,)``. ``bits >= 16`` returns ``x``
    as float32 (not quantized).
    """
    if bits >= 16:
        return x.float()
    if check_side(side) == "k" and k_axis == "channel":
        return quantize_dequantize_keys(x, bits, group, clip=clip, valid=valid, levels=levels)
    return quantize_dequantize_values(x, bits, group, clip=clip, valid=valid, levels=levels)


# the smallest clip alpha a recipe may hold: a group clipped to under 1/1024 of its range quantizes
# every value to (nearly) its centre -- the channel is zeroed, and its float16 scale underflows to 0
# for alphas like 1e-30 -- so a smaller one cannot come from a fit (whose grid stops at 0.5) and is refused
MIN_CLIP = 2.0 ** -10


def check_grid(grid: Sequence[float]) -> tuple[float, ...]:
    try:
        g = tuple(float(a) for a in grid)
    except (TypeError, ValueError):
        raise CalibrationError(f"grid must be a sequence of floats in (0, 1], got {grid!r}") from None
    if not g or not all(math.isfinite(a) and MIN_CLIP <= a <= 1.0 for a in g):
        raise CalibrationError(f"grid must be a non-empty sequence of floats in [{MIN_CLIP:g}, 1], got {grid!r}")
    return g


def causal_probs(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(scaling q k^T) under the causal mask: q ``(N, Hq, T, D)``, k ``(N, Hq, T, D)`` -> ``(N, Hq, T, T)``."""
    t = q.shape[2]
    scores = torch.einsum("nhtd,nhsd->nhts", q, k) * scaling  # (N, Hq, T, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1)  # the diagonal is always visible: no all-masked row


def quantization_errors(
    reservoir_k: torch.Tensor,
    reservoir_v: torch.Tensor,
    reservoir_q: torch.Tensor,
    scaling: float,
    bits: int,
    group: int,
    side: str,
    grid: Sequence[float] = (1.0,),
    perm: torch.Tensor | None = None,
    k_axis: str = "channel",
    objective: str = "output",
    center_bits: int = 0,
) -> torch.Tensor:
    """Error of quantizing one side at every candidate clip alpha for every kv head, float64
    ``(len(grid), H)``: clipping's objective over its alpha grid (:mod:`kvcalib.methods.clip`, whose
    module docstring explains the attention-output error) and the rotation's score at ``grid=(1.0,)``.

    Args:
        reservoir_k, reservoir_v: ``(NB, BL, H, D)``; reservoir_q: ``(NB, BL, Hq, D)``, ``Hq = H * rep``.
        scaling: the softmax scale the model applies to ``q . k``.
        bits, group, side, k_axis: the quantized side and its layout (``fake_quantize``).
        grid: candidate clip alphas in (0, 1] (default: no clipping).
        perm: optional int ``(H, D)`` channel permutation applied before quantizing (and to q
            when ``side="k"``).
        objective: ``"output"`` (attention output error, module docstring) or ``"mse"``.
        center_bits: 0 = raw K/V; 8 or 16 = TaDA centering is on with the mean stored at that
            precision: the deviations are quantized and the stored mean added back.

    Returns: ``err[a, h]`` = summed squared error of kv head ``h`` at ``grid[a]``.
    """
    check_side(side)
    grid = check_grid(grid)
    if objective not in OBJECTIVES:
        raise CalibrationError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    nb, bl, h, d = validate_reservoir(reservoir_k, "reservoir_k")
    validate_reservoir(reservoir_v, "reservoir_v", h, d)
    if reservoir_v.shape[:2] != reservoir_k.shape[:2]:
        raise CalibrationError(f"reservoir_v {tuple(reservoir_v.shape)} and reservoir_k {tuple(reservoir_k.shape)} differ")
    if objective == "output":
        _, _, hq, _ = validate_reservoir(reservoir_q, "reservoir_q", None, d)
        if tuple(reservoir_q.shape[:2]) != (nb, bl) or hq % h:
            raise CalibrationError(
                f"reservoir_q {tuple(reservoir_q.shape)} does not fit reservoir_k {tuple(reservoir_k.shape)}: "
                f"expected ({nb}, {bl}, Hq, {d}) with Hq a multiple of {h}"
            )
        if not (isinstance(scaling, int | float) and 0 < scaling < float("inf")):
            raise CalibrationError(f"scaling must be a positive finite float, got {scaling!r}")
    else:
        hq = h
    rep = hq // h
    t = usable_tokens(bl, side, group, k_axis)  # keys per channel: whole groups only
    if perm is not None:
        perm = check_perm(perm, h, d)

    k = reservoir_to_bhtd(reservoir_k)[:, :, :t]  # (NB, H, T, D)
    v = reservoir_to_bhtd(reservoir_v)[:, :, :t]  # (NB, H, T, D)
    x = k if side == "k" else v  # the side being quantized, (NB, H, T, D)
    mean = None
    if center_bits and h >= 2:
        # TaDA: the runtime stores mean_hat and quantizes dev = x - mean_hat; what attention sees
        # is mean_hat + fq(dev). So fq acts on dev, and mean_hat is added back for the scores.
        mean, x = center(x, mean_bits=center_bits)  # (NB, 1, T, D), (NB, H, T, D)
        mean = mean.expand_as(x)  # (NB, H, T, D)
    if perm is not None:
        x = apply_perm(x, perm)
        if mean is not None:
            mean = apply_perm(mean, perm)

    errs = torch.zeros(len(grid), h, dtype=torch.float64)
    if objective == "mse":
        for a, alpha in enumerate(grid):
            xh = fake_quantize(x, side, bits, group, k_axis, clip=alpha)  # (NB, H, T, D)
            errs[a] = ((xh - x) ** 2).sum(dim=(0, 2, 3), dtype=torch.float64)
        return errs

    q = reservoir_to_bhtd(reservoir_q)[:, :, :t]  # (NB, Hq, T, D)
    if perm is not None and side == "k":
        q = apply_perm(q, perm)  # q_perm . k_perm = q . k
    chunk = max(1, _SCORE_BUDGET // max(1, hq * t * t))
    for s in range(0, nb, chunk):
        xs = x[s : s + chunk]  # (n, H, T, D)
        ms = None if mean is None else mean[s : s + chunk]
        qs = q[s : s + chunk]  # (n, Hq, T, D)
        full = xs if ms is None else xs + ms  # the side as the model has it (permuted)
        if side == "k":
            vs = v[s : s + chunk]
            v_rep = vs.repeat_interleave(rep, dim=1)  # (n, Hq, T, D)
            o_ref = causal_probs(qs, full.repeat_interleave(rep, dim=1), scaling) @ v_rep  # (n, Hq, T, D)
        else:
            probs = causal_probs(qs, k[s : s + chunk].repeat_interleave(rep, dim=1), scaling)  # (n, Hq, T, T)
        for a, alpha in enumerate(grid):
            xh = fake_quantize(xs, side, bits, group, k_axis, clip=alpha)  # (n, H, T, D)
            if side == "k":
                kh = xh if ms is None else xh + ms
                diff = causal_probs(qs, kh.repeat_interleave(rep, dim=1), scaling) @ v_rep - o_ref
            else:
                diff = probs @ (xh - xs).repeat_interleave(rep, dim=1)  # P (V_hat - V), (n, Hq, T, D)
            per_q = (diff.double() ** 2).sum(dim=(0, 2, 3))  # (Hq,)
            errs[a] += per_q.view(h, rep).sum(-1)
    return errs


def quantizer_input(layer_stats: LayerStats, cfg: LayerConfig, side: str,
                    fitted: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float | torch.Tensor]:
    """What the side's quantizer sees of the reservoir, float32 ``(NB, H, T, D)`` (whole key groups;
    in the basis the statistics are in: rotated / before RoPE when those methods ran first), with
    the centering and permutation fitted before (``fitted``) applied as the runtime applies them,
    and the side's clip (1.0 or ``(1, H, 1, 1|D)``)."""
    x = reservoir_to_bhtd(getattr(layer_stats, f"reservoir_{side}"))  # (NB, H, BL, D)
    x = x[:, :, :usable_tokens(x.shape[2], side, cfg.group(side), cfg.k_axis)]
    center_bits = int(float(fitted.get(f"{side}.center", torch.tensor(0.0))))
    if center_bits and x.shape[1] >= 2:
        _, x = center(x, center_bits)  # deviations from the stored mean
    perm = fitted.get(f"{side}.perm")
    if perm is not None:
        x = apply_perm(x, perm)
    clip = fitted.get(f"{side}.clip")
    return x, (1.0 if clip is None else clip.float()[None, :, None, :])  # (1, H, 1, 1|D)
