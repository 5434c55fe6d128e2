"""``kvcalib search --workers N``: N worker processes on one study, from one command.

One worker per GPU is how a search uses a machine with several: each worker is a process pinned to
one device (``CUDA_VISIBLE_DEVICES``), loads the model once and runs trials of the shared study
until the study holds its budget (:mod:`.study`: heartbeats, retries of a dead worker's trial, the
warm start run once). ``--workers auto`` starts one per visible GPU (1 on a machine without CUDA:
the plain in-process search); on CPU ``--workers N`` starts N processes with ``cores // N`` torch
threads each -- the same cores shared, so no faster (a check of the code path, not a speedup).

Layout of the run folder ``RUN``:

- ``RUN/study.db``: the shared study (SQLite; ``--storage URL`` names another, e.g. PostgreSQL);
- ``RUN/workers.json``: the configuration every worker runs, the storage and the devices;
- ``RUN/worker-I/``: worker I's run folder, a complete ``kvcalib search`` run folder: statistics
  (worker 0 collects them, the others wait and copy them, so every worker scores the same
  objective), ``search.json`` (the same trials in every folder: each worker waits for the study to
  fall quiet before it writes), ``recipe.safetensors``, ``report.md``; the held-out proof in
  worker 0's only. ``kvcalib export RUN/worker-I --budget-bits B`` works from any of them.

A worker is ``python -m kvcalib.optimize.workers RUN/workers.json I``. A worker that fails leaves
the others running (the study keeps going); the command then names it, and the same command with
``--resume`` starts it again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from kvcalib.errors import KvcalibError

SPEC = "workers.json"
STATS_FILES = ("stats.safetensors", "run.json")  # what worker 0 collects and the others copy


def visible_gpus(device: str | None = None) -> list[str]:
    """The CUDA devices a worker can be pinned to, as ``CUDA_VISIBLE_DEVICES`` entries: those the
    variable lists when set, else ``0 .. count-1``; none for ``device="cpu"`` or without CUDA."""
    if device is not None and not device.startswith("cuda"):
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def resolve_workers(workers: int | str, gpus: Sequence[str]) -> int:
    """``auto``: one worker per visible GPU, 1 without any; an integer as given."""
    if workers == "auto":
        return max(1, len(gpus))
    return int(workers)


def worker_dir(run: Path, index: int) -> Path:
    return Path(run) / f"worker-{index}"


def config_to_json(config) -> dict[str, Any]:
    """A :class:`~kvcalib.optimize.SearchConfig` as JSON a worker rebuilds it from (paths whole,
    unlike ``SearchConfig.to_dict``, which records them for people)."""
    out = asdict(config)
    out["space"] = config.space.to_dict()
    out["out"] = str(config.out) if config.out is not None else None
    out["presets"] = list(config.presets)
    out["chosen_methods"] = list(config.chosen_methods) if config.chosen_methods is not None else None
    return out


def config_from_json(doc: dict[str, Any]):
    from kvcalib.optimize import SearchConfig

    doc = dict(doc)
    if doc.get("chosen_methods") is not None:
        doc["chosen_methods"] = tuple(doc["chosen_methods"])
    doc["presets"] = tuple(doc.get("presets", ()))
    return SearchConfig(**doc)


def worker_env(index: int, gpus: Sequence[str], n: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Worker ``index``'s environment: pinned to GPU ``index`` (round robin when there are more
    workers than GPUs), and ``cores // n`` host threads (torch and OpenMP; ``KVCALIB_WORKER_THREADS``
    or ``OMP_NUM_THREADS`` set in the environment win) on GPU and CPU alike:
    each process's thread pool sized for the whole machine made two GPU workers on a 32-core host
    wait on each other (the first trials 100 s against 9 s alone, 2x H200)."""
    env = dict(os.environ if base is None else base)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    # a KVCALIB_WORKER_THREADS the user set (threads per worker) is kept, like their OMP_NUM_THREADS
    threads = env.get("KVCALIB_WORKER_THREADS", "").strip() or str(max(1, (os.cpu_count() or 1) // n))
    if not threads.isdigit() or int(threads) < 1:
        raise KvcalibError(f"KVCALIB_WORKER_THREADS={threads!r} is not a number of threads: set it to a whole "
                           "number >= 1 (host threads per worker), or unset it for an equal share of the cores")
    env["KVCALIB_WORKER_THREADS"] = threads
    env.setdefault("OMP_NUM_THREADS", threads)
    if index > 0:
        env["KVCALIB_QUIET"] = "1"  # one progress line on the terminal: worker 0's
    return env


def search_any(config, *, progress: bool = True):
    """``kvcalib search`` with ``config.workers`` as given: several processes sharing one study
    (:func:`search_workers`), or this process alone (``auto`` without a GPU, or 1)."""
    from kvcalib.optimize import search

    if config.workers != 1 and resolve_workers(config.workers, visible_gpus(config.device)) > 1:
        return search_workers(config, progress=progress)
    config.workers = 1  # auto without a GPU: this process is the one worker
    return search(config, progress=progress)


def search_workers(config, *, progress: bool = True):
    """Run ``config`` as ``config.workers`` processes sharing one study; the
    :class:`~kvcalib.optimize.SearchResult` of the first worker that finished (worker 0's)."""
    from kvcalib.optimize import result_from_doc

    gpus = visible_gpus(config.device)
    n = resolve_workers(config.workers, gpus)
    if config.out is None:
        from kvcalib.paths import default_run_dir

        config.out = default_run_dir("search")
    run = Path(config.out)
    if gpus and n > len(gpus):
        print(f"kvcalib: note: {n} workers on {len(gpus)} GPU(s): workers share GPUs round robin", file=sys.stderr)
    started = worker_dir(run, 0).exists() or (run / "study.db").exists()
    if started and not config.resume:
        raise KvcalibError(f"{run} already holds a search: pass --resume to continue it, or another --out.")
    if config.resume and not (worker_dir(run, 0) / "stats.safetensors").is_file():
        raise KvcalibError(f"nothing to resume in {run}: it holds no {worker_dir(run, 0).name}/stats.safetensors.")
    run.mkdir(parents=True, exist_ok=True)
    storage = config.storage or f"sqlite:///{run.resolve() / 'study.db'}"
    from kvcalib.optimize.study import probed_storage

    with probed_storage(storage):  # an unreachable storage fails here, before any worker starts
        pass
    spec = {"config": config_to_json(config), "storage": storage, "workers": n, "gpus": list(gpus)}
    from kvcalib.io import write_json_atomic

    write_json_atomic(run / SPEC, spec)
    procs = [subprocess.Popen([sys.executable, "-m", "kvcalib.optimize.workers", str(run / SPEC), str(i)],
                              env=worker_env(i, gpus, n)) for i in range(n)]
    try:
        codes = _wait(procs, run)
    except KeyboardInterrupt:
        for p in procs:  # the terminal sent SIGINT to every worker too; they record and stop
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    ok = [i for i, c in enumerate(codes) if c == 0]
    failed = [f"worker {i} ({_code(c)})" for i, c in enumerate(codes) if c != 0]
    if not ok:
        raise KvcalibError(f"every worker failed ({', '.join(failed)}; their messages are above): the study keeps "
                           f"every finished trial; run the same command with --resume to go on.")
    if failed:
        print(f"kvcalib: warning: {', '.join(failed)} stopped (messages above); the others finished the study. "
              f"Results from {worker_dir(run, ok[0])}.", file=sys.stderr)
    doc = json.loads((worker_dir(run, ok[0]) / "search.json").read_text())
    return result_from_doc(doc, worker_dir(run, ok[0]))


def _code(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _wait(procs: list[subprocess.Popen], run: Path, poll: float = 0.5) -> list[int]:
    """Wait for every worker. When worker 0 fails before its statistics exist, the others (waiting
    for them) are stopped: nothing could start them."""
    stats = worker_dir(run, 0) / "run.json"
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]  # type: ignore[arg-type]
        if codes[0] not in (None, 0) and not stats.is_file():
            for p in procs[1:]:
                if p.poll() is None:
                    p.terminate()
        time.sleep(poll)


# ------------------------------------------------------------------ one worker (a child process)
def wait_for_stats(source: Path, dest: Path, timeout: float | None = None, poll: float = 0.5) -> None:
    """Copy worker 0's statistics into ``dest`` once its collection is complete (``collect``
    renames a finished folder into place, so ``run.json`` present means both files are whole)."""
    t0 = time.monotonic()
    while not (source / "run.json").is_file():
        if timeout is not None and time.monotonic() - t0 > timeout:
            raise KvcalibError(f"worker 0 wrote no statistics into {source} within {timeout:.0f} s.")
        time.sleep(poll)
    dest.mkdir(parents=True, exist_ok=True)
    for name in STATS_FILES:
        shutil.copy2(source / name, dest / name)


def run_worker(spec_path: Path, index: int) -> int:
    """Worker ``index`` of the spec: load the model, (worker 0) collect or (others) wait for and
    copy the statistics, then search the shared study. Returns the exit code."""
    from kvcalib.models import load_model
    from kvcalib.optimize import search

    spec = json.loads(Path(spec_path).read_text())
    config = config_from_json(spec["config"])
    run = Path(spec_path).parent
    threads = os.environ.get("KVCALIB_WORKER_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    config.workers = 1
    config.storage = spec["storage"]
    config.out = worker_dir(run, index)
    config.eval = config.eval and index == 0
    loaded = load_model(config.model, device=config.device, dtype=config.dtype)
    if index > 0 and not (config.out / "stats.safetensors").is_file():
        wait_for_stats(worker_dir(run, 0), config.out)
    search(config, loaded=loaded, progress=index == 0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m kvcalib.optimize.workers RUN/workers.json INDEX", file=sys.stderr)
        return 2
    index = int(args[1])
    try:
        return run_worker(Path(args[0]), index)
    except KvcalibError as err:
        print(f"kvcalib: error: worker {index}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvcalib: worker {index} interrupted; the study keeps every finished trial.", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
