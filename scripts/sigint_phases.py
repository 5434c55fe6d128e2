"""Ctrl-C at every phase of a search, through the real ``kvcalib`` command, N times each: the
figures of ``docs/reliability.md`` (the CI test, ``tests/unit/test_faults.py``, sends one SIGINT
per phase in its own process, to stay cheap).

    PYTHONPATH=. python scripts/sigint_phases.py --runs 20

A tiny llama folder and a text file are made once; each run starts ``kvcalib search`` (through a
driver that prints ``PHASE <name>`` on stderr as the collection, the warm start's sweep and the
final evaluation begin; a trial is marked by the search's own ``search: 1/N`` line), waits for the
phase, waits a random 0-300 ms more (so the signal lands anywhere in it, a study write included),
sends SIGINT and measures how long the process takes to exit. A run passes with exit code 130
within 5 s, one ``kvcalib: error: interrupted; ...`` line naming the command that goes on, and
no traceback.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

DRIVER = textwrap.dedent('''
    import functools, importlib, sys

    def marked(module, name, phase):
        module = importlib.import_module(module)
        fn = getattr(module, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            print(f"PHASE {phase}", file=sys.stderr, flush=True)
            return fn(*args, **kwargs)
        setattr(module, name, wrapper)

    marked("kvcalib.collection", "collect_stats", "collect")
    marked("kvcalib.optimize.study", "sensitivity_sweep", "warm start")
    marked("kvcalib.eval.harness", "evaluate", "final eval")
    sys.argv = ["kvcalib", *sys.argv[1:]]
    from kvcalib.cli import main
    main()
''')
EXIT_S = 5.0


def make_world(root: Path) -> list[str]:
    """A tiny llama folder, a text file and a space file under ``root``; the search arguments."""
    from tests.conftest import corpus_lines, tiny_config, tiny_model, tiny_tokenizer

    tok = tiny_tokenizer.__wrapped__()  # the pytest fixture's function
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    tiny_model("llama", config=cfg).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "text.txt").write_text("\n".join(corpus_lines(3000, seed=1)))
    (root / "space.json").write_text(json.dumps({"bits": [2, 4, 8], "groups": [8], "windows": [8, 16],
                                                 "sinks": [0, 2], "layer_methods": ["clip"]}))
    return ["search", "--model", str(root / "model"), "--data", str(root / "text.txt"), "--samples", "16",
            "--seq-len", "64", "--space", str(root / "space.json"), "--budget-bits", "8", "--context", "256",
            "--device", "cpu", "--trials", "6", "--eval-samples", "2", "--eval-seq-len", "64"]


def interrupt(driver: Path, args: list[str], marker: str, rng: random.Random, env: dict) -> dict:
    proc = subprocess.Popen([sys.executable, str(driver), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines, sent = [], None
    for line in proc.stderr:  # type: ignore[union-attr]
        lines.append(line)
        if sent is None and marker in line:
            time.sleep(rng.uniform(0.0, 0.3))
            sent = time.perf_counter()
            proc.send_signal(signal.SIGINT)
    code = proc.wait()
    took = None if sent is None else time.perf_counter() - sent
    stderr = "".join(lines)
    errors = [x for x in stderr.splitlines() if x.startswith("kvcalib: error:")]
    ok = (sent is not None and code == 130 and took < EXIT_S and "Traceback" not in stderr and len(errors) == 1
          and errors[0].startswith("kvcalib: error: interrupted; ") and " with: kvcalib search " in errors[0])
    return {"ok": ok, "code": code, "seconds": took, "error": errors[-1][:200] if errors else stderr[-300:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="SIGINTs per phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", default="collect,warm start,trials,final eval", help="comma-separated")
    args = parser.parse_args()
    import os

    env = {**os.environ, "KVCALIB_QUIET": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kvcalib-sigint-"))
    try:
        base = make_world(root)
        driver = root / "driver.py"
        driver.write_text(DRIVER)
        # prepared run folders: statistics only (warm start, trials), a finished study (final eval)
        collected, finished = root / "collected", root / "finished"
        subprocess.run([sys.executable, str(driver), *base, "--no-eval", "--out", str(finished)], env=env,
                       check=True, capture_output=True)
        collected.mkdir()
        for name in ("stats.safetensors", "run.json"):
            shutil.copy(finished / name, collected / name)
        phases = {"collect": (None, "PHASE collect", []), "warm start": (collected, "PHASE warm start", []),
                  "trials": (collected, "search: 1/", []),
                  # a longer evaluation than the search's (16 x 256 tokens: about a second here), so
                  # that a signal sent up to 300 ms after it began lands in it, not after the search
                  "final eval": (finished, "PHASE final eval", ["--resume", "--eval-samples", "16",
                                                                "--eval-seq-len", "256"])}
        phases = {k: v for k, v in phases.items() if k in args.phases.split(",")}
        table = {}
        for phase, (start, marker, extra) in phases.items():
            results = []
            for i in range(args.runs):
                out = root / f"run-{phase.replace(' ', '-')}-{i}"
                if start is not None:
                    shutil.copytree(start, out)
                results.append(interrupt(driver, [*base, *extra, "--out", str(out)], marker, rng, env))
                shutil.rmtree(out, ignore_errors=True)
            secs = [r["seconds"] for r in results if r["seconds"] is not None]
            table[phase] = {"runs": len(results), "passed": sum(r["ok"] for r in results),
                            "max_exit_s": round(max(secs), 2) if secs else None,
                            "mean_exit_s": round(sum(secs) / len(secs), 2) if secs else None,
                            "failures": [r for r in results if not r["ok"]][:3]}
            print(json.dumps({phase: table[phase]}), flush=True)
        print(json.dumps(table, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
