"""Faults mid-search, through the real ``kvcalib`` command (issue 36): Ctrl-C (SIGINT) and kill -9
lose no finished trial and resume with the command the message names; a study storage that breaks
or vanishes mid-search, and a disk that fills up (a small tmpfs, where this machine lets a test
mount one in a private mount namespace), end in one line and exit code 2, never a traceback;
so does a disk that fills just before ``collect``, ``export`` or ``eval`` write their outputs
(a real tmpfs where one can be mounted, and a writer that fails mid-write where not). Ctrl-C at
each phase of a search (collection, warm start, trials, final evaluation) exits 130 in seconds.

A tiny llama saved as a local model folder, a text file and a statistics folder collected once
are shared; each search runs a few trials of a few seconds in a subprocess.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import corpus_lines, tiny_config, tiny_model

KVCALIB = str(Path(sys.executable).with_name("kvcalib"))
SPACE = {"bits": [2, 4, 8], "groups": [8], "windows": [8, 16], "sinks": [0, 2], "layer_methods": ["clip"]}
TRIALS = 6
ENV = {**os.environ, "KVCALIB_QUIET": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer):
    """(base search arguments without --out, a collected statistics folder, root)."""
    root = tmp_path_factory.mktemp("faults")
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tiny_tokenizer)
    tiny_model("llama", config=cfg).save_pretrained(root / "model")
    tiny_tokenizer.save_pretrained(root / "model")
    (root / "text.txt").write_text("\n".join(corpus_lines(3000, seed=1)))
    (root / "space.json").write_text(json.dumps(SPACE))
    base = [KVCALIB, "search", "--model", str(root / "model"), "--data", str(root / "text.txt"), "--samples", "4",
            "--seq-len", "64", "--space", str(root / "space.json"), "--budget-bits", "8", "--context", "256",
            "--no-eval", "--device", "cpu", "--trials", str(TRIALS)]
    collected = root / "collected"
    done = subprocess.run([KVCALIB, "collect", "--model", str(root / "model"), "--data", str(root / "text.txt"),
                           "--samples", "4", "--seq-len", "64", "--block-len", "32", "--reservoir-blocks", "8",
                           "--device", "cpu", "--out", str(collected)], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return base, collected, root


class Running:
    """A ``kvcalib`` subprocess whose stderr lines are read by a thread (so waiting can time out)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"exited before {text!r}:\n{''.join(self.stderr)[-3000:]}")
            if text in line:
                return
        raise AssertionError(f"no {text!r} within {timeout} s:\n{''.join(self.stderr)[-3000:]}")

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        while self.lines.get(timeout=10) is not None:
            pass
        return code, "".join(self.stderr)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kvcalib: error:")]


def _trials(db: Path) -> dict[int, tuple[str, float | None]]:
    """number -> (state, value) of every trial in an Optuna SQLite study file."""
    with sqlite3.connect(db) as con:
        rows = con.execute("select t.number, t.state, v.value from trials t left join trial_values v "
                           "on v.trial_id = t.trial_id").fetchall()
    return {n: (state, value) for n, state, value in rows}


def _complete(db: Path) -> dict[int, float]:
    return {n: v for n, (state, v) in _trials(db).items() if state == "COMPLETE"}


def _resume_command(stderr: str) -> list[str]:
    line = _error_lines(stderr)[-1]
    command = shlex.split(line.split(" with: ", 1)[1])
    assert command[:2] == ["kvcalib", "search"] and "--resume" in command and "--out" in command, command
    return [KVCALIB, *command[1:]]


def _wait_running(db: Path, complete: int, timeout: float = 300) -> None:
    """Until ``db`` holds ``complete`` finished (complete or pruned) trials and one running (a kill now
    lands mid-trial)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            trials = _trials(db)
        except sqlite3.Error:  # the writer holds a lock: read again
            trials = {}
        states = [s for s, _ in trials.values()]
        if states.count("COMPLETE") + states.count("PRUNED") >= complete and "RUNNING" in states:
            return
        time.sleep(0.05)
    raise AssertionError(f"no running trial after {complete} complete ones within {timeout} s")


def test_sigint_mid_search_prints_the_command_that_resumes_it(world, tmp_path):
    base, collected, _ = world
    out = shutil.copytree(collected, tmp_path / "run")
    run = Running([*base, "--out", str(out)])
    run.wait_for(f"search: 2/{TRIALS}")
    run.proc.send_signal(signal.SIGINT)
    code, stderr = run.finish()
    assert code == 130, stderr
    assert "Traceback" not in stderr
    errors = _error_lines(stderr)
    assert len(errors) == 1 and "interrupted; the study keeps every finished trial" in errors[0], stderr
    kept = _complete(out / "study.db")
    assert len(kept) >= 2
    resumed = subprocess.run(_resume_command(stderr), env=ENV, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    after = _complete(out / "study.db")
    assert len(after) >= TRIALS and all(after[n] == kl for n, kl in kept.items())
    assert json.loads((out / "search.json").read_text())["chosen"] is not None


# ------------------------------------------------------------------ Ctrl-C at every phase
SIGINT_EXIT_S = 5.0  # the promise: Ctrl-C ends a search within seconds, whatever it was doing


class SigintAt:
    """Send this process a real SIGINT from inside one phase of a search, mid-work: at the
    ``nth`` call of a function the phase calls repeatedly (the Python handler then raises where
    the work is, as a terminal's Ctrl-C would)."""

    def __init__(self, monkeypatch, owner: Any, name: str, nth: int) -> None:
        self.calls, self.sent, self.nth = 0, None, nth
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            if self.calls == self.nth:
                self.sent = time.perf_counter()
                os.kill(os.getpid(), signal.SIGINT)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


def _interrupted_in_process(args: list[str], at: SigintAt) -> str:
    """``kvcalib ARGS`` in this process with ``at`` armed: exit code 130 within
    :data:`SIGINT_EXIT_S` of the signal, one error line saying so, no traceback; returns stderr."""
    from typer.testing import CliRunner

    from kvcalib.cli import app

    result = CliRunner().invoke(app, args)
    took = time.perf_counter() - at.sent if at.sent is not None else None
    assert at.sent is not None, f"the phase never called {at.nth} times: {result.stderr[-2000:]}"
    assert result.exit_code == 130 and took < SIGINT_EXIT_S, (result.exit_code, took, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and errors[0].startswith("kvcalib: error: interrupted; "), errors
    return result.stderr


def _printed_args(stderr: str) -> list[str]:
    """The arguments of the command an interrupted search's error line names."""
    command = shlex.split(_error_lines(stderr)[-1].split(" with: ", 1)[1])
    assert command[:2] == ["kvcalib", "search"], command
    return command[1:]


def test_sigint_at_every_phase_exits_130_and_the_printed_command_goes_on(world, tmp_path, monkeypatch):
    """A real SIGINT mid-collection, mid-warm-start (the sensitivity sweep), mid-trial and mid-final
    evaluation: each exits 130 within seconds with one line, and the command it prints, run as
    printed, goes on from what was kept; the last one finishes the search. (In this process, so
    it costs seconds; the subprocess test above does it through the real command for a trial.)"""
    from kvcalib.collection import Recorder
    from kvcalib.eval import harness
    from kvcalib.optimize.objective import SearchObjective

    monkeypatch.setenv("KVCALIB_QUIET", "1")
    previous = signal.getsignal(signal.SIGINT)
    base, _, _ = world
    out = tmp_path / "run"
    args = [*[a for a in base[1:] if a != "--no-eval"], "--eval-samples", "2", "--eval-seq-len", "64",
            "--out", str(out)]
    try:
        with monkeypatch.context() as m:  # the 2nd layer of the 1st batch: mid-collection
            stderr = _interrupted_in_process(args, SigintAt(m, Recorder, "observe", 2))
        assert "nothing was written; run it again with: " in stderr and not out.exists(), stderr[-2000:]
        args = _printed_args(stderr)
        assert "--resume" not in args
        with monkeypatch.context() as m:  # the sweep's 2nd layer
            stderr = _interrupted_in_process(args, SigintAt(m, SearchObjective, "kl_configs", 2))
        assert "the study keeps every finished trial" in stderr, stderr[-2000:]
        args = _printed_args(stderr)
        assert "--resume" in args
        with monkeypatch.context() as m:  # the 3rd trial
            stderr = _interrupted_in_process(args, SigintAt(m, SearchObjective, "parts", 3))
        kept = _complete(out / "study.db")
        assert len(kept) >= 2 and _printed_args(stderr) == args
        with monkeypatch.context() as m:  # the first recipe scored after the full-precision baseline
            stderr = _interrupted_in_process(args, SigintAt(m, harness, "_score_recipe", 1))
        assert _printed_args(stderr) == args and len(_complete(out / "study.db")) >= TRIALS
        from typer.testing import CliRunner

        from kvcalib.cli import app

        done = CliRunner().invoke(app, args)
        assert done.exit_code == 0, done.stderr[-3000:]
    finally:
        signal.signal(signal.SIGINT, previous)
    doc = json.loads((out / "search.json").read_text())
    assert doc["chosen"] is not None and doc["held_out"]
    assert all(_complete(out / "study.db")[n] == kl for n, kl in kept.items())


def test_a_storage_call_cut_by_ctrl_c_finishes_before_the_interrupt(tmp_path):
    """SIGINT inside a study write (right after SQLite's BEGIN IMMEDIATE took the write lock) is
    raised when the write returns: the write is committed and the lock released, so recording the
    interruption next does not wait out the busy timeout (it did: "database is locked" after 242 s)."""
    import optuna
    from sqlalchemy import event

    from kvcalib.optimize import study as st

    db = tmp_path / "s.db"
    previous = signal.getsignal(signal.SIGINT)
    try:
        storage = st.open_storage(f"sqlite:///{db}")
        study = optuna.create_study(storage=storage, study_name="s")
        trial = study.ask()
        fired: list[int] = []

        def interrupt_once(connection) -> None:
            if not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGINT)

        event.listen(storage.engine, "begin", interrupt_once)
        with pytest.raises(KeyboardInterrupt):
            trial.set_user_attr("written", True)
        event.remove(storage.engine, "begin", interrupt_once)
        assert fired and storage.get_trial_user_attrs(trial._trial_id) == {"written": True}
        other = sqlite3.connect(db, timeout=0.5)  # another writer gets the lock at once
        other.execute("BEGIN IMMEDIATE")
        other.rollback()
        other.close()
        start = time.perf_counter()
        trial.set_user_attr("interrupted", True)
        assert time.perf_counter() - start < 1.0
    finally:
        signal.signal(signal.SIGINT, previous)


def test_kill_9_mid_trial_loses_no_finished_trial(world, tmp_path):
    base, collected, _ = world
    out = shutil.copytree(collected, tmp_path / "run")
    # a trial budget the search cannot finish before the kill: with TRIALS, fast trials could all
    # end before a running one is seen (it happened in full CI runs); the resume asks for TRIALS
    # (the trial count is no part of the study's objective)
    long = [*base[:-1], "40"]
    assert base[-2] == "--trials"
    run = Running([*long, "--out", str(out)])
    run.wait_for("search: 2/40")
    _wait_running(out / "study.db", 2)
    run.proc.kill()
    code, _ = run.finish()
    assert code == -signal.SIGKILL
    before = _trials(out / "study.db")
    kept = {n: v for n, (s, v) in before.items() if s == "COMPLETE"}
    killed = [n for n, (s, _) in before.items() if s == "RUNNING"]
    finished = [n for n, (s, _) in before.items() if s in ("COMPLETE", "PRUNED")]
    assert len(finished) >= 2 and len(killed) == 1
    resumed = subprocess.run([*base, "--out", str(out), "--resume"], env=ENV, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    after = _complete(out / "study.db")
    assert all(after[n] == kl for n, kl in kept.items())
    doc = json.loads((out / "search.json").read_text())
    assert killed[0] in doc["recovered"]  # the killed trial's point ran again


def test_a_journal_storage_that_vanishes_mid_search_is_one_line(world, tmp_path):
    base, collected, _ = world
    out = shutil.copytree(collected, tmp_path / "run")
    journal = tmp_path / "shared" / "study.log"
    journal.parent.mkdir()
    run = Running([*base, "--out", str(out), "--storage", f"journal:{journal}"])
    run.wait_for(f"search: 2/{TRIALS}")
    journal.unlink()
    code, stderr = run.finish()
    assert code == 2, stderr
    assert "Traceback" not in stderr
    errors = _error_lines(stderr)
    assert len(errors) == 1 and str(journal) in errors[0] and "--resume" in errors[0], stderr


def test_a_sqlite_study_broken_mid_search_is_one_line(world, tmp_path):
    base, collected, _ = world
    out = shutil.copytree(collected, tmp_path / "run")
    run = Running([*base, "--out", str(out)])
    run.wait_for(f"search: 2/{TRIALS}")
    db = out / "study.db"
    with open(db, "r+b") as fh:  # garbage over the file in place (the open connection keeps its inode)
        fh.write(b"\xff" * db.stat().st_size)
    code, stderr = run.finish()
    assert code == 2, stderr
    assert "Traceback" not in stderr
    errors = _error_lines(stderr)
    assert len(errors) == 1 and "the study storage failed" in errors[0], stderr


# ------------------------------------------------------------------ a full disk
FILL = textwrap.dedent('''
    def fill(path):
        """Fill the disk holding ``path`` to the last byte (a file written until ENOSPC)."""
        with open(path, "wb") as fh:
            try:
                while True:
                    fh.write(b"\\0" * (1 << 16))
                    fh.flush()
            except OSError:
                pass
''')
DRIVER = FILL + textwrap.dedent('''
    """Runs inside `unshare -m`: the tmpfs mounts are private to this process and vanish with it."""
    import json, os, shlex, subprocess, sys, time

    args = json.load(open(sys.argv[1]))
    mnt, kvcalib, collected, search = args["mnt"], args["kvcalib"], args["collected"], args["search"]
    env = dict(os.environ)
    out = {}

    def mount(size):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], check=True)

    # 1. a disk too small for what collect writes: refused before the model loads
    mount("256k")
    done = subprocess.run([*args["collect"], "--out", f"{mnt}/run"], env=env, capture_output=True, text=True)
    out["small"] = {"code": done.returncode, "stderr": done.stderr, "left": os.listdir(mnt)}
    subprocess.run(["umount", mnt], check=True)

    # 2. a disk that fills up mid-search: one line, then the search resumes once there is room
    mount("40m")
    run_dir = f"{mnt}/run"
    subprocess.run(["cp", "-r", collected, run_dir], check=True)
    proc = subprocess.Popen([*search, "--out", run_dir], env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "search: 2/" in line:
            fill(f"{mnt}/filler")
            break
    lines.append(proc.stderr.read())
    out["full"] = {"code": proc.wait(), "stderr": "".join(lines)}
    os.unlink(f"{mnt}/filler")
    errors = [l for l in out["full"]["stderr"].splitlines() if l.startswith("kvcalib: error:")]
    if errors and " with: " in errors[-1]:
        command = shlex.split(errors[-1].split(" with: ", 1)[1])
        again = subprocess.run([kvcalib, *command[1:]], env=env, capture_output=True, text=True)
        out["resumed"] = {"code": again.returncode, "stderr": again.stderr[-3000:],
                          "search": json.load(open(f"{run_dir}/search.json")) if again.returncode == 0 else None}
    subprocess.run(["umount", mnt], check=True)
    json.dump(out, open(args["results"], "w"))
''')


def _can_mount_tmpfs(tmp_path: Path) -> str | None:
    """None when ``unshare -m`` and a tmpfs mount work here, else why not."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "no unshare/mount on this machine"
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=64k",
                           "tmpfs", str(probe)], capture_output=True, text=True)
    return None if done.returncode == 0 else f"cannot mount a tmpfs here: {done.stderr.strip()}"


def test_a_full_disk_is_one_line_and_the_search_resumes(world, tmp_path):
    why = _can_mount_tmpfs(tmp_path)
    if why:
        pytest.skip(why)
    base, collected, root = world
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    results = tmp_path / "results.json"
    args = tmp_path / "args.json"
    args.write_text(json.dumps({
        "mnt": str(mnt), "results": str(results), "kvcalib": KVCALIB, "collected": str(collected), "search": base,
        "collect": [KVCALIB, "collect", "--model", str(root / "model"), "--data", str(root / "text.txt"),
                    "--device", "cpu"]}))
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, str(driver), str(args)],
                          env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(results.read_text())
    small = res["small"]
    assert small["code"] == 2 and small["left"] == [], small
    assert _error_lines(small["stderr"]) == small["stderr"].splitlines() and "free" in small["stderr"], small
    full = res["full"]
    assert full["code"] == 2 and "Traceback" not in full["stderr"], full["stderr"][-3000:]
    errors = _error_lines(full["stderr"])
    assert len(errors) == 1 and ("no space left" in errors[0] or "disk is full" in errors[0]), errors
    assert res["resumed"]["code"] == 0, res["resumed"]["stderr"]
    assert res["resumed"]["search"]["chosen"] is not None


FILL_BEFORE_WRITE = textwrap.dedent('''
    """`kvcalib ARGS...` whose output write (WHAT: kvcalib.stats.CollectedStats.save, kvcalib.recipe.Recipe.save
    or kvcalib.eval.harness.write_json) first says FULL-ME on stderr and waits for FLAG: the test fills
    the disk in between, so the write meets a disk that filled mid-run."""
    import functools, importlib, os, sys, time

    what, flag = sys.argv[1], sys.argv[2]
    module_name, _, attr = what.rpartition(".")
    try:
        owner = importlib.import_module(module_name)
    except ImportError:  # a class: module.Class.method
        module_name, _, cls = module_name.rpartition(".")
        owner = getattr(importlib.import_module(module_name), cls)
    original = getattr(owner, attr)

    @functools.wraps(original)
    def after_the_disk_fills(*args, **kwargs):
        print("FULL-ME", file=sys.stderr, flush=True)
        while not os.path.exists(flag):
            time.sleep(0.05)
        return original(*args, **kwargs)
    setattr(owner, attr, after_the_disk_fills)
    sys.argv = ["kvcalib", *sys.argv[3:]]
    from kvcalib.cli import main
    main()
''')

MID_WRITE_DRIVER = FILL + textwrap.dedent('''
    """Runs inside `unshare -m`: for each command, a fresh 16 MiB tmpfs, filled to the last byte by
    this process when the command is about to write its output."""
    import json, os, subprocess, sys

    args = json.load(open(sys.argv[1]))
    mnt, out = args["mnt"], {}
    for name, command in args["commands"].items():
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mnt], check=True)
        flag = f"{args['flags']}/{name}"
        proc = subprocess.Popen([sys.executable, args["hook"], command["what"], flag, *command["args"]],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "FULL-ME" in line:
                fill(f"{mnt}/filler")
                open(flag, "w").close()
        code = proc.wait()
        filled = os.path.exists(f"{mnt}/filler")
        if filled:
            os.unlink(f"{mnt}/filler")
        left = [os.path.relpath(os.path.join(d, f), mnt) for d, _, fs in os.walk(mnt) for f in fs]
        out[name] = {"code": code, "stderr": "".join(lines)[-4000:], "left": left, "filled": filled}
        subprocess.run(["umount", mnt], check=True)
    json.dump(out, open(args["results"], "w"))
''')


def _small_group_recipe(folder: Path) -> str:
    """A 4-bit recipe whose groups fit the tiny model's head_dim 16 (the presets' 32 do not)."""
    from kvcalib.layout import LayerConfig
    from kvcalib.recipe import Recipe

    path = folder / "k4v4-g16.json"
    doc = Recipe(name="k4v4-g16", default_layer=LayerConfig(k_bits=4, v_bits=4, k_group=16, v_group=16,
                                                                window=16)).metadata()
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_disk_that_fills_before_collect_export_or_eval_write_is_one_line(world, tmp_path):
    """The disk fills after the free-space check passed, just before the output is written: a
    SafetensorError ("I/O error: No space left on device") for collect's statistics and export's
    recipe, an OSError for eval's JSON. Each is exit code 2 and one line naming the output, and
    nothing is left on the disk (issue 54: collect and export ended in a traceback)."""
    why = _can_mount_tmpfs(tmp_path)
    if why:
        pytest.skip(why)
    _, collected, root = world
    mnt, flags = tmp_path / "mnt", tmp_path / "flags"
    mnt.mkdir()
    flags.mkdir()
    (tmp_path / "hook.py").write_text(FILL_BEFORE_WRITE)
    (tmp_path / "driver.py").write_text(MID_WRITE_DRIVER)
    model = ["--model", str(root / "model"), "--device", "cpu"]
    commands = {
        "collect": {"what": "kvcalib.stats.CollectedStats.save",
                    "args": ["collect", *model, "--data", str(root / "text.txt"), "--samples", "2", "--seq-len", "64",
                             "--block-len", "32", "--out", f"{mnt}/c"]},
        "export": {"what": "kvcalib.recipe.Recipe.save",
                   "args": ["export", str(collected), "-o", f"{mnt}/r.safetensors", "--bits", "k4v4", "--group", "16",
                            "--window", "16", "--clip"]},
        "eval": {"what": "kvcalib.eval.harness.write_json",
                 "args": ["eval", *model, "--recipe", _small_group_recipe(tmp_path), "--data", str(root / "text.txt"),
                          "--metrics", "ppl",
                          "--ppl-samples", "1", "--ppl-seq-len", "64", "--json", f"{mnt}/o.json"]},
    }
    results = tmp_path / "results.json"
    (tmp_path / "args.json").write_text(json.dumps({"mnt": str(mnt), "flags": str(flags), "results": str(results),
                                                    "hook": str(tmp_path / "hook.py"), "commands": commands}))
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, str(tmp_path / "driver.py"),
                           str(tmp_path / "args.json")], env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, res in json.loads(results.read_text()).items():
        assert res["filled"] and res["code"] == 2 and "Traceback" not in res["stderr"], (name, res)
        errors = _error_lines(res["stderr"])
        assert len(errors) == 1 and "no space left on the device" in errors[0] and str(mnt) in errors[0], (name, errors)
        assert res["left"] == [], (name, res["left"])


def _fill_mid_write(monkeypatch) -> None:
    """A disk that fills mid-write, where no tmpfs can be mounted: safetensors writes half its
    bytes and fails as it does on a full disk; a text write writes half and fails with ENOSPC."""
    import errno
    import safetensors.torch

    SafetensorError = type("SafetensorError", (Exception,), {})

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    real_write_text = Path.write_text

    def write_text(self, data, *args, **kwargs):
        real_write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(Path, "write_text", write_text)


@pytest.mark.parametrize("command", ["collect", "export", "eval", "search"])
def test_a_writer_that_fails_mid_write_is_one_line_and_leaves_nothing(world, tmp_path, monkeypatch, command):
    """The same promise with a writer that fails halfway (what a full disk does), in this process:
    runs where no tmpfs can be mounted (CI without root), in a second or two. A search names the
    command that goes on once there is room."""
    from typer.testing import CliRunner

    from kvcalib.cli import app

    base, collected, root = world
    out = tmp_path / "out"
    out.mkdir()
    model = ["--model", str(root / "model"), "--device", "cpu"]
    if command == "search":  # from collected statistics: the first file it writes is the recipe
        out = shutil.copytree(collected, out, dirs_exist_ok=True)
    kept = sorted(p.name for p in out.iterdir())
    args = {"collect": ["collect", *model, "--data", str(root / "text.txt"), "--samples", "2", "--seq-len", "64",
                        "--block-len", "32", "--out", str(out / "c")],
            "export": ["export", str(collected), "-o", str(out / "r.safetensors"), "--bits", "k4v4", "--group", "16",
                       "--window", "16"],
            "eval": ["eval", *model, "--recipe", _small_group_recipe(tmp_path), "--data", str(root / "text.txt"),
                     "--metrics", "ppl", "--ppl-samples", "1", "--ppl-seq-len", "64", "--json", str(out / "o.json")],
            "search": [*base[1:-1], "2", "--out", str(out)]}[command]
    monkeypatch.setenv("KVCALIB_QUIET", "1")
    _fill_mid_write(monkeypatch)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1, result.stderr  # (transformers' "Loading weights" bar may precede it)
    assert f"cannot write {out}" in errors[0] and "no space left on the device" in errors[0], errors
    left = sorted(p.name for p in out.iterdir())
    if command == "search":
        assert "--resume" in errors[0] and set(left) - set(kept) <= {"study.db"}, (errors, left)
    else:
        assert left == kept == []
