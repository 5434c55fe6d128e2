#!/usr/bin/env python3
"""Trials per minute of ``kvcalib search --workers W`` (issue 37), rows into
``artifacts/bench/search_scale.json``: a list of {gpus, workers, trials_per_min, model, gpu,
context, ...}.

On the lent 2-GPU machine (both GPUs visible), from the repository root:

    source scripts/device_env.sh        # wheels (optuna, gguf), KVCALIB_HOME, the SmolLM2 GGUF
    python scripts/search_scale.py --model "${KVCALIB_SCALE_MODEL:-smollm2-135m}" --workers 1,2

Each W runs one ``kvcalib search --workers W --trials T --no-eval`` in a fresh folder: W worker
processes, each pinned to one GPU (``CUDA_VISIBLE_DEVICES``) and loading the model once, on the
run folder's SQLite study. The rate is the study's finished trials over the trial phase's wall
time (first trial started to last trial finished, from ``search.json``: model loading, statistics
and the sensitivity sweep are not in it, so W workers are compared on the part they share). On a
GPU each trial scores ``--score-samples`` windows of ``--score-seq-len`` tokens whose last
``--score-last`` are decode steps (default 4 x 2048 / 512: ~a second a trial on an H100, so the
study's storage round trips stay small beside it). The issue's target: 2 workers on 2 GPUs >= 1.8x
the trials per minute of 1.

A trial's cost depends on the point it samples, and W workers sample other points than one (the
sampler sees another history), so two studies' rates differ by more than the workers do
(``docs/results-search-scale.md``). ``--same-points`` first runs an untimed 1-worker search and then
gives every W exactly its trials (``kvcalib search --points-from``): the rates of the same work,
with every kernel variant those points need compiled by the first pass. ``--repeats R`` times every
W R times, the order reversed every other time (the host's speed drifts between minutes: two
40-trial studies on one machine gave 1.80x and 1.72x), and prints the median ratio. The same
``--run`` again goes on where a call cut short stopped (the reference and every timed run with its
``row.json`` are kept), so a long comparison spans several 10-minute device calls.

On CPU (``--device cpu``) W processes share the same cores: the rows check the code path, they
are no speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

OUT = Path("artifacts/bench/search_scale.json")
# a new row replaces the old one with these (the command too: a repeat with other options or another
# run folder is a row of its own; the rate of one study varies by +-5% from run to run)
KEY = ("gpus", "workers", "model", "gpu", "context", "threads", "command", "repeat")


def trial_phase_rate(doc: dict) -> tuple[float, int, float]:
    """(trials per minute, finished trials, seconds) of a ``search.json`` document."""
    done = [t for t in doc["trials"] if t["state"] in ("COMPLETE", "PRUNED") and t.get("started") and t.get("finished")]
    if not done:
        raise SystemExit("no finished trial with timestamps in search.json")
    start = min(datetime.fromisoformat(t["started"]) for t in done)
    end = max(datetime.fromisoformat(t["finished"]) for t in done)
    seconds = (end - start).total_seconds()
    return 60.0 * len(done) / seconds, len(done), seconds


def trial_stats(doc: dict) -> dict:
    """What the rate depends on besides the workers, from a ``search.json``'s trials: the share of
    the trial phase each worker was running a trial (``occupancy``, the lowest worker's), the
    median complete and pruned trial, how many were pruned, and the slowest trial. A trial's
    cost depends on the point it samples (a group size whose kernels are not compiled yet
    compiles inside the trial: 6-20 s where a trial is 2 s), and two workers sample other points
    than one, so rows of different W are compared on these too (docs/results-search-scale.md)."""
    import statistics

    done = [t for t in doc["trials"] if t["state"] in ("COMPLETE", "PRUNED") and t.get("started") and t.get("finished")]
    start = min(datetime.fromisoformat(t["started"]) for t in done)
    phase = (max(datetime.fromisoformat(t["finished"]) for t in done) - start).total_seconds()
    busy: dict = {}
    for t in done:
        busy[t.get("worker")] = busy.get(t.get("worker"), 0.0) + (t["seconds"] or 0.0)
    complete = [t["seconds"] for t in done if t["state"] == "COMPLETE"]
    pruned = [t["seconds"] for t in done if t["state"] == "PRUNED"]
    return {"occupancy": round(min(busy.values()) / phase, 3) if phase else None,
            "median_complete_s": round(statistics.median(complete), 3) if complete else None,
            "median_pruned_s": round(statistics.median(pruned), 3) if pruned else None,
            "pruned": len(pruned), "slowest_trial_s": round(max(t["seconds"] for t in done), 2)}


def reference_done(folder: Path, trials: int) -> bool:
    """Whether ``folder`` holds a finished reference search of ``trials`` trials (its points, statistics)."""
    try:
        doc = json.loads((folder / "search.json").read_text())
    except (OSError, ValueError):
        return False
    finished = [t for t in doc.get("trials", []) if t.get("state") in ("COMPLETE", "PRUNED")]
    return len(finished) >= trials and (folder / "stats.safetensors").is_file() and (folder / "run.json").is_file()


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def merge_rows(rows: list[dict], path: Path = OUT) -> list[dict]:
    old = json.loads(path.read_text()) if path.is_file() else []
    keys = {tuple(r[k] for k in KEY) for r in rows}
    out = [r for r in old if tuple(r.get(k) for k in KEY) not in keys] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out


def search_cmd(args, device: str, score_samples: int, score_seq_len: int, score_last: int | None, workers: int,
               out: Path) -> list[str]:
    """The ``kvcalib search`` command of one row."""
    return [sys.executable, "-m", "kvcalib.cli", "search", "--model", args.model, "--data", args.data,
            "--budget-bits", "3.0", "--trials", str(args.trials), "--samples", str(args.samples),
            "--seq-len", str(args.seq_len), "--score-samples", str(score_samples),
            "--score-seq-len", str(score_seq_len), "--workers", str(workers), "--device", device, "--no-eval",
            "--out", str(out)] + (["--score-last", str(score_last)] if score_last else [])


def thread_env(args) -> dict:
    """The searches' environment: ``--threads`` host threads per worker for every W (1 worker: its one process)."""
    env = dict(os.environ)
    if args.threads:
        env["KVCALIB_WORKER_THREADS"] = env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVCALIB_SCALE_MODEL", "smollm2-135m"))
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    ap.add_argument("--data", default="embedded", help="calibration text (longtext for scoring windows of 8k+)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--score-samples", type=int, default=None, help="default 4 on GPU, 2 on CPU")
    ap.add_argument("--score-seq-len", type=int, default=None, help="default 2048 on GPU, --seq-len on CPU")
    ap.add_argument("--score-last", type=int, default=None, help="default 512 on GPU, none on CPU")
    ap.add_argument("--threads", type=int, default=None,
                    help="host threads per worker (KVCALIB_WORKER_THREADS and OMP_NUM_THREADS; default: an equal "
                         "share of the cores, all of them for 1 worker)")
    ap.add_argument("--same-points", action="store_true",
                    help="first an untimed 1-worker search (it also compiles every kernel variant its points need), "
                         "then every worker count scores exactly its points (--points-from): rates of the same trials")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time every worker count this many times, the order reversed every other time (this "
                         "host's rate drifts between minutes); the median ratio is printed")
    ap.add_argument("--run", type=Path, default=None, help="folder for the runs (default artifacts/runs/scale-<time>)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    visible = torch.cuda.device_count() if gpu else 0
    score_samples = args.score_samples or (4 if gpu else 2)
    score_seq_len = args.score_seq_len or (2048 if gpu else args.seq_len)
    score_last = args.score_last if args.score_last is not None else (512 if gpu else None)
    run = args.run or Path(f"artifacts/runs/scale-{time.strftime('%Y%m%d-%H%M%S')}")
    rows = []
    reference = run / "reference" if args.same_points else None
    if reference is not None and reference_done(reference, args.trials):
        print(f"reusing the reference search in {reference} (same --run: this call goes on from the last)",
              file=sys.stderr)
    elif reference is not None:  # the points every timed run scores (a trial's cost depends on its point)
        if reference.exists():
            shutil.rmtree(reference)
        cmd = search_cmd(args, device, score_samples, score_seq_len, score_last, 1, reference)
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        if subprocess.run(cmd, env=thread_env(args)).returncode:
            print("the reference search failed", file=sys.stderr)
            return 1
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    counts = [int(x) for x in args.workers.split(",")]
    skipped = [w for w in counts if gpu and w > visible]
    for w in skipped:
        print(f"skipping {w} workers: {visible} GPU(s) visible", file=sys.stderr)
    counts = [w for w in counts if w not in skipped]
    # every other repeat in reverse order, so that a drift of the host's speed weighs on each W alike
    order = [(r, w) for r in range(args.repeats) for w in (counts if r % 2 == 0 else counts[::-1])]
    for repeat, w in order:
        out = run / (f"w{w}" if args.repeats == 1 else f"r{repeat}-w{w}")
        if (out / "row.json").is_file():  # timed by an earlier call with this --run (a device call lasts 10 min)
            rows.append(json.loads((out / "row.json").read_text()))
            print(f"reusing {out}: {rows[-1]['trials_per_min']} trials/min", file=sys.stderr)
            continue
        if out.exists():  # a run cut short: timed again from the start
            shutil.rmtree(out)
        cmd = search_cmd(args, device, score_samples, score_seq_len, score_last, w, out)
        if reference is not None:
            # the reference's statistics and no sweep: the points are the reference's anyway, and the
            # timed part (the trial phase) is the same; this only shortens each run's wall time
            out.mkdir(parents=True)
            for name in ("stats.safetensors", "run.json"):
                shutil.copy2(reference / name, out / name)
            cmd += ["--points-from", str(reference), "--no-sweep"]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=thread_env(args))
        wall = time.perf_counter() - t0
        if done.returncode:
            print(f"{w} workers: the search failed ({done.returncode})", file=sys.stderr)
            return done.returncode
        folder = out if w == 1 else out / "worker-0"
        doc = json.loads((folder / "search.json").read_text())
        rate, n, seconds = trial_phase_rate(doc)
        chosen = next((t for t in doc["trials"] if t["number"] == doc["chosen"]), None)
        rows.append({"gpus": min(w, visible) if gpu else 0, "workers": w, "trials_per_min": round(rate, 2),
                     "model": args.model if not args.model.endswith(".gguf") else Path(args.model).name,
                     "gpu": device_name(device), "context": score_seq_len, "data": args.data, "score_last": score_last,
                     "score_samples": score_samples, "threads": args.threads, "same_points": args.same_points,
                     "repeat": repeat if args.repeats > 1 else None, "trials": n, "trial_phase_seconds": round(seconds, 1),
                     "wall_seconds": round(wall, 1), "workers_seen": len({t["worker"] for t in doc["trials"] if t.get("worker")}),
                     # same seed and budget for every W: where the searches' results differ (docs/search-at-scale.md)
                     "chosen_kl": chosen["kl"] if chosen else None,
                     "chosen_bits": chosen["effective_bits"] if chosen else None,
                     "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                     "command": "python scripts/search_scale.py " + " ".join(sys.argv[1:]), **trial_stats(doc)})
        print(json.dumps(rows[-1]), flush=True)
        (out / "row.json").write_text(json.dumps(rows[-1]) + "\n")
        merge_rows(rows[-1:], args.out)  # each row kept as soon as it is timed: a call cut short loses none
    for line in ratio_lines(rows):
        print(line)
    return 0


def ratio_lines(rows: list[dict]) -> list[str]:
    """Per worker count W > 1: its rate over 1 worker's in each repeat, and their median."""
    import statistics

    by = {(r["repeat"], r["workers"]): r for r in rows}
    out = []
    for w in sorted({r["workers"] for r in rows} - {1}):
        pairs = [(by[(rep, w)], by[(rep, 1)]) for rep in sorted({r["repeat"] for r in rows}, key=str)
                 if (rep, w) in by and (rep, 1) in by]
        if not pairs:
            continue
        ratios = [a["trials_per_min"] / b["trials_per_min"] for a, b in pairs]
        each = ", ".join(f"{x:.2f}x ({a['trials_per_min']} vs {b['trials_per_min']})" for x, (a, b) in zip(ratios, pairs))
        out.append(f"{w} workers / {pairs[0][0]['gpus']} GPUs: median {statistics.median(ratios):.2f}x the trials per "
                   f"minute of 1 over {len(ratios)} repeat(s): {each}")
    return out


if __name__ == "__main__":
    sys.exit(main())
