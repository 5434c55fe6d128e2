"""Per-head orthogonal rotations of K/V channels: the arithmetic every path shares.

A rotation of one layer's side is ``R_h = diag(signs_h) @ M_h`` per kv head ``h``: optional
per-head signs ``(H, D)`` (+-1) followed by an orthogonal matrix, one ``(D, D)`` shared by the
heads or one per head ``(H, D, D)``. A row vector ``x`` of head ``h`` (a token's K or V) maps to
``x' = x R_h = (x * signs_h) @ M_h`` and back by ``x = (x' @ M_h^T) * signs_h``.

The random-sign Walsh-Hadamard rotation (QuaRot, TurboQuant) is ``M = hadamard(D) / sqrt(D)``
shared by every head, with per-head random signs drawn from a seed (:func:`random_signs`): only
the seed needs storing. Scores are unchanged when the query rotates the same way
(``(q R)(k R)^T = q k^T``), and an attention output over rotated values rotates back once
(``sum_n p_n (v_n R) = (sum_n p_n v_n) R``).

This module sits beside :mod:`kvcalib.quant.uniform` at the bottom of kvcalib: the rotate method,
the codec and the Triton launchers (:mod:`kvcalib_kernels`) all call these functions, so the
reference and the kernel paths rotate with the same operations (same bits on one device).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["hadamard", "is_hadamard", "is_power_of_two", "random_signs", "rotate", "unrotate", "check_rotation", "apply_rope"]


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d ** 0.5).float()  # (D, D) orthonormal, symmetric


def hadamard(d: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalised Walsh-Hadamard matrix ``H_D / sqrt(D)``, float32 ``(D, D)``: orthogonal and
    symmetric (its own inverse). ``D`` must be a power of two (Sylvester's construction)."""
    if not is_power_of_two(d):
        raise ValueError(f"a Walsh-Hadamard rotation needs head_dim a power of two, got {d}")
    h = _hadamard_cpu(d)
    return h if device is None else _hadamard_on(d, torch.device(device))


@functools.lru_cache(maxsize=None)
def _hadamard_device(d: int, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(d) if device.type == "cpu" else _hadamard_cpu(d).to(device)


def _hadamard_on(d: int, device: torch.device) -> torch.Tensor:
    # one tensor per (D, device), so that :func:`is_hadamard` is an identity test: the decode
    # launcher asks it on every call, where comparing values would cost a device sync
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _hadamard_device(d, device)


def is_hadamard(matrix: torch.Tensor) -> bool:
    """Whether ``matrix`` is the very tensor :func:`hadamard` returns for its size and device
    (never modify that tensor in place). An identity test, not a comparison of values: a copy
    made otherwise answers False, and the caller then treats it as any other matrix."""
    d = matrix.shape[-1]
    return (matrix.dim() == 2 and is_power_of_two(d) and matrix.shape[0] == d
            and matrix is _hadamard_on(d, matrix.device))


def random_signs(heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Per-head random signs, float32 ``(H, D)`` of +-1, from ``seed`` alone (CPU generator: the
    same signs on every machine)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (heads, head_dim), generator=g).float() * 2.0 - 1.0


def check_rotation(matrix: torch.Tensor, signs: torch.Tensor | None, heads: int | None = None,
                   head_dim: int | None = None) -> tuple[int | None, int]:
    """Validate a rotation's shapes: ``matrix`` float ``(D, D)`` or ``(H, D, D)``, ``signs`` float
    ``(H, D)`` or None. Returns (heads or None when nothing fixes them, D). Raises ValueError."""
    if not isinstance(matrix, torch.Tensor) or not matrix.is_floating_point() or matrix.dim() not in (2, 3):
        raise ValueError(f"a rotation matrix must be a float (D, D) or (H, D, D) tensor, got "
                         f"{getattr(matrix, 'dtype', type(matrix))} {tuple(getattr(matrix, 'shape', ()))}")
    d = matrix.shape[-1]
    if matrix.shape[-2] != d:
        raise ValueError(f"a rotation matrix must be square in its last two dims, got {tuple(matrix.shape)}")
    h = matrix.shape[0] if matrix.dim() == 3 else None
    if signs is not None:
        if not isinstance(signs, torch.Tensor) or signs.dim() != 2 or signs.shape[1] != d or (
                h is not None and signs.shape[0] != h):
            raise ValueError(f"rotation signs must be (H, D={d}), got {tuple(getattr(signs, 'shape', ()))}")
        h = signs.shape[0]
    if heads is not None and h is not None and h != heads:
        raise ValueError(f"the rotation has {h} heads, expected {heads}")
    if head_dim is not None and d != head_dim:
        raise ValueError(f"the rotation has head_dim {d}, expected {head_dim}")
    return h, d


def _heads_first(t: torch.Tensor, hx: int) -> torch.Tensor:
    """A per-kv-head table ``(H, ...)`` for ``hx`` heads of x (``hx = H * rep``: query heads read
    kv head ``i // rep``)."""
    if t.shape[0] == hx:
        return t
    return t.repeat_interleave(hx // t.shape[0], dim=0)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, matrix: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """``x (..., Hx, N, D) -> x R``: float32 (float64 stays float64) ``(..., Hx, N, D)``.

    ``Hx`` is the kv heads of the rotation, or a multiple of them (query heads, GQA: head ``i``
    uses kv head ``i // rep``). ``matrix`` (D, D) | (H, D, D), ``signs`` (H, D) | None."""
    dt = _compute_dtype(x)
    y = x.to(dt)
    hx = x.shape[-3]
    if signs is not None:
        y = y * _heads_first(signs.to(device=x.device, dtype=dt), hx)[:, None, :]  # (Hx, 1, D)
    m = matrix.to(device=x.device, dtype=dt)
    if m.dim() == 2:
        return y @ m
    return y @ _heads_first(m, hx)  # (..., Hx, N, D) @ (Hx, D, D)


def unrotate(y: torch.Tensor, matrix: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``y (..., Hx, N, D) -> y R^T = (y @ M^T) * signs``."""
    dt = _compute_dtype(y)
    hx = y.shape[-3]
    m = matrix.to(device=y.device, dtype=dt)
    x = y.to(dt) @ (m.T if m.dim() == 2 else _heads_first(m, hx).transpose(-1, -2))
    if signs is not None:
        x = x * _heads_first(signs.to(device=y.device, dtype=dt), hx)[:, None, :]
    return x


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The rotary position embedding of transformers (``rotate_half`` pairs) on ``x`` (..., N, D):
    float32 (float64 stays float64) ``(..., N, D)``.

    ``positions`` int ``(B|1, N)`` (x is ``(B, H, N, D)``) or ``(N,)``: each token's RoPE position;
    ``rope`` float ``(R/2 + 1,)``: the inverse frequencies of the first R channels, then the
    attention scaling ``a`` of cos/sin (:func:`kvcalib.models.rope_tables`). Forward:
    ``y = x cos + rotate_half(x) sin`` on the first R channels (cos/sin times ``a``, the rest kept);
    ``inverse=True`` undoes it exactly in exact arithmetic (``(y cos - rotate_half(y) sin) / a**2``).
    """
    dt = _compute_dtype(x)
    inv_freq, scale = rope[:-1].to(device=x.device, dtype=dt), float(rope[-1])
    r = 2 * inv_freq.numel()
    if r > x.shape[-1] or r == 0:
        raise ValueError(f"a rotary table of {r} channels does not fit head_dim {x.shape[-1]}")
    pos = positions.to(device=x.device, dtype=dt)
    freqs = pos[..., None] * inv_freq  # (B|1, N, R/2) or (N, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., N, R)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    if pos.dim() == 2:  # (B|1, N, R) -> (B|1, 1, N, R): broadcast over the heads of x (B, H, N, D)
        cos, sin = cos[:, None], sin[:, None]
    y = x.to(dt)
    part = y[..., :r]
    half = torch.cat([-part[..., r // 2:], part[..., :r // 2]], dim=-1)  # rotate_half
    if inverse:
        out = (part * cos - half * sin) / (scale * scale)
    else:
        out = part * cos + half * sin
    return out if r == x.shape[-1] else torch.cat([out, y[..., r:]], dim=-1)
