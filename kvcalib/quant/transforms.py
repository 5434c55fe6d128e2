"""The channel transforms several methods and the codec apply before quantizing: TaDA's split
into a mean over kv heads and deviations, and SKVQ's channel permutation per kv head.

The methods that fit them own their decision and their recipe tensors (:mod:`kvcalib.methods.center`,
:mod:`kvcalib.methods.reorder`); the arithmetic lives here, one layer below, because later methods
(clip, levels) fit on the centred, permuted data the runtime quantizes, and the codec's reference
quantizer permutes as the kernels do: they all apply the same transform without importing the
method that fitted it.
"""

from __future__ import annotations

import torch

from kvcalib.errors import CalibrationError
from kvcalib.quant.uniform import quantize_dequantize_values

__all__ = ["MEAN_BITS", "check_mean_bits", "quantize_mean", "center", "uncenter",
           "apply_perm", "invert_perm", "check_perm"]

MEAN_BITS = (8, 16)


def check_mean_bits(mean_bits: int) -> int:
    if mean_bits not in MEAN_BITS or isinstance(mean_bits, bool):
        raise CalibrationError(f"mean_bits must be one of {MEAN_BITS}, got {mean_bits!r}")
    return mean_bits


def quantize_mean(mean: torch.Tensor, mean_bits: int) -> torch.Tensor:
    """The mean as the runtime stores it, dequantized to float32 ``(B, 1, T, D)``.

    ``16``: rounded to float16. ``8``: per-token 8-bit over one group of D channels (float16
    scale/zero), i.e. ``quantize_dequantize_values(mean, 8, group=D)``.
    """
    check_mean_bits(mean_bits)
    if mean_bits == 16:
        return mean.to(torch.float16).float()
    return quantize_dequantize_values(mean, 8, mean.shape[-1])


def center(x: torch.Tensor, mean_bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x (B, H, T, D)`` into the mean over kv heads and the deviations.

    Args:
        x: float ``(B, H, T, D)``.
        mean_bits: None: the exact float32 mean. 8 or 16: the mean as stored
            (:func:`quantize_mean`), and deviations from that stored mean.

    Returns:
        ``mean`` float32 ``(B, 1, T, D)`` and ``dev`` float32 ``(B, H, T, D)`` with
        ``mean + dev == x`` up to float32 rounding. H = 1 gives ``mean = x`` (or its stored
        version) and ``dev = 0`` (exactly 0 when ``mean_bits`` is None).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise CalibrationError(f"center needs a float tensor (B, H, T, D), got {tuple(getattr(x, 'shape', ()))}")
    xf = x.float()
    mean = xf.mean(dim=1, keepdim=True)  # (B, 1, T, D)
    if mean_bits is not None:
        mean = quantize_mean(mean, mean_bits)  # (B, 1, T, D)
    return mean, xf - mean


def uncenter(mean: torch.Tensor, dev: torch.Tensor) -> torch.Tensor:
    """``mean (B, 1, T, D) + dev (B, H, T, D)`` -> float32 ``(B, H, T, D)``."""
    return mean.float() + dev.float()


def check_perm(perm: torch.Tensor, heads: int | None = None, head_dim: int | None = None) -> torch.Tensor:
    """Validate an integer ``(H, D)`` tensor whose rows are permutations of ``range(D)``."""
    if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int64, torch.int32, torch.int16):
        raise CalibrationError(f"perm must be an integer tensor (H, D), got {getattr(perm, 'dtype', type(perm))}")
    if perm.dim() != 2:
        raise CalibrationError(f"perm must have shape (H, D), got {tuple(perm.shape)}")
    h, d = perm.shape
    if (heads is not None and h != heads) or (head_dim is not None and d != head_dim):
        raise CalibrationError(f"perm has shape {(h, d)}, expected {(heads, head_dim)}")
    ref = torch.arange(d, device=perm.device).expand(h, d)
    if not torch.equal(perm.long().sort(-1).values, ref):
        raise CalibrationError("perm rows must each be a permutation of range(D)")
    return perm.long()


def invert_perm(perm: torch.Tensor) -> torch.Tensor:
    """The inverse permutation, int64 ``(H, D)``: ``inv[h, perm[h, j]] = j``."""
    perm = perm.long()
    inv = torch.empty_like(perm)
    inv.scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device).expand_as(perm).contiguous())
    return inv


def apply_perm(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Permute channels per head: ``out[..., h, t, j] = x[..., h, t, perm[h', j]]``.

    Args:
        x: ``(..., Hx, T, D)``; ``Hx = H`` (kv heads) or ``Hx = H * rep`` (query heads: head
            ``h`` uses ``perm[h // rep]``, the ``repeat_kv`` convention of transformers).
        perm: integer ``(H, D)``.

    Returns a new tensor of ``x``'s shape and dtype.
    """
    if x.dim() < 3:
        raise CalibrationError(f"apply_perm needs x of shape (..., H, T, D), got {tuple(x.shape)}")
    h, d = perm.shape
    hx, dx = x.shape[-3], x.shape[-1]
    if dx != d or hx % h:
        raise CalibrationError(
            f"x of shape {tuple(x.shape)} does not fit perm {tuple(perm.shape)}: need D = {d} and heads a multiple of {h}"
        )
    p = perm.long().to(x.device)
    if hx != h:
        p = p.repeat_interleave(hx // h, dim=0)  # (Hx, D)
    idx = p[:, None, :].expand(x.shape)  # (..., Hx, T, D)
    return torch.gather(x, -1, idx)
