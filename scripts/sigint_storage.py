"""SIGINT at random moments of a study's storage writes, N times: how often recording the
interruption then finds the SQLite write lock still held (the figures of ``docs/reliability.md``).

    PYTHONPATH=. python scripts/sigint_storage.py --reps 300            # kvcalib's handler
    PYTHONPATH=. python scripts/sigint_storage.py --reps 300 --plain    # Python's own handler

Each repetition asks, annotates, reports and tells trials in a loop on a run-folder SQLite study
(kvcalib's storage: ``BEGIN IMMEDIATE`` transactions, here with a 2 s busy timeout instead of
60 s) until a SIGINT, sent 1-30 ms in, lands; then it records the interruption on the trial and
enqueues a trial, as the search does, and times that. A repetition whose recording takes over a
second found the lock held by the transaction the signal cut short (each write waits out the busy
timeout); a repetition that makes no progress for 40 s is reported as stuck and ends the run
(the figures so far, then a stack dump, exit code 1).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--plain", action="store_true", help="keep Python's SIGINT handler (before issue 54)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import optuna

    from kvcalib.optimize.study import _quiet_rdb, _serialize_sqlite, _try_set_attr, defer_interrupts_in_storage_calls

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    folder = Path(tempfile.mkdtemp(prefix="kvcalib-sigint-storage-"))
    storage = _quiet_rdb()(f"sqlite:///{folder / 'study.db'}", engine_kwargs={"connect_args": {"timeout": 2}})
    _serialize_sqlite(storage.engine)
    if not args.plain:
        defer_interrupts_in_storage_calls()
    study = optuna.create_study(storage=storage, study_name="s")
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    rng = random.Random(args.seed)
    figures = {"handler": "python" if args.plain else "kvcalib", "reps": 0, "recording_over_1s": 0,
               "writes_failed": 0, "worst_s": 0.0, "stuck_at_rep": None}
    beat = [time.monotonic()]

    def watchdog() -> None:  # a stuck write: the figures so far and the stack, then exit code 1
        while True:
            time.sleep(1)
            if time.monotonic() - beat[0] > 40:
                figures["stuck_at_rep"] = figures["reps"]
                print(json.dumps(figures), flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(1)

    threading.Thread(target=watchdog, daemon=True).start()
    for rep in range(args.reps):
        beat[0] = time.monotonic()
        trial = None
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.001, 0.03))
        try:
            while True:
                trial = study.ask()
                trial.set_user_attr("a", 1)
                trial.report(0.5, 0)
                study.tell(trial, 1.0)
        except KeyboardInterrupt:
            signal.setitimer(signal.ITIMER_REAL, 0)
        start = time.perf_counter()
        if trial is not None:
            _try_set_attr(trial, "interrupted", True)
        try:
            study.enqueue_trial({})
        except Exception:  # noqa: BLE001  ("database is locked" once the busy timeout ran out)
            figures["writes_failed"] += 1
        took = time.perf_counter() - start
        figures["worst_s"] = round(max(figures["worst_s"], took), 2)
        figures["recording_over_1s"] += took > 1.0
        figures["reps"] += 1
    print(json.dumps(figures), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
