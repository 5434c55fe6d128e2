"""8-bit scale and zero for 2-bit KV codes: what they cost in accuracy (issue 53, item 4).

``scripts/bits_floor.py`` says a 2.5-bit budget is below every windowed 2-bit layout on
SmolLM2-135M at 8k (2.605-2.711 bits, ~0.49 of them float16 scale/zero pairs) and that 8-bit
scale and zero would bring those layouts to 2.357-2.465. This measures, before any format is built
into the recipe, the accounting, the runtime or the kernels, what an 8-bit pair costs against the
float16 pair the quantizer stores today (:mod:`kvcalib.quant.uniform`).

    python -m experiments.scale8 --out DIR [--model smollm2-135m] [--context 2052] [--windows 4]
        [--queries 128] [--bits 2,3,4]

What one row measures. Real K/V of the model (post-RoPE keys, values, and the real queries of the
last ``--queries`` positions) on ``--windows`` held-out windows of ``--context`` tokens of the
Britannica article (``--data longtext``, split eval; :func:`kvcalib.eval.windows.eval_windows`),
captured from one full-precision float32 forward per window. Each layer's K and V are quantized with
the shipped recipes' layout: keys per channel over groups of 64 tokens, values per token over groups
of 64 channels (the whole head on SmolLM2), 4 sinks and a 128-token window in full precision, every
other token quantized (the default context 2052 = 4 + 30 x 64 + 128 leaves no pending partial
block, and :func:`kvcalib.layout.quantized_token_count` agrees), min/max groups without clipping,
once without rotation and once with the kind of rotation the ``-rot`` recipes use, a random-sign Walsh-Hadamard
(:mod:`kvcalib.quant.rotation`, signs of seed 0 per side as :func:`kvcalib.methods.rotate.side_seed`
draws them; queries rotate with the keys, so scores are unchanged and the output error is the same
in either basis). The parameter formats (``FORMATS``):

- ``fp16``: the shipped quantizer, :func:`kvcalib.quant.uniform.quantize_dequantize_keys` /
  ``..._values`` (this script's own group code reproduces it bit for bit: checked at run time);
- ``fp32``: the same min/max parameters unrounded (float32): what the float16 rounding itself costs;
- ``e4m3`` (a): zero and scale as ``torch.float8_e4m3fn``, covering: zero = the group minimum
  rounded DOWN, scale = ``(max - zero) / qmax`` rounded UP (so ``zero <= min`` and
  ``zero + qmax * scale >= max``);
- ``e4m3-n``: the same values rounded to NEAREST (zero first, the scale from it), falling back to
  the covering rounding in the groups where a code would leave ``0..qmax``;
- ``log8`` (b): scale = ``base * 2^(e/16)``, ``e`` a uint8, ``base`` one float32 per (layer, kv head,
  side); zero = an int8 multiple of ``scale / 8`` (``|zero| <= 16 scale``), covering: the smallest
  ``e`` whose scale is ``>= (max - min) / (qmax - 1/8)`` and lets ``floor(min / (scale / 8))`` fit in
  int8;
- ``log8c-cover`` (c, covering): scale = ``base * 2^(e/32)`` with ``base`` one float32 per (layer, kv
  head, parameter column: a key channel, a value channel group); zero = ``centre + m * scale *
  (qmax + 1) / 128`` with ``m`` an int8 and ``centre`` a float32 per column (the calibrated mean),
  so ``|zero - centre| <= (qmax + 1) scale``: a key channel with a large offset does not force a
  large scale; scale the smallest grid value ``>= (max - min) / (qmax - step)`` whose zero fits;
- ``log8c`` (c): the same tables and grid, ``e`` and ``m`` rounded to NEAREST.

How the zero is rounded so that the grid still covers the group. Covering formats floor the zero
and then take a scale large enough that ``zero + qmax * scale >= max``. Nearest formats rely on the
half code of slack that rounding to the nearest code gives: the encoder's code of an element is
``round((x - zero) / scale)``, so the codes stay in ``0..qmax`` as long as the zero is at most half a
scale above the minimum and ``zero + qmax * scale`` at most half a scale below the maximum; the
nearest log8c grid misses by at most ``scale / 64`` (zero, 2 bits) and ``qmax * 1.1 %`` of a scale.
Every format checks this on each group's extremes with the encoder's own float32 arithmetic
(:func:`codes_in_range`; float32 subtraction and division are monotone, so every element's code is
then in range) and steps the scale up where it fails (an int8 overflow, float rounding); a group
still failing at the top of the format's range is clamped and counted (``clipped_groups``). The
codes are recomputed from the ROUNDED parameters, as an encoder would, and the run counts codes
that had to be clamped (0 in every 8-bit row, by construction; the shipped float16 format can need
it: its zero is rounded to nearest, not floored). Calibration (``base``, ``centre``): one window of
the same length from the calibration text (``--data longtext``, split calib, Milton), per (layer,
kv head or column, side, bits, rotation) (:func:`calibrate`).

Metrics per (format, bits, rotation, layer), over the quantized tokens and all kv heads:

- ``k_mse`` / ``v_mse``: the mean squared reconstruction error of K / V;
- ``kl``: KL(full precision || quantized keys) of the attention weights of the real queries (mean
  over query heads and the ``--queries`` last positions, causal, each seeing the whole quantized span);
- ``out_k`` / ``out_v`` / ``out_kv``: the relative attention output error
  ``||o_hat - o||^2 / ||o||^2`` (mean over query heads and positions) with only K, only V, or both
  quantized.

The table reports each 8-bit format against ``fp16`` as a ratio (1.00 = the same error): the
ratio of the per-layer metrics summed over layers and windows, and its spread over windows (min-max
of the per-window ratios). It is a proxy measured at ``--context`` tokens on the CPU, not at 8k: the
groups, the window and the sinks are the same, only the quantized span is shorter (a group's range
does not depend on the context), and the attention is over 2k keys instead of 8k.

CPU, one thread: about 2 minutes a window on the 2-core machine shared with another job (one
forward of 2052 tokens, then 30 layers x 2 rotations x 3 widths x 7 formats of small tensors), plus
the calibration forward. Deterministic. Writes ``DIR/scale8.json`` (the rows, every metric per layer
(mean over windows) and per window (sum over layers), the command, machine, git commit) and ``DIR/scale8.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ATTN = "kvcalib_scale8_capture"
SIDES = ("k", "v")
FORMATS = ("fp16", "fp32", "e4m3", "e4m3-n", "log8", "log8c-cover", "log8c")
EIGHT_BIT = FORMATS[2:]
METRICS = ("k_mse", "v_mse", "kl", "out_k", "out_v", "out_kv")
# the log-grid formats: grid steps per octave, the zero's step in scales (a function of qmax), whether
# the zero is centred, whether the base is per parameter column (else per kv head), nearest rounding
LOG_FORMATS = {
    "log8": {"octave_steps": 16, "zero_step": lambda qmax: 1 / 8, "centred": False, "column_base": False,
             "nearest": False},
    "log8c-cover": {"octave_steps": 32, "zero_step": lambda qmax: (qmax + 1) / 128, "centred": True,
                    "column_base": True, "nearest": False},
    "log8c": {"octave_steps": 32, "zero_step": lambda qmax: (qmax + 1) / 128, "centred": True, "column_base": True,
              "nearest": True},
}


def codes_in_range(lo: torch.Tensor, hi: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmax: int) -> torch.Tensor:
    """Whether the encoder's codes of a group's extremes, ``round((x - z) / s)`` in float32 with the
    stored (rounded) parameters, lie in 0..qmax without clamping (float32 subtraction and division
    are monotone, so then every element's code does); a zero scale is in range only for a constant
    group at its zero."""
    lo32, hi32, s32, z32 = lo.float(), hi.float(), s.float(), z.float()
    pos = s32 > 0
    div = torch.where(pos, s32, torch.ones_like(s32))
    q_lo, q_hi = torch.round((lo32 - z32) / div), torch.round((hi32 - z32) / div)
    return torch.where(pos, (q_lo >= 0) & (q_hi <= qmax), (lo32 == z32) & (hi32 == z32))


def _e4m3_table() -> torch.Tensor:
    """Every finite value of float8_e4m3fn, sorted, float64 (-0 and +0 merged)."""
    allbits = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    return torch.unique(allbits[torch.isfinite(allbits)])


E4M3 = _e4m3_table()
E4M3_MAX = float(E4M3.max())


def e4m3_floor(x: torch.Tensor) -> torch.Tensor:
    """The largest e4m3 value <= x (float64; below -448: -448)."""
    idx = (torch.searchsorted(E4M3, x.double().contiguous(), right=True) - 1).clamp(0, len(E4M3) - 1)
    return E4M3[idx]


def e4m3_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest e4m3 value >= x (float64; above 448: 448)."""
    idx = torch.searchsorted(E4M3, x.double().contiguous(), right=False).clamp(0, len(E4M3) - 1)
    return E4M3[idx]


def params_e4m3(lo: torch.Tensor, hi: torch.Tensor, qmax: int, nearest: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, zero, clipped) float32 of groups with range [lo, hi], both stored as float8_e4m3fn.
    Covering: the zero is ``lo`` rounded down, the scale ``(hi - zero) / qmax`` rounded up, so
    ``zero <= lo`` and ``zero + qmax * scale >= hi``. ``nearest``: both rounded to nearest (the zero
    first, then the scale from it), falling back to covering in the groups whose codes would leave
    0..qmax (:func:`codes_in_range`). ``clipped``: groups whose grid cannot reach ``hi`` (scale above 448)."""
    z = e4m3_floor(lo)
    need = (hi.double() - z) / qmax
    s = e4m3_ceil(need)
    clipped = ~codes_in_range(lo, hi, s, z, qmax)
    if nearest:
        zn = lo.to(torch.float8_e4m3fn).double()
        sn = ((hi.double() - zn) / qmax).clamp(0, E4M3_MAX).to(torch.float32).to(torch.float8_e4m3fn).double()
        ok = codes_in_range(lo, hi, sn, zn, qmax)
        s, z = torch.where(ok, sn, s), torch.where(ok, zn, z)
        clipped = clipped & ~ok
    return s.float(), z.float(), clipped


def params_log8(lo: torch.Tensor, hi: torch.Tensor, qmax: int, base: torch.Tensor, centre: torch.Tensor,
                zero_step: float, octave_steps: int = 16, nearest: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, zero, clipped) float32 of groups with range [lo, hi] (parameter-shaped):
    ``scale = base * 2^(e / octave_steps)`` with ``e`` a uint8 (0..255) and
    ``zero = centre + m * zero_step * scale`` with ``m`` an int8 (-128..127); ``base``/``centre``
    float32, broadcastable to ``lo``; the decoder's float32 arithmetic.

    Covering (default): the smallest ``e`` whose scale is ``>= (hi - lo) / (qmax - zero_step)`` and
    lets ``m = floor((lo - centre) / (zero_step * scale))`` fit in int8, so ``zero <= lo`` and
    ``zero + qmax * scale >= hi``. ``nearest``: ``e`` the nearest grid point to ``(hi - lo) / qmax``
    and ``m`` the nearest step to ``lo``; the grid may then miss the extremes by a little, but never
    by half a code (:func:`codes_in_range`). Either way ``e`` is stepped up in the groups where the
    condition fails (float rounding, an int8 overflow); ``clipped``: groups still failing at ``e = 255``."""
    lo64, hi64 = lo.double(), hi.double()
    b = base.double().expand_as(lo64)
    c = centre.double().expand_as(lo64)
    rnd = torch.round if nearest else torch.floor

    def grid(e_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = (b.float() * torch.exp2(e_.float() / octave_steps)).double()
        m = rnd((lo64 - c) / (s * zero_step))
        z = (c.float() + m.clamp(-128, 127).float() * (s.float() * zero_step)).double()
        ok = (m >= -128) & (m <= 127) & codes_in_range(lo, hi, s, z, qmax)
        if not nearest:
            ok &= (z <= lo64) & (z + qmax * s >= hi64)
        return s, z, ok

    if nearest:
        e = torch.round(torch.log2(torch.clamp((hi64 - lo64) / qmax / b, min=1e-300)) * octave_steps)
    else:
        need = torch.maximum((hi64 - lo64) / (qmax - zero_step), (c - lo64) / (128 * zero_step))
        need = torch.maximum(need, (lo64 - c) / (127 * zero_step))
        e = torch.ceil(torch.log2(torch.clamp(need / b, min=1e-300)) * octave_steps)
    e = e.clamp(0, 255)
    s, z, ok = grid(e)
    for _ in range(256):  # step up where the grid fails (an int8 overflow, float rounding): a few steps
        bad = ~ok & (e < 255)
        if not bool(bad.any()):
            break
        e = torch.where(bad, e + 1, e)
        s, z, ok = grid(e)
    return s.float(), z.float(), ~ok


def params_fp(lo: torch.Tensor, hi: torch.Tensor, qmax: int, half: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shipped parameters (kvcalib.quant.uniform.fit_params, alpha 1) as float16, or unrounded."""
    s = (hi - lo) / torch.full_like(hi, float(qmax))
    z = lo
    if half:
        s, z = s.to(torch.float16).float(), z.to(torch.float16).float()
    return s, z, torch.zeros_like(lo, dtype=torch.bool)


def group_view(x: torch.Tensor, side: str, group: int) -> tuple[torch.Tensor, int]:
    """x (H, T, D) -> the grouped view and the dim its groups run along: keys (H, T/G, G, D) over
    dim 2 (per channel over tokens), values (H, T, D/G, G) over dim 3 (per token over channels)."""
    h, t, d = x.shape
    if side == "k":
        return x.reshape(h, t // group, group, d), 2
    return x.reshape(h, t, d // group, group), 3


def quantize(x: torch.Tensor, side: str, bits: int, group: int, fmt: str, calib: dict | None = None
             ) -> tuple[torch.Tensor, dict]:
    """Fake-quantize x (H, T, D) float32 with ``fmt``'s parameters: codes
    ``round((x - zero) / scale)`` from the ROUNDED parameters (clamped to 0..qmax; a zero scale gives
    code 0), decoded ``code * scale + zero``. Returns (x_hat (H, T, D), info): ``out_of_range``
    elements whose unclamped code left 0..qmax, ``clipped_groups``, ``groups``."""
    qmax = (1 << bits) - 1
    xg, dim = group_view(x.float(), side, group)
    lo, hi = xg.amin(dim=dim, keepdim=True), xg.amax(dim=dim, keepdim=True)  # parameter shape, kept dim
    if fmt in ("fp16", "fp32"):
        s, z, clipped = params_fp(lo, hi, qmax, fmt == "fp16")
    elif fmt in ("e4m3", "e4m3-n"):
        s, z, clipped = params_e4m3(lo, hi, qmax, nearest=fmt == "e4m3-n")
    elif fmt in LOG_FORMATS:
        spec = LOG_FORMATS[fmt]
        s, z, clipped = params_log8(lo, hi, qmax, calib[fmt]["base"], calib[fmt]["centre"], spec["zero_step"](qmax),
                                    spec["octave_steps"], spec["nearest"])
    else:
        raise ValueError(f"unknown format {fmt!r}")
    nonzero = s > 0
    t = (xg - z) / torch.where(nonzero, s, torch.ones_like(s))
    q = torch.round(t)
    out = int(((q < 0) | (q > qmax))[nonzero.expand_as(q)].sum())
    q = torch.where(nonzero, q.clamp(0, qmax), torch.zeros_like(q))
    xh = (q * s + z).reshape(x.shape)
    return xh, {"out_of_range": out, "clipped_groups": int(clipped.sum()), "groups": int(lo.numel())}


HEADROOM = 4.0  # the log grids' largest scale: 4x the largest calibrated need (two octaves)


def calibrate(x: torch.Tensor, side: str, bits: int, group: int) -> dict:
    """The log formats' stored float32 tables of one (layer, side, bits), per format, from
    calibration K or V (H, T, D) (the tokens a cache would quantize: no sinks), broadcastable to the
    parameters' kept-dim shape (keys (H, T/G, 1, D), values (H, T, D/G, 1)):

    - ``centre`` (centred formats): the column's mean (keys: per channel; values: per channel group),
      else 0;
    - ``base`` (per kv head (H, 1, 1, 1), or per column: keys (H, 1, 1, D), values (H, 1, D/G, 1)):
      the grid's top ``base * 2^(255/k)`` is ``HEADROOM`` x the largest need seen (the need of a group:
      the smallest scale that covers its range with a floored zero and lets the int8 zero reach its
      minimum), so the bottom is ``HEADROOM / 2^(255/k)`` of it (1/16384 on log8's grid, 1/62 on
      log8c's). A group above the top clips (counted as ``clipped_groups``); one below the bottom gets
      the bottom scale, coarser than it needs (its range is under 1/62 of the column's largest)."""
    qmax = (1 << bits) - 1
    xg, dim = group_view(x.float(), side, group)
    lo, hi = xg.amin(dim=dim, keepdim=True), xg.amax(dim=dim, keepdim=True)  # kept-dim shape
    h = x.shape[0]
    over = 1  # the dim one column's groups repeat along: T/G for keys, T for values
    out = {}
    for fmt, spec in LOG_FORMATS.items():
        step = spec["zero_step"](qmax)
        centre = xg.mean((over, dim), keepdim=True) if spec["centred"] else torch.zeros_like(lo[:, :1])
        need = torch.maximum((hi - lo) / (qmax - step), (centre - lo) / (128 * step))
        need = torch.maximum(need, (lo - centre) / (127 * step))
        if spec["column_base"]:
            top = need.amax(over, keepdim=True)
        else:
            top = need.reshape(h, -1).amax(1).reshape(h, 1, 1, 1)
        base = top.clamp_min(1e-30) * HEADROOM / 2.0 ** (255 / spec["octave_steps"])
        out[fmt] = {"base": base, "centre": centre}
    return out


# ------------------------------------------------------------------------------- capture

_CAPTURE: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}
_QUERIES = 128


def _capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface function: transformers' SDPA, recording the layer's post-RoPE queries of
    the last positions, keys and values (batch 1)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    _CAPTURE[int(module.layer_idx)] = (query[0, :, -_QUERIES:].float().clone(), key[0].float().clone(),
                                       value[0].float().clone(), float(scale))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def capture(model, ids: torch.Tensor, queries: int) -> dict[int, tuple]:
    """One float32 forward of ids (1, T): per layer (q (Hq, C, D), k (H, T, D), v (H, T, D), scaling)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    global _QUERIES
    _QUERIES = queries
    AttentionInterface.register(ATTN, _capture)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN)
    _CAPTURE.clear()
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return dict(_CAPTURE)


# ------------------------------------------------------------------------------- attention metrics

def scores_of(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """Causal log-softmax attention weights of the last C positions' queries q (H, rep, C, D) over
    keys k (H, T, D): float32 (H, rep, C, T); ``mask`` (C, T) True where a key is in the future."""
    s = torch.einsum("hrcd,htd->hrct", q, k) * scale
    return torch.log_softmax(s.masked_fill(mask, float("-inf")), -1)


def output(logp: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(H, rep, C, T) log-weights, (H, T, D) values -> (H, rep, C, D)."""
    return torch.einsum("hrct,htd->hrcd", logp.exp(), v)


def kl(logp: torch.Tensor, logp_hat: torch.Tensor) -> float:
    """Mean over query heads and positions of KL(p || p_hat) (masked keys contribute 0)."""
    p = logp.exp()
    terms = (p * (logp - logp_hat)).nan_to_num_(0.0)  # masked keys: 0 * (-inf - -inf) = nan -> 0
    return float(terms.sum(-1).double().mean())


def rel_err(o_hat: torch.Tensor, o: torch.Tensor) -> float:
    """Mean over query heads and positions of ||o_hat - o||^2 / ||o||^2."""
    return float((((o_hat - o) ** 2).sum(-1) / (o ** 2).sum(-1).clamp_min(1e-30)).double().mean())


# ------------------------------------------------------------------------------- the run

def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    return f"{platform.node()} {platform.machine()} {platform.processor() or ''} cpus={torch.get_num_threads()} " \
           f"torch {torch.__version__}".replace("  ", " ")


def measure(layers: dict, calib: dict, args, rotations: dict) -> dict:
    """Per (rotation, bits, format, layer): one window's metrics (module docstring)."""
    from kvcalib.layout import LayerConfig, quantized_token_count
    from kvcalib.quant.rotation import rotate
    from kvcalib.quant.uniform import quantize_dequantize_keys, quantize_dequantize_values

    out: dict = {}
    for layer, (q, k, v, scale) in sorted(layers.items()):
        h, t, d = k.shape
        c = q.shape[1]
        cfg = LayerConfig(k_bits=2, v_bits=2, k_group=args.group, v_group=args.group, window=args.window,
                          sinks=args.sinks)
        span = slice(args.sinks, args.sinks + quantized_token_count(cfg, t))
        mask = torch.arange(t)[None, :] > torch.arange(t - c, t)[:, None]  # (C, T) future keys
        for rot, r in rotations.items():
            qr, kr, vr = (q, k, v) if r is None else (rotate(q, *r["k"]), rotate(k, *r["k"]), rotate(v, *r["v"]))
            qr = qr.reshape(h, -1, c, d)  # (H, rep, C, D): kv head h's query heads
            logp = scores_of(qr, kr, scale, mask)
            o = output(logp, vr)
            for bits in args.bits:
                for fmt in FORMATS:
                    hats, row = {}, {"out_of_range": 0, "clipped_groups": 0, "groups": 0}
                    for side, x in (("k", kr), ("v", vr)):
                        xs = x[:, span]
                        xh, info = quantize(xs, side, bits, args.group, fmt, calib[(layer, rot, side, bits)])
                        if fmt == "fp16":  # this script's group code is the shipped quantizer, bit for bit
                            ref = (quantize_dequantize_keys if side == "k" else quantize_dequantize_values)(
                                xs, bits, args.group)
                            if not torch.equal(ref, xh):
                                raise AssertionError(f"fp16 path differs from kvcalib.quant.uniform, layer {layer}")
                        full = x.clone()
                        full[:, span] = xh
                        hats[side] = full
                        row[f"{side}_mse"] = float(((xh - xs) ** 2).double().mean())
                        for key in ("out_of_range", "clipped_groups", "groups"):
                            row[key] += info[key]
                    logp_k = scores_of(qr, hats["k"], scale, mask)
                    row["kl"] = kl(logp, logp_k)
                    row["out_k"] = rel_err(output(logp_k, vr), o)
                    row["out_v"] = rel_err(output(logp, hats["v"]), o)
                    row["out_kv"] = rel_err(output(logp_k, hats["v"]), o)
                    out[(rot, bits, fmt, layer)] = row
    return out


def summarise(per_window: list[dict], args, rot_names) -> list[dict]:
    """Rows per (rotation, bits, format): each metric's absolute value (summed over layers, mean over
    windows) and, against fp16, the geometric mean over layers of the per-layer ratio (each layer's
    metric summed over windows): ``{m}_ratio``, its min and max over the windows' own geometric means
    (the spread), the worst layer's ratio, and the ratio of the sums (dominated by the worst layers)."""
    rows = []
    layers = sorted({key[3] for key in per_window[0]})

    def gmean(vals):
        return math.exp(sum(math.log(x) for x in vals) / len(vals))

    for rot in rot_names:
        for bits in args.bits:
            for fmt in FORMATS:
                row = {"rotation": rot, "bits": bits, "format": fmt}
                for m in METRICS:
                    val = [[w[(rot, bits, fmt, lay)][m] for lay in layers] for w in per_window]  # [window][layer]
                    ref = [[w[(rot, bits, "fp16", lay)][m] for lay in layers] for w in per_window]
                    pairs = [(sum(a[i] for a in val), sum(r[i] for r in ref)) for i in range(len(layers))]
                    per_layer = [a / r for a, r in pairs if r > 0 and a > 0]
                    row[m] = sum(map(sum, val)) / len(val)
                    row[f"{m}_ratio"] = gmean(per_layer) if per_layer else float("nan")
                    spread = [gmean([a / r for a, r in zip(va, re) if r > 0 and a > 0]) for va, re in zip(val, ref)]
                    row[f"{m}_ratio_min"], row[f"{m}_ratio_max"] = min(spread), max(spread)
                    row[f"{m}_ratio_worst_layer"] = max(per_layer) if per_layer else float("nan")
                    tot = sum(map(sum, ref))
                    row[f"{m}_ratio_of_sums"] = sum(map(sum, val)) / tot if tot > 0 else float("nan")
                for c in ("out_of_range", "clipped_groups", "groups"):
                    row[c] = sum(w[(rot, bits, fmt, lay)][c] for w in per_window for lay in layers)
                rows.append(row)
    return rows


def _compact(per_window: list[dict], by: str) -> dict:
    """``"rotation/bits/format" -> [[metric for METRICS] per layer]`` (mean over windows), or per
    window (sum over layers), at 4 significant digits."""
    out: dict = {}
    keys = sorted({k[:3] for k in per_window[0]}, key=lambda k: (k[0], k[1], FORMATS.index(k[2])))
    layers = sorted({k[3] for k in per_window[0]})
    for rot, bits, fmt in keys:
        if by == "layer":
            vals = [[sum(w[(rot, bits, fmt, lay)][m] for w in per_window) / len(per_window) for m in METRICS]
                    for lay in layers]
        else:
            vals = [[sum(w[(rot, bits, fmt, lay)][m] for lay in layers) for m in METRICS] for w in per_window]
        out[f"{rot}/{bits}/{fmt}"] = [[float(f"{v:.4g}") for v in row] for row in vals]
    return out


def table(rows: list[dict]) -> str:
    def r(row, m):
        return f"{row[f'{m}_ratio']:.3f} ({row[f'{m}_ratio_min']:.3f}-{row[f'{m}_ratio_max']:.3f})"

    out = ["| rotation | bits | format | K MSE | V MSE | attn KL (K only) | out err K only | out err V only "
           "| out err K+V | worst layer (K+V) | clipped groups |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if row["format"] == "fp16":
            out.append(f"| {row['rotation']} | {row['bits']} | fp16 (absolute, sum of 30 layers) | {row['k_mse']:.3g} "
                       f"| {row['v_mse']:.3g} | {row['kl']:.3g} | {row['out_k']:.3g} | {row['out_v']:.3g} "
                       f"| {row['out_kv']:.3g} | - | {row['clipped_groups']} / {row['groups']} |")
        else:
            out.append(f"| {row['rotation']} | {row['bits']} | {row['format']} | {r(row, 'k_mse')} | {r(row, 'v_mse')} "
                       f"| {r(row, 'kl')} | {r(row, 'out_k')} | {r(row, 'out_v')} | {r(row, 'out_kv')} "
                       f"| {row['out_kv_ratio_worst_layer']:.3f} | {row['clipped_groups']} / {row['groups']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2052, help="tokens per window (4 sinks + 30 groups of 64 + 128)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--queries", type=int, default=128, help="the last positions whose queries are scored")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0, help="rotation signs (side_seed) and window shuffling")
    args = ap.parse_args(argv)
    args.bits = [int(b) for b in args.bits.split(",")]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    # one thread: the ops are small, and on a 2-core machine shared with another job two threads
    # spin against it (6x slower per op, measured)
    torch.set_num_threads(args.threads)

    from kvcalib.data import load_texts
    from kvcalib.eval.windows import eval_windows
    from kvcalib.layout import LayerConfig, quantized_token_count
    from kvcalib.methods.rotate import side_seed
    from kvcalib.models import load_model
    from kvcalib.quant.rotation import hadamard, random_signs, rotate

    lm = load_model(args.model, device="cpu", dtype=torch.float32)
    model, tok, info = lm.model, lm.tokenizer, lm.info
    heads, d = info.num_kv_heads, info.head_dim
    rotations = {"none": None,
                 "hadamard": {s: (hadamard(d), random_signs(heads, d, side_seed(args.seed, s))) for s in SIDES}}
    held = eval_windows(load_texts("longtext", "eval"), tok, args.context, args.windows, seed=args.seed)
    cal = eval_windows(load_texts("longtext", "calib"), tok, args.context, 1, seed=args.seed)

    print(f"calibration forward ({args.context} tokens)", flush=True)
    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=args.group, v_group=args.group, window=args.window, sinks=args.sinks)
    nq = quantized_token_count(cfg, args.context)
    span = slice(args.sinks, args.sinks + nq)  # the tokens a cache of this layout holds quantized
    calib: dict = {}
    for layer, (_, k, v, _) in sorted(capture(model, cal.ids[:1], args.queries).items()):
        for rot, r in rotations.items():
            for side, x in (("k", k), ("v", v)):
                xr = x if r is None else rotate(x, *r[side])
                for bits in args.bits:
                    calib[(layer, rot, side, bits)] = calibrate(xr[:, span], side, bits, args.group)

    per_window = []
    for i in range(held.ids.shape[0]):
        print(f"window {i + 1}/{held.ids.shape[0]}: forward + quantization", flush=True)
        per_window.append(measure(capture(model, held.ids[i:i + 1], args.queries), calib, args, rotations))
    rows = summarise(per_window, args, list(rotations))

    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python -m experiments.scale8 " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "machine": _machine(), "git_commit": _git_commit(), "wall_s": round(time.perf_counter() - t0, 1),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"name": args.model, "layers": info.num_layers, "kv_heads": heads, "head_dim": d},
        "windows": {"data": "longtext eval (Britannica)", "starts": held.starts, "overlap": held.overlap,
                    "calibration": "longtext calib (Milton), 1 window"},
        "formats": {"fp16": "shipped float16 scale/zero (nearest)", "fp32": "unrounded float32 scale/zero",
                    "e4m3": "float8_e4m3fn zero floored, scale ceiled (covering)",
                    "e4m3-n": "float8_e4m3fn zero and scale nearest, covering where a code would leave 0..qmax",
                    "log8": "scale base*2^(e/16), uint8 e, float32 base per layer/head/side; zero int8 * scale/8; covering",
                    "log8c-cover": "scale base*2^(e/32), float32 base per layer/head/column; zero = centre + int8 * "
                                   "scale*(qmax+1)/128, float32 centre per column; covering",
                    "log8c": "as log8c-cover, e and the int8 nearest (codes kept in 0..qmax)"},
        "calibration_headroom": HEADROOM,
        "rows": rows,
        # per layer: the mean over windows; per window: the sum over layers (4 significant digits; the
        # windows' per-layer values would make the file ~2 MB)
        "per_layer_fields": list(METRICS), "per_layer": _compact(per_window, "layer"),
        "per_window": _compact(per_window, "window"),
    }
    (args.out / "scale8.json").write_text(json.dumps(record, indent=None, allow_nan=True) + "\n")
    md = (f"`{record['command']}` ({record['machine']}, commit {record['git_commit'][:7]}, {record['wall_s']} s).\n\n"
          f"Proxy at {args.context} tokens ({args.windows} held-out windows, the last {args.queries} queries), "
          f"group {args.group}, window {args.window}, sinks {args.sinks}. fp16 rows: the absolute errors summed over "
          f"the {info.num_layers} layers (mean over windows). Other rows: the ratio to fp16's error, geometric mean "
          f"over layers (in brackets the min-max of the windows' own geometric means); worst layer: the largest "
          f"per-layer ratio. Codes out of 0..qmax before clamping: "
          f"{sum(r['out_of_range'] for r in rows)} in all rows.\n\n" + table(rows) + "\n")
    (args.out / "scale8.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
