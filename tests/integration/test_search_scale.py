"""Search at scale through the real command (issue 37): ``kvcalib search`` worker processes on one
PostgreSQL study (a server started here, on 127.0.0.1 only), a worker SIGKILLed mid-trial, the
server stopped mid-search, and ``--workers 2`` from one command. A tiny random model saved to a
folder, a text file and a small space keep each worker to seconds; trials are slowed by a sleep
(``SLOW``: the real CLI, its KL patched to wait) so that workers overlap and a kill lands mid-trial.

The PostgreSQL tests skip, saying why, where the server binaries or the driver are missing;
``.ci/run`` installs Debian's ``postgresql`` package so that CI runs them.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import postgres
from tests.conftest import corpus_lines, tiny_loaded_model

SPACE = {"bits": [2, 4, 8], "groups": [8], "windows": [8, 16], "sinks": [0, 2], "layer_methods": ["clip"]}
BUDGET = "7.5"  # the tiny model's floor at context 256 is ~6.3 bits (window and scales weigh much)
FRESH = 0.5  # seconds: how recently the trial a kill is aimed at must have started (its KL still ahead)
# every Python process of a test (the command, and the workers it spawns) imports this first: each
# trial's KL (SearchObjective.parts, which a trial calls) takes KVTEST_TRIAL_SLEEP seconds longer, so
# workers overlap and a kill lands mid-trial
SLOW = ("import os, time\n"
        "if float(os.environ.get('KVTEST_TRIAL_SLEEP', '0')) > 0:\n"
        "    from kvcalib.optimize.objective import SearchObjective as S\n"
        "    parts = S.parts\n"  # what a trial calls (the KL with its ordinary and copy parts)
        "    S.parts = lambda self, *a, **k: (time.sleep(float(os.environ['KVTEST_TRIAL_SLEEP'])), parts(self, *a, **k))[1]\n")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_tokenizer):
    """A model folder, a text file and a space file for ``kvcalib search``."""
    root = tmp_path_factory.mktemp("scale")
    loaded = tiny_loaded_model(tiny_tokenizer, head_dim=64)  # the presets compared against need head_dim 64
    loaded.model.save_pretrained(root / "model")
    tiny_tokenizer.save_pretrained(root / "model")
    (root / "corpus.txt").write_text("\n".join(corpus_lines(600)))
    (root / "space.json").write_text(json.dumps(SPACE))
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SLOW)
    return root


def search_cmd(inputs: Path, out: Path, *extra: str, trials: int = 8) -> list[str]:
    return [sys.executable, "-m", "kvcalib.cli", "search", "--model", str(inputs / "model"), "--data", str(inputs / "corpus.txt"),
            "--space", str(inputs / "space.json"), "--samples", "4", "--seq-len", "40", "--score-seq-len", "40",
            "--score-samples", "2",
            "--context", "256", "--budget-bits", BUDGET, "--trials", str(trials), "--no-eval", "--device", "cpu",
            "--out", str(out), *extra]


def start(cmd: list[str], cwd: Path, sleep: float, log: str, inputs: Path) -> subprocess.Popen:
    path = os.pathsep.join([str(inputs / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "KVTEST_TRIAL_SLEEP": str(sleep), "KVCALIB_QUIET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": path}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=open(cwd / f"{log}.out", "w"),
                            stderr=open(cwd / f"{log}.err", "w"))


_STORAGES: dict = {}  # url -> one storage for every look this process takes


def load(url: str, name: str, missing_ok: bool = False):
    """The study ``name`` (None when ``missing_ok`` and no worker has made it yet). One storage per
    URL: a test polls every 0.2 s for minutes, and a storage opened per poll kept its pooled
    connection until garbage collection, which ran the server out of connections (CI stop 58)."""
    import optuna

    from kvcalib.optimize.study import open_storage

    if url not in _STORAGES:
        _STORAGES[url] = open_storage(url)
    try:
        return optuna.load_study(study_name=name, storage=_STORAGES[url])
    except KeyError:
        if missing_ok:
            return None
        raise


def finished(study) -> list:
    return [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")]


def trials_of(run: Path) -> list[tuple]:
    doc = json.loads((run / "search.json").read_text())
    return [(t["number"], t["state"], t["kl"], t["worker"]) for t in doc["trials"]]


@pytest.fixture(scope="module")
def pg():
    reason = postgres.unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = postgres.PostgresServer()
    server.start()
    yield server
    from kvcalib.optimize.study import close_storage

    if server.url in _STORAGES:
        close_storage(_STORAGES.pop(server.url))
    server.close()


# ------------------------------------------------------------------ probes close their connections
def test_probes_close_their_connections(pg):
    """More probes than the server takes connections (max_connections=100), the garbage collector
    off: each probe (``probed_storage``, and ``storage_lost``, which the CLI calls after an error)
    closes its pooled connection, so none is refused. Optuna's RDBStorage has no ``__del__``: a
    probe that only dropped its storage kept its connection open (CI stop 58, "too many clients")."""
    import gc

    from kvcalib.optimize.guards import storage_lost
    from kvcalib.optimize import SearchConfig
    from kvcalib.optimize.study import probed_storage

    config = SearchConfig(model="m", data="d", out=Path("unused"), storage=pg.url, study="probe")
    gc.disable()
    try:
        for i in range(120):
            if i % 2:
                with probed_storage(pg.url) as storage:
                    storage.get_all_studies()
            else:  # no study "probe": the storage is intact but does not hold it
                assert "no longer holds study 'probe'" in storage_lost(config)
    finally:
        gc.enable()


# ------------------------------------------------------------------ two workers, one study
def test_two_workers_share_a_postgres_study(pg, inputs, tmp_path):
    """Two workers and a lone worker (its own study, same seed and budget) at once: the shared
    study holds its budget, each trial run by one worker, the warm start run once; every point
    both studies scored has the same KL; both run folders report the same trials and export."""
    procs = [start(search_cmd(inputs, tmp_path / name, "--storage", pg.url, "--study", study), tmp_path, 0.3, name, inputs)
             for name, study in (("a", "shared"), ("b", "shared"), ("alone", "alone"))]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0, 0], [(tmp_path / f"{n}.err").read_text()[-2000:] for n in ("a", "b", "alone")]
    shared, alone = load(pg.url, "shared"), load(pg.url, "alone")
    done = finished(shared)
    assert 8 <= len(done) <= 9  # the budget; the other worker's trial in flight may finish after it
    assert all(t.state.name != "RUNNING" for t in shared.trials)
    assert {t.user_attrs["worker"].rsplit(":", 1)[1] for t in done} == {str(procs[0].pid), str(procs[1].pid)}
    warm = [tuple(sorted(t.params.items())) for t in shared.trials if t.user_attrs.get("warm_start")]
    assert warm and len(warm) == len(set(warm))  # the warm start ran once: each point enqueued once
    assert shared.user_attrs["sensitivity"] == alone.user_attrs["sensitivity"]
    kl_alone = {tuple(sorted(t.params.items())): t.values[0] for t in alone.trials if t.state.name == "COMPLETE"}
    both = [(kl_alone[p], t.values[0]) for t in shared.trials if t.state.name == "COMPLETE"
            for p in [tuple(sorted(t.params.items()))] if p in kl_alone]
    assert len(both) >= 3 and all(a == b for a, b in both)  # one objective: the same point, the same KL
    assert trials_of(tmp_path / "a") == trials_of(tmp_path / "b")  # each waited for the study to be quiet
    from kvcalib.recipe import Recipe

    picked = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        res = subprocess.run([sys.executable, "-m", "kvcalib.cli", "export", str(tmp_path / name), "--budget-bits",
                              BUDGET, "-o", str(out)], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        picked.append(Recipe.load(out))
    assert picked[0].provenance["trial"] == picked[1].provenance["trial"]
    assert picked[0].layers == picked[1].layers


# ------------------------------------------------------------------ faults
def test_worker_killed_mid_trial_is_retried_by_the_other(pg, inputs, tmp_path):
    """SIGKILL one of two workers while it runs a trial: the other fails that trial once its
    heartbeat is 3 beats old, runs its retry (same point), and completes the budget; no finished
    trial is lost; the killed worker's command, run again, finds the study done."""
    args = ("--storage", pg.url, "--study", "kill", "--heartbeat", "1")
    a = start(search_cmd(inputs, tmp_path / "a", *args, trials=8), tmp_path, 1.0, "a", inputs)
    b = start(search_cmd(inputs, tmp_path / "b", *args, trials=8), tmp_path, 1.0, "b", inputs)
    me = f"{socket.gethostname()}:{a.pid}"

    def running_in_a():
        # a trial of a's that started under FRESH seconds ago: its KL (KVTEST_TRIAL_SLEEP = 1 s
        # longer) is still ahead, so the kill below lands mid-trial (a trial seen near its end
        # once completed between this look and the kill: CI, 2026-11-26)
        study = load(pg.url, "kill", missing_ok=True)
        now = datetime.datetime.now()  # optuna stamps trials with the local naive time too
        return study and next((t for t in study.get_trials(deepcopy=False)
                               if t.state.name == "RUNNING" and t.user_attrs.get("worker") == me
                               and (now - t.datetime_start).total_seconds() < FRESH
                               and len(finished(study)) >= 2), None)

    victim = postgres.wait_for(running_in_a, 300, poll=0.05, what="worker a to start a trial")
    before = {t.number: t.values for t in finished(load(pg.url, "kill"))}
    os.kill(a.pid, signal.SIGKILL)
    assert a.wait(timeout=30) == -signal.SIGKILL
    assert b.wait(timeout=600) == 0, (tmp_path / "b.err").read_text()[-2000:]
    study = load(pg.url, "kill")
    by_num = {t.number: t for t in study.trials}
    assert by_num[victim.number].state.name == "FAIL"
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1 and retries[0].state.name in ("COMPLETE", "PRUNED")
    assert retries[0].params == by_num[victim.number].params
    assert retries[0].user_attrs["worker"] != me
    assert all(by_num[n].values == v for n, v in before.items())  # 0 finished trials lost
    assert len(finished(study)) >= 8
    assert not [t for t in study.trials if t.state.name == "RUNNING"]
    # resume after the kill: the same command finds the budget met and reports the same study
    again = start(search_cmd(inputs, tmp_path / "a", *args, trials=8), tmp_path, 1.0, "a2", inputs)
    assert again.wait(timeout=300) == 0, (tmp_path / "a2.err").read_text()[-2000:]
    assert trials_of(tmp_path / "a") == trials_of(tmp_path / "b")
    assert len(finished(load(pg.url, "kill"))) == len(finished(study))


def test_server_stopped_mid_search_is_one_error_and_resumes(pg, inputs, tmp_path):
    """Stop PostgreSQL while a worker runs: one error line (exit 2, no traceback); start it again
    and the same command finishes the study with every earlier finished trial kept and the trial
    that was running retried."""
    cmd = search_cmd(inputs, tmp_path / "w", "--storage", pg.url, "--study", "outage", "--heartbeat", "1", trials=8)
    w = start(cmd, tmp_path, 1.0, "w", inputs)

    def mid_trial():
        study = load(pg.url, "outage", missing_ok=True)
        if study is None:
            return None
        running = [t for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING"]
        return (study, running[0]) if len(finished(study)) >= 2 and running else None

    study, running = postgres.wait_for(mid_trial, 300, what="two finished trials and one running")
    before = {t.number: t.values for t in finished(study)}
    pg.stop("fast")
    try:
        code = w.wait(timeout=120)
        err = (tmp_path / "w.err").read_text()
        lines = [ln for ln in err.splitlines() if ln.startswith("kvcalib")]  # not transformers' loading bar
        assert code == 2, err[-2000:]
        assert "Traceback" not in err and "Exception in thread" not in err, err
        assert len(lines) == 1 and lines[0].startswith("kvcalib: error: the study storage postgresql+psycopg://"), err
        assert "every finished trial is kept" in lines[0]
    finally:
        pg.start()
    again = start(cmd, tmp_path, 0.2, "w2", inputs)
    assert again.wait(timeout=600) == 0, (tmp_path / "w2.err").read_text()[-2000:]
    study = load(pg.url, "outage")
    by_num = {t.number: t for t in study.trials}
    assert all(n in by_num and by_num[n].values == v for n, v in before.items())  # none lost
    assert len(finished(study)) >= 8
    stopped = by_num[running.number]
    if stopped.state.name == "FAIL":  # the usual case: the outage caught it mid-trial
        retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == running.number]
        assert len(retries) == 1 and retries[0].params == stopped.params
    else:  # it finished before the stop reached it
        assert stopped.state.name in ("COMPLETE", "PRUNED")


# ------------------------------------------------------------------ --workers from one command
def test_workers_flag_runs_processes_on_one_study(inputs, tmp_path):
    """``--workers 2`` on CPU: two processes on the run folder's SQLite study, statistics collected
    once (worker 0) and copied, the same trials in both run folders, export from either."""
    run = tmp_path / "run"
    cmd = search_cmd(inputs, run, "--workers", "2", trials=6)
    p = start(cmd, tmp_path, 1.0, "workers", inputs)
    assert p.wait(timeout=600) == 0, (tmp_path / "workers.err").read_text()[-2000:]
    out = (tmp_path / "workers.out").read_text()
    assert "worker-0" in out
    spec = json.loads((run / "workers.json").read_text())
    assert spec["workers"] == 2 and spec["storage"].startswith("sqlite:///") and spec["gpus"] == []
    assert (run / "worker-0" / "stats.safetensors").read_bytes() == (run / "worker-1" / "stats.safetensors").read_bytes()
    assert trials_of(run / "worker-0") == trials_of(run / "worker-1")
    workers = {w for _, state, _, w in trials_of(run / "worker-0") if state == "COMPLETE"}
    assert len(workers) == 2
    res = subprocess.run([sys.executable, "-m", "kvcalib.cli", "export", str(run / "worker-1"), "--budget-bits", BUDGET,
                          "-o", str(tmp_path / "r.safetensors")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    # the same command again is refused (a search is there); with --resume it finds the budget met
    p = start(cmd, tmp_path, 0.0, "again", inputs)
    assert p.wait(timeout=300) == 2 and "--resume" in (tmp_path / "again.err").read_text()


# ------------------------------------------------------------------ --points-from
def test_points_from_an_earlier_run_are_scored_first_in_its_order(inputs, tmp_path):
    """``--points-from RUN``: the earlier run's finished points are the new study's first trials, in
    its order, with the same KL where the objective is the same; the warm start and the sampler come
    after. (scripts/search_scale.py gives every worker count the same trials this way.)"""
    first = start(search_cmd(inputs, tmp_path / "first", trials=5), tmp_path, 0.0, "first", inputs)
    assert first.wait(timeout=600) == 0, (tmp_path / "first.err").read_text()[-2000:]
    again = start(search_cmd(inputs, tmp_path / "again", "--points-from", str(tmp_path / "first"), trials=6),
                  tmp_path, 0.0, "again", inputs)
    assert again.wait(timeout=600) == 0, (tmp_path / "again.err").read_text()[-2000:]

    def records(run):
        doc = json.loads((run / "search.json").read_text())
        return sorted((t for t in doc["trials"] if t["state"] in ("COMPLETE", "PRUNED")), key=lambda t: t["number"])

    earlier, later = records(tmp_path / "first"), records(tmp_path / "again")
    assert len(earlier) >= 5 and len(later) >= 6
    assert [t["point"] for t in later[:len(earlier)]] == [t["point"] for t in earlier]
    both = [(a["kl"], b["kl"]) for a, b in zip(earlier, later) if a["state"] == b["state"] == "COMPLETE"]
    assert both and all(a == b for a, b in both)  # the same objective: the same point, the same KL
    assert json.loads((tmp_path / "again" / "search.json").read_text())["config"]["points_from"]


def test_points_from_outside_the_space_is_refused_before_any_work(inputs, tmp_path):
    """A run made over another space: one line naming the trial and what is outside, exit 2, no run folder."""
    run = tmp_path / "earlier"
    run.mkdir()
    point = {"group": 16, "window": 16, "sinks": 0, "k_axis": "channel", "k_bits": [2, 2], "v_bits": [2, 2],
             "methods": [[], []], "schedule": "none"}
    (run / "search.json").write_text(json.dumps({"trials": [{"number": 0, "state": "COMPLETE", "point": point}]}))
    for source, says in ((run, "group 16 is not one of [8]"), (tmp_path / "nowhere", "no such file")):
        res = subprocess.run(search_cmd(inputs, tmp_path / "new", "--points-from", str(source)),
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, res.stderr
        assert "--points-from" in res.stderr and says in res.stderr and "Traceback" not in res.stderr
        assert not (tmp_path / "new").exists()
