"""Benchmark: the split merge alone (``kvcalib_kernels.decode.combine._combine``: what the launcher
picks, beside 27 choices of partials per step, channels per program and warps) at the (rows,
partials, head_dim) the grid's shapes produce, CUDA-graph time with the partials in L2 (as after
the split kernel). Writes ``combine_sweep.json``.

    python -m benchmarks.combine --out artifacts/bench     (CUDA, repository root)
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import _write_json, device_info, graph_ms_per_call, log, main_with_out

COMBINE_SHAPES = ((12, 130, 128), (12, 258, 128), (12, 530, 128), (12, 1026, 128), (32, 132, 128), (32, 258, 128),
                  (32, 530, 128), (9, 354, 64), (72, 46, 64), (96, 130, 128), (96, 34, 128), (256, 18, 128),
                  (256, 10, 128), (288, 14, 64), (1024, 6, 128), (384, 44, 128))


def main_combine(args) -> None:
    """CUDA-graph time of the split merge per (rows, partials, head_dim) of ``COMBINE_SHAPES``:
    the launcher's choice (``_combine``) and each (partials per step cap, channels per program,
    warps) of a 3 x 3 x 3 grid, checked against the launcher's output. Writes ``combine_sweep.json``."""
    import itertools

    import triton

    from kvcalib_kernels.decode.combine import _combine, _combine_kernel

    dev = torch.device("cuda")
    rows_out = []
    for rows, s_tot, d in COMBINE_SHAPES:
        m = torch.randn(rows, s_tot, device=dev)  # (ROWS, S)
        l = torch.rand(rows, s_tot, device=dev) + 0.5  # (ROWS, S)
        o = torch.randn(rows, s_tot, d, device=dev)  # (ROWS, S, D)
        out = torch.empty(rows, 1, d, device=dev, dtype=torch.bfloat16)  # (ROWS, 1, D)
        _combine(m, l, o, s_tot, out)
        ref = out.float().clone()
        row = {"rows": rows, "partials": s_tot, "head_dim": d,
               "launcher_us": 1e3 * graph_ms_per_call([lambda: _combine(m, l, o, s_tot, out)] * 20, rep=30), "us": {}}
        for cap, db, warps in itertools.product((64, 128, 256), (8, 16, 32), (1, 2, 4)):
            sb = min(cap, max(16, triton.next_power_of_2(s_tot)))

            def fn(sb=sb, db=db, warps=warps):
                _combine_kernel[(rows, d // db)](m, l, o, s_tot, out, out, D=d, DB=db, S_BLOCK=sb, num_warps=warps)
            fn()
            torch.cuda.synchronize()
            if float((out.float() - ref).abs().max()) > 1e-2:
                raise RuntimeError(f"combine {cap}/{db}/{warps} disagrees with the launcher's at {rows} x {s_tot}")
            row["us"][f"{cap}/{db}/{warps}"] = 1e3 * graph_ms_per_call([fn] * 20, rep=30)
        best = min(row["us"], key=row["us"].get)
        log(f"  rows {rows:5d} partials {s_tot:5d} d {d}: launcher {row['launcher_us']:.2f} us, "
            f"best {row['us'][best]:.2f} us ({best}: step cap / channels / warps)")
        rows_out.append(row)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "combine_sweep.json", {
        "rows": rows_out, "gpu": device_info(),
        "command": "python -m benchmarks.combine --out artifacts/bench"})


def main(argv=None) -> None:
    main_with_out(main_combine, __doc__, argv)


if __name__ == "__main__":
    main()
