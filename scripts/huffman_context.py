"""Does a context-aware Huffman code reach issue 7's 15%? Entropy of the quantized KV symbols
given their channel, channel class or previous token, on real K/V (CPU, a few minutes).

kvcalib codes each (layer, K|V side) with one order-0 codebook. At 2 bits the real symbols carry
~1.75-1.85 bits of order-0 entropy, so coding saves ~1% of the effective bits, not 15%. This script
measures what richer codes could give. Symbols come out exactly as kvcalib's cache stores them
(:func:`benchmarks.huffman_bits.capture_kv` -> the packed span -> ``flush_codes`` with the recipe's
codecs). Calibration windows come from the ``embedded`` calibration split; held-out windows from
``eval_texts("embedded")`` (disjoint documents).

Per (model, setting, layer, side), held-out unless said otherwise:
  H0              order-0 plug-in entropy, pooled over heads and channels
  H_ch / H_hch    plug-in H(sym | channel) / H(sym | kv head, channel)
  xent_C{c}       cross-entropy (bits/sym) of held-out symbols under C class distributions fit on
                  calibration (Laplace alpha 0.5); classes = k-means with a code-length objective
                  on the per-(head, channel) calibration histograms
  huff_C{c}       real Huffman bits/sym (kvcalib ``build_codebook`` per class calibration
                  histogram) on the held-out symbols; no raw-stream fallback, no index
  H_prev          plug-in H(sym | previous token's symbol, same head and channel)
  huff_m{m}_C{c}  Huffman of m adjacent stored channels of one token as one symbol, per bit
  effective bits  kvcalib's accounting (``entropy_memory``: payload, index, padding, decode tables)
                  at 4096 tokens with every quantized side coded at each option's bits/sym, for 1
                  and 4 tokens per stream; options with classes also pay their tables and class map

    python scripts/huffman_context.py      # smollm2-135m and qwen2.5-coder-0.5b, ~70 s

Writes ``artifacts/bench/huffman_context.json`` and ``huffman_context.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvcalib importable from a checkout

from kvcalib.methods.huffman import (SIDES, StreamLayout, entropy_memory, flush_codes,
                                         strip_codebooks)
from kvcalib.data import load_texts, pack_samples
from benchmarks.huffman_bits import _packed_span, _with_books, capture_kv
from kvcalib.eval.harness import eval_texts
from kvcalib.models import load_model
from kvcalib.quant.huffman import build_codebook
from kvcalib.recipe import Recipe
from kvcalib.recipe import build_codecs

ALPHA = 0.5
CLASSES = (1, 2, 4, 8)
CONTEXT = 4096


# ------------------------------------------------------------------ entropy helpers (numpy)

def ent(counts: np.ndarray) -> float:
    n = counts.sum()
    if n <= 0:
        return 0.0
    p = counts[counts > 0] / n
    return float(-(p * np.log2(p)).sum())


def cond_ent(counts: np.ndarray) -> float:
    """counts (U, K): sum_u n_u H(p_u) / N (plug-in H(sym | unit))."""
    n = counts.sum()
    return float(sum(ent(c) * c.sum() for c in counts) / n)


def smooth(counts: np.ndarray) -> np.ndarray:
    """(..., K) -> Laplace-smoothed probabilities."""
    k = counts.shape[-1]
    return (counts + ALPHA) / (counts.sum(-1, keepdims=True) + ALPHA * k)


def xent(eval_counts: np.ndarray, calib_counts: np.ndarray) -> float:
    """Held-out bits/sym when each row of eval_counts (U, K) is coded with the smoothed row of
    calib_counts (U, K)."""
    q = smooth(calib_counts.astype(np.float64))
    return float(-(eval_counts * np.log2(q)).sum() / eval_counts.sum())


def class_counts(unit_counts: np.ndarray, assign: np.ndarray, c: int) -> np.ndarray:
    out = np.zeros((c, unit_counts.shape[1]), dtype=np.float64)
    np.add.at(out, assign, unit_counts)
    return out


def kl_kmeans(counts: np.ndarray, c: int, restarts: int = 6, iters: int = 50, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Cluster units (rows of counts (U, K)) into c classes minimizing the calibration code length
    sum_u sum_k counts[u,k] * -log2 q_class(u)[k]. Returns (assign, sortcut_assign)."""
    u, k = counts.shape
    counts = counts.astype(np.float64)
    p = smooth(counts)
    lo, hi = k // 4, k - k // 4  # middle half of the alphabet (2-bit: symbols 1,2)
    mid = p[:, lo:hi].sum(1)
    order = np.argsort(mid, kind="stable")
    sortcut = np.empty(u, dtype=np.int64)
    sortcut[order] = np.arange(u) * c // u
    if c == 1:
        return np.zeros(u, dtype=np.int64), sortcut
    rng = np.random.default_rng(seed)

    def cost(assign):
        q = smooth(class_counts(counts, assign, c))
        return float(-(counts * np.log2(q[assign])).sum())

    def lloyd(assign):
        for _ in range(iters):
            q = smooth(class_counts(counts, assign, c))  # (c, K)
            cst = -(counts @ np.log2(q).T)  # (U, c)
            new = cst.argmin(1)
            # reseed empty classes with the unit that costs most
            for j in range(c):
                if not (new == j).any():
                    worst = int((cst[np.arange(u), new]).argmax())
                    new[worst] = j
            if np.array_equal(new, assign):
                break
            assign = new
        return assign

    best, best_cost = None, math.inf
    inits = [sortcut.copy()] + [rng.integers(0, c, size=u) for _ in range(restarts - 1)]
    for a0 in inits:
        a = lloyd(a0)
        cs = cost(a)
        if cs < best_cost:
            best, best_cost = a, cs
    return best, sortcut


def huff_bits(eval_cls: np.ndarray, calib_cls: np.ndarray) -> tuple[float, int]:
    """Actual Huffman bits/sym: one kvcalib codebook per class. Returns (bits/sym, max code length)."""
    tot, mx = 0.0, 0
    for ec, cc in zip(eval_cls, calib_cls):
        cb = build_codebook(torch.from_numpy(cc.astype(np.int64)))
        lens = cb.lengths.numpy().astype(np.float64)
        tot += float((ec * lens).sum())
        mx = max(mx, int(lens.max()))
    return tot / eval_cls.sum(), mx


def unit_counts(codes: torch.Tensor, k: int) -> np.ndarray:
    """codes uint8 (B, H, N, D) -> counts (H*D, K) per (head, channel)."""
    b, h, n, d = codes.shape
    unit = (torch.arange(h).view(1, h, 1, 1) * d + torch.arange(d).view(1, 1, 1, d)).expand(b, h, n, d)
    idx = unit.reshape(-1) * k + codes.reshape(-1).long()
    return torch.bincount(idx, minlength=h * d * k).view(h * d, k).numpy().astype(np.float64)


def pair_counts(codes: torch.Tensor, k: int, axis: int, unit_cls: np.ndarray | None = None, c: int = 1) -> np.ndarray:
    """Counts of (class, prev, cur) along ``axis`` (2 = token, 3 = channel) -> (c, K, K)."""
    b, h, n, d = codes.shape
    x = codes.long()
    if axis == 2:
        prev, cur = x[:, :, :-1, :], x[:, :, 1:, :]
        dd = torch.arange(d).view(1, 1, 1, d)
    else:
        prev, cur = x[:, :, :, :-1], x[:, :, :, 1:]
        dd = torch.arange(1, d).view(1, 1, 1, d - 1)
    if unit_cls is None:
        cls = torch.zeros_like(cur)
    else:
        table = torch.from_numpy(unit_cls).long()  # (H*D,)
        unit = torch.arange(h).view(1, h, 1, 1) * d + dd
        cls = table[unit].expand_as(cur)
    idx = (cls * k + prev) * k + cur
    return torch.bincount(idx.reshape(-1), minlength=c * k * k).view(c, k, k).numpy().astype(np.float64)


def cond_pair_ent(pc: np.ndarray) -> float:
    """plug-in H(cur | class, prev) from counts (c, K, K)."""
    return cond_ent(pc.reshape(-1, pc.shape[-1]))


def side_metrics(cc: torch.Tensor, ce: torch.Tensor, bits: int) -> dict:
    k = 1 << bits
    h, d = cc.shape[1], cc.shape[3]
    uc, ue = unit_counts(cc, k), unit_counts(ce, k)  # (H*D, K)
    pooled_c, pooled_e = uc.sum(0), ue.sum(0)
    ch_c = uc.reshape(h, d, k).sum(0)
    ch_e = ue.reshape(h, d, k).sum(0)
    r = {"bits": bits, "heads": h, "head_dim": d, "symbols_eval": int(pooled_e.sum()),
         "symbols_calib": int(pooled_c.sum()),
         "H0": ent(pooled_e), "H0_calib": ent(pooled_c),
         "H_ch": cond_ent(ch_e), "H_hch": cond_ent(ue),
         "xent_ch": xent(ch_e, ch_c), "xent_hch": xent(ue, uc)}
    assigns = {}
    for c in CLASSES:
        a, sc = kl_kmeans(uc, c)
        assigns[c] = a
        r[f"xent_C{c}"] = xent(class_counts(ue, a, c), class_counts(uc, a, c))
        r[f"xent_sortcut_C{c}"] = xent(class_counts(ue, sc, c), class_counts(uc, sc, c))
        r[f"Hcal_C{c}"] = cond_ent(class_counts(uc, a, c))  # in-sample (calib) class entropy
        hb, mx = huff_bits(class_counts(ue, a, c), class_counts(uc, a, c))
        r[f"huff_C{c}"] = hb
        r[f"huff_maxlen_C{c}"] = mx
        # side information: class map (ceil(log2 C) bits per (head, channel)) + C-1 extra
        # uint8 length vectors (the first is what exists today)
        r[f"sideinfo_bits_C{c}"] = h * d * math.ceil(math.log2(c)) + (c - 1) * k * 8 if c > 1 else 0
    hb, _ = huff_bits(ue, uc)
    r["huff_hch"] = hb
    # order-1 along tokens (previous token, same head & channel)
    pe, pc_ = pair_counts(ce, k, 2), pair_counts(cc, k, 2)
    r["H_prev"] = cond_pair_ent(pe)
    r["H0_pairs"] = ent(pe.sum((0, 1)))  # order-0 of the same symbols (pairs drop the first token)
    r["xent_prev"] = xent(pe.reshape(-1, k), pc_.reshape(-1, k))
    r["huff_prev"] = huff_bits(pe.reshape(-1, k), pc_.reshape(-1, k))[0]
    a4 = assigns[4]
    pe4, pc4 = pair_counts(ce, k, 2, a4, 4), pair_counts(cc, k, 2, a4, 4)
    r["H_prev_C4"] = cond_pair_ent(pe4)
    r["xent_prev_C4"] = xent(pe4.reshape(-1, k), pc4.reshape(-1, k))
    # order-1 along channels within a token (stored order)
    pce, pcc = pair_counts(ce, k, 3), pair_counts(cc, k, 3)
    r["H_prevch"] = cond_pair_ent(pce)
    r["xent_prevch"] = xent(pce.reshape(-1, k), pcc.reshape(-1, k))
    # alphabet extension: m adjacent stored channels of one token coded as one symbol (stays
    # inside one token's stream, so one-token-per-stream parallel decode is kept)
    for m in ((2, 4) if bits == 2 else (2,)):
        tc, te = tuples(cc, bits, m), tuples(ce, bits, m)
        km = k ** m
        tuc, tue = unit_counts(tc, km), unit_counts(te, km)  # (H*D/m, K^m)
        r[f"H_m{m}"] = ent(tue.sum(0)) / m
        for c in (1, 4):
            a = kl_kmeans(tuc, c, restarts=3)[0]
            ec, cc_ = class_counts(tue, a, c), class_counts(tuc, a, c)
            r[f"xent_m{m}_C{c}"] = xent(ec, cc_) / m
            hb, mx = huff_bits(ec, cc_)
            r[f"huff_m{m}_C{c}"] = hb / m
            r[f"huff_maxlen_m{m}_C{c}"] = mx
            r[f"sideinfo_bits_m{m}_C{c}"] = (h * d // m) * math.ceil(math.log2(c)) + c * km * 8
    return r


def tuples(codes: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """(B, H, N, D) b-bit codes -> (B, H, N, D/m) codes of 2**(b*m) symbols (m adjacent channels)."""
    b, h, n, d = codes.shape
    x = codes.long().reshape(b, h, n, d // m, m)
    w = (1 << bits) ** torch.arange(m - 1, -1, -1)
    return (x * w).sum(-1)


# ------------------------------------------------------------------ model / data

def capture(loaded, ids: torch.Tensor):
    ks, vs = None, None
    for j in range(ids.shape[0]):
        k, v = capture_kv(loaded.model, ids[j:j + 1])
        if ks is None:
            ks, vs = [[t] for t in k], [[t] for t in v]
        else:
            for i in range(len(k)):
                ks[i].append(k[i])
                vs[i].append(v[i])
    return [torch.cat(t, 0) for t in ks], [torch.cat(t, 0) for t in vs]


def settings_for(model: str) -> dict[str, Recipe]:
    out = {"k2v2": Recipe.load("kivi-2"), "k4v4": Recipe.load("kivi-4")}
    if model == "smollm2-135m":
        out["recipe"] = Recipe.load(str(ROOT / "recipes" / "smollm2-135m" / "short-256-3.0b" / "recipe.safetensors"))
    return out


def effective(recipe: Recipe, info, rows: dict, calib_hist: dict, opts: list[str]) -> dict:
    """Effective bits at CONTEXT with every quantized side coded at each option's bits/sym,
    kvcalib's accounting (entropy_memory: payload + index + padding + decode tables), for two
    stream layouts; options with classes add their extra decode tables, class map and lengths."""
    base = strip_codebooks(recipe)
    books = {key: build_codebook(torch.from_numpy(h.astype(np.int64))) for key, h in calib_hist.items()}
    every = _with_books(base, books)
    out = {}
    for tps in (1, 4):
        lay = StreamLayout(tps, 32)
        res = {}
        for opt in opts:
            bps = {key: rows[key][opt] for key in rows}
            mem = entropy_memory(every, info, bps, CONTEXT, lay)
            extra = 0.0
            c = int(opt.split("_C")[-1]) if "_C" in opt else 1
            if opt.endswith("hch"):
                c = None
            if opt.startswith("H_prev"):  # one table per previous symbol
                c = -1
            tup = opt.startswith("huff_m") or opt.startswith("xent_m")
            for s in mem.sides:
                key = (s["layer"], s["side"])
                if tup:  # tuple alphabet: its own C tables replace the order-0 one
                    m = int(opt.split("_m")[1].split("_")[0])
                    ml = rows[key][f"huff_maxlen_m{m}_C{c}"]
                    extra += c * 2 * (1 << ml) - s["table_bytes"] + rows[key][f"sideinfo_bits_m{m}_C{c}"] / 8
                elif c is None:  # one codebook per (head, channel): tables and lengths per unit
                    u = rows[key]["heads"] * rows[key]["head_dim"]
                    extra += (u - 1) * s["table_bytes"] + (u - 1) * (1 << rows[key]["bits"])
                elif c == -1:
                    extra += ((1 << rows[key]["bits"]) - 1) * (s["table_bytes"] + (1 << rows[key]["bits"]))
                elif c > 1:
                    extra += (c - 1) * s["table_bytes"] + rows[key][f"sideinfo_bits_C{c}"] / 8
            coded = (mem.coded.total_bytes + extra) * 8 / mem.coded.elements
            res[opt] = {"uncoded": round(mem.uncoded.effective_bits, 4), "coded": round(coded, 4),
                        "reduction_pct": round(100 * (1 - coded / mem.uncoded.effective_bits), 2)}
            # code bytes alone, vs fixed width
            raw = sum(s["raw_bytes"] for s in mem.sides)
            payload = sum(s["symbols"] * min(s["bits_per_symbol"], s["bits"]) / 8 for s in mem.sides)
            res[opt]["code_bytes_saving_pct_no_index"] = round(100 * (1 - (payload + extra) / raw), 2)
        out[f"tokens_per_stream_{tps}"] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "huffman_context.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    report = {"config": vars(args) | {"alpha": ALPHA, "classes": CLASSES, "context": CONTEXT}, "models": {}}
    for model in args.models.split(","):
        loaded = load_model(model, device="cpu", dtype="fp32")
        info = loaded.info
        tok = loaded.tokenizer
        ids_c = pack_samples(load_texts("embedded", "calib"), tok, args.seq_len, args.windows, 0)
        ids_e = pack_samples(eval_texts("embedded"), tok, args.seq_len, args.windows, 0)
        kc, vc = capture(loaded, ids_c)
        ke, ve = capture(loaded, ids_e)
        print(f"{model}: captured {ids_c.shape} calib + {ids_e.shape} eval in {time.perf_counter() - t0:.0f}s", flush=True)
        mrep = {"info": info.to_dict(), "settings": {}}
        for sname, recipe in settings_for(model).items():
            recipe.check_model(info)
            configs = recipe.layer_configs(info.num_layers)
            codecs = build_codecs(strip_codebooks(recipe), configs, info.head_dim)
            rows, calib_hist, layers = {}, {}, []
            for i, cfg in enumerate(configs):
                for side in SIDES:
                    bits = cfg.k_bits if side == "k" else cfg.v_bits
                    if bits >= 16:
                        continue
                    xc = (kc if side == "k" else vc)[i]
                    xe = (ke if side == "k" else ve)[i]
                    start, n = _packed_span(cfg, xc.shape[2])
                    codes_c = flush_codes(codecs[i], side, xc[:, :, start:start + n])
                    codes_e = flush_codes(codecs[i], side, xe[:, :, start:start + n])
                    r = side_metrics(codes_c, codes_e, bits)
                    r.update(layer=i, side=side, packed_tokens=[start, n])
                    rows[(i, side)] = r
                    calib_hist[(i, side)] = unit_counts(codes_c, 1 << bits).sum(0)
                    layers.append(r)
            opts = ["H0", "huff_C1", "xent_C1", "xent_C4", "xent_C8", "huff_C4", "huff_C8", "xent_hch", "H_hch",
                    "H_prev", "huff_m2_C1", "huff_m2_C4"]
            if all(r["bits"] == 2 for r in rows.values()):
                opts += ["huff_m4_C1", "huff_m4_C4"]
            eff = effective(recipe, info, rows, calib_hist, opts)
            mrep["settings"][sname] = {"layers": layers, "effective_bits": eff}
            print(f"  {sname}: done at {time.perf_counter() - t0:.0f}s", flush=True)
        report["models"][model] = mrep
        del kc, vc, ke, ve, loaded
    report["wall_seconds"] = round(time.perf_counter() - t0, 1)
    report["command"] = " ".join(["python scripts/huffman_context.py", *sys.argv[1:]])
    report = _rounded(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)
    md = out.with_suffix(".md")
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(markdown(report))
    tmp.replace(md)
    summarize(report)
    print(f"wrote {out} and {md}")


SUMMARY_COLS = ["bits", "H0", "H_ch", "H_hch", "xent_C1", "xent_C2", "xent_C4", "xent_C8", "xent_hch",
                "huff_C1", "huff_C4", "huff_C8", "H_prev", "xent_prev", "xent_prev_C4", "H_prevch",
                "H_m2", "huff_m2_C1", "huff_m2_C4", "xent_m2_C4", "H_m4", "huff_m4_C1", "huff_m4_C4", "xent_m4_C4"]


def summarize(report: dict) -> None:
    for model, m in report["models"].items():
        for sname, s in m["settings"].items():
            for bits_filter in sorted({r["bits"] for r in s["layers"]}):
                for side in SIDES:
                    rs = [r for r in s["layers"] if r["side"] == side and r["bits"] == bits_filter]
                    if not rs:
                        continue
                    vals = " ".join(f"{c}={np.mean([r[c] for r in rs]):.3f}" for c in SUMMARY_COLS if c in rs[0])
                    print(f"{model} {sname} {side} ({len(rs)} layers) {vals}")
            for lay, res in s["effective_bits"].items():
                print(f"  {model} {sname} {lay}: " + ", ".join(
                    f"{o}: {v['coded']:.3f}/{v['uncoded']:.3f} ({v['reduction_pct']:.1f}%; code {v['code_bytes_saving_pct_no_index']:.1f}%)"
                    for o, v in res.items()))


def _rounded(x):
    """The report with floats rounded to 5 significant digits (a smaller JSON)."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


MD_COLS = [("bits", "bits"), ("H0", "H0"), ("H_ch", "H given ch"), ("H_hch", "H given head, ch"), ("xent_C1", "C=1"),
           ("xent_C2", "C=2"), ("xent_C4", "C=4"), ("xent_C8", "C=8"), ("huff_C1", "Huffman C=1"),
           ("huff_C8", "Huffman C=8"), ("huff_m2_C1", "Huffman pairs"), ("H_prev", "H given prev token")]
MD_EFF = [("huff_C1", "Huffman (today)"), ("huff_C8", "Huffman, 8 classes"), ("xent_C8", "entropy, 8 classes"),
          ("H_prev", "entropy given prev token")]


def markdown(report: dict) -> str:
    """The tables of the JSON report: mean over layers per model x setting x side, then the
    effective-bit reductions."""
    c = report["config"]
    lines = ["# Context-conditioned entropy of the quantized KV symbols (issue 7's 15% target)", "",
             f"Command: `{report['command']}` ({report['wall_seconds']:.0f} s on this repo's 2-core CPU machine). "
             f"{c['windows']} calibration and {c['windows']} held-out windows of {c['seq_len']} tokens per model; "
             "symbols exactly as the cache stores them (packed span of each window). Settings: `k2v2` / `k4v4` "
             "the KIVI presets, `recipe` the committed SmolLM2 search recipe (its 2-bit layers). Bits per symbol, "
             "mean over layers, held-out split; `C=c`: cross-entropy under c channel classes fit on calibration; "
             "Huffman columns: real code lengths (kvcalib `build_codebook`), no index; `pairs`: two adjacent "
             "channels of a token coded as one symbol (per-symbol bits shown).", "",
             "| model | setting | side | " + " | ".join(h for _, h in MD_COLS) + " |",
             "|---|---|---|" + "---:|" * len(MD_COLS)]
    for model, m in report["models"].items():
        for sname, s in m["settings"].items():
            bits_seen = sorted({r["bits"] for r in s["layers"]})
            for side in SIDES:
                rs = [r for r in s["layers"] if r["side"] == side and r["bits"] == bits_seen[0]]
                if not rs:
                    continue
                vals = [f"{np.mean([r[k] for r in rs]):.3f}" if k in rs[0] else "-" for k, _ in MD_COLS]
                vals[0] = str(rs[0]["bits"])
                lines.append(f"| {model} | {sname} | {side.upper()} | " + " | ".join(vals) + " |")
    lines += ["", "Effective bits at 4096 tokens, every quantized side coded (kvcalib's accounting, all bytes "
              "counted), reduction against the same recipe uncoded, at 1 / 4 tokens per stream:", "",
              "| model | setting | uncoded | " + " | ".join(h for _, h in MD_EFF) + " |",
              "|---|---|---:|" + "---:|" * len(MD_EFF)]
    for model, m in report["models"].items():
        for sname, s in m["settings"].items():
            e1, e4 = s["effective_bits"]["tokens_per_stream_1"], s["effective_bits"]["tokens_per_stream_4"]
            cells = [f"{e1[k]['reduction_pct']:.1f}% / {e4[k]['reduction_pct']:.1f}%" for k, _ in MD_EFF]
            lines.append(f"| {model} | {sname} | {e1['huff_C1']['uncoded']:.3f} | " + " | ".join(cells) + " |")
    two = [r for m in report["models"].values() for st in m["settings"].values() for r in st["layers"]
           if r["bits"] == 2]

    def gain(side, key):  # mean bits/sym saved on 2-bit symbols against order-0
        rs = [r for r in two if r["side"] == side]
        return float(np.mean([r["H0"] - r[key] for r in rs])) if rs else float("nan")

    best = max(((e["reduction_pct"], model, sname, lay, opt)
                for model, m in report["models"].items() for sname, st in m["settings"].items()
                for lay, res in st["effective_bits"].items() for opt, e in res.items()), default=None)
    lines += ["", f"Reading (2-bit symbols, mean over layers and settings): 8 channel classes save "
              f"{gain('k', 'xent_C8'):.3f} bits/sym on keys and {gain('v', 'xent_C8'):.3f} on values against "
              f"order-0; the previous token saves {gain('k', 'H_prev'):.3f} (keys) / {gain('v', 'H_prev'):.3f} "
              "(values) but needs sequential decoding within a stream. Largest effective-bit reduction of any "
              + (f"option here (entropy bounds included): {best[0]:.1f}% ({best[1]} {best[2]}, {best[4]}, {best[3].replace('_', ' ')}), "
                 if best else "option: none measured, ")
              + "against the 15% target: the codes are only part of the effective bits (scales, zeros, the "
              "full-precision window and sinks are the rest).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
