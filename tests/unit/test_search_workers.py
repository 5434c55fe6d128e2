"""Search at scale, in process (issue 37): per-trial seeding, the warm-start lock, heartbeats and
retries of a dead worker's trial, the end-of-study drain, storage failures as one error, and the
Pareto mode on a tiny random model. The real multi-process runs (PostgreSQL, SIGKILL, a server
stopped mid-search, ``--workers``) are in tests/integration/test_search_scale.py."""

from __future__ import annotations

import time

import pytest

from kvcalib.errors import KvcalibError
from tests.unit.test_search import TINY_SPACE, tiny  # noqa: F401  (the tiny model, statistics and scoring ids)


def _space():
    from kvcalib.optimize.space import SearchSpace

    return SearchSpace.from_dict(TINY_SPACE)


def _points(study):
    return [tuple(sorted(t.params.items())) for t in study.trials]


# ------------------------------------------------------------------ seeding
def test_proposals_depend_on_the_trial_not_the_worker(tmp_path):
    """Two workers (two samplers, same seed) on one study propose what one worker proposes alone
    (the sampler is reseeded by trial number), and never the same random point twice."""
    import optuna

    from kvcalib.optimize.study import make_sampler, open_study

    space = _space()

    def sample(trial):
        space.sample(trial, 2)
        return 0.0

    one = open_study(f"sqlite:///{tmp_path / 'one.db'}", "s", space, 2, sampler=make_sampler(0, 4.0, 5))
    for _ in range(4):
        t = one.ask()
        one.tell(t, sample(t))
    url = f"sqlite:///{tmp_path / 'two.db'}"
    a = open_study(url, "s", space, 2, sampler=make_sampler(0, 4.0, 5))
    b = open_study(url, "s", space, 2, sampler=make_sampler(0, 4.0, 5))
    for worker in (a, b, a, b):
        t = worker.ask()
        worker.tell(t, sample(t))
    assert _points(a) == _points(one)
    assert len(set(_points(one))) == 4  # the old shared seed made worker b repeat worker a's draws
    other = open_study(f"sqlite:///{tmp_path / 'other.db'}", "s", space, 2, sampler=make_sampler(1, 4.0, 5))
    t = other.ask()
    other.tell(t, sample(t))
    assert _points(other)[0] != _points(one)[0]  # the seed still matters
    assert optuna.trial.TrialState.COMPLETE in {t.state for t in one.trials}


# ------------------------------------------------------------------ warm-start lock
def test_warm_start_lock_is_taken_once_and_taken_over_when_stale(tmp_path):
    from kvcalib.optimize.study import ATTR_WARM_DONE, WARM_LOCK, WarmStartLock, claim_warm_start, open_study

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study(url, "s", _space(), 2)
    first = claim_warm_start(study, shared=True, heartbeat=60)
    assert first is not None
    second = WarmStartLock(open_study(url, "s", _space(), 2), heartbeat=60)
    assert not second.try_take() and not second.take_over_if_stale()  # its holder beats
    # the holder dies: its beat ages past GRACE_BEATS heartbeats
    first._stop.set()
    first._thread.join()
    storage = study._storage
    storage.set_study_user_attr(storage.get_study_id_from_name("s" + WARM_LOCK), "beat", time.time() - 500)
    assert second.take_over_if_stale()
    with second.held():
        study.set_user_attr(ATTR_WARM_DONE, True)
    assert "s" + WARM_LOCK not in {s.study_name for s in storage.get_all_studies()}  # released
    assert claim_warm_start(study, shared=True, heartbeat=60) is None  # done: nobody runs it again


def test_a_lock_released_while_a_waiter_reads_it_is_taken(tmp_path, monkeypatch):
    """The holder deletes the lock between a waiter's two reads (its id, then its beat): the
    waiter takes the free lock instead of failing on the missing record (a worker of the
    PostgreSQL test died of that KeyError)."""
    from kvcalib.optimize.study import WARM_LOCK, WarmStartLock, open_study

    url = f"sqlite:///{tmp_path / 's.db'}"
    holder = WarmStartLock(open_study(url, "s", _space(), 2), heartbeat=60)
    assert holder.try_take()
    waiter = WarmStartLock(open_study(url, "s", _space(), 2), heartbeat=60)
    read_attrs = waiter.storage.get_study_user_attrs

    def released_first(study_id):
        holder.release()  # the holder finishes right after the waiter found the lock's id
        return read_attrs(study_id)

    monkeypatch.setattr(waiter.storage, "get_study_user_attrs", released_first)
    assert waiter.take_over_if_stale()
    assert waiter.storage.get_study_id_from_name("s" + WARM_LOCK) == waiter.study_id
    waiter.release()


# ------------------------------------------------------------------ heartbeats, retries, drain
@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")  # the test's own ask()
def test_drain_settles_for_a_trial_another_worker_starts_a_moment_later(tmp_path):
    """The race a CI run hit: this worker's last trial meets the budget while the other worker,
    which checked the budget a moment before, is between its check and asking one more trial. A
    single look finds the study quiet and this run folder misses that trial; with ``settle`` the
    drain looks again after that long, sees the new trial and waits for it."""
    import threading

    import optuna

    from kvcalib.optimize.study import drain, open_study

    space = _space()
    url = f"sqlite:///{tmp_path / 's.db'}"
    here = open_study(url, "s", space, 2, heartbeat=1)

    def other_worker():
        time.sleep(0.3)  # still in its callbacks when this worker looks first
        study = open_study(url, "s", space, 2, heartbeat=1)
        trial = study.ask()
        space.sample(trial, 2)
        study._storage.record_heartbeat(trial._trial_id)
        time.sleep(1.0)
        study.tell(trial, 1.0)

    def fn(trial):  # no retry is ever waiting here: never called
        raise AssertionError("drain ran a trial")

    assert drain(here, fn, poll=0.1) == 0 and here.get_trials(deepcopy=False) == []  # one look: gone at once
    worker = threading.Thread(target=other_worker)
    worker.start()
    try:
        # settle well past the other worker's 0.3 s: opening a SQLite study takes most of a second
        # on a loaded 2-core machine (a CI run with other tests beside it missed 0.8 s)
        assert drain(here, fn, poll=0.1, settle=3.0) == 0
        states = [t.state for t in here.get_trials(deepcopy=False)]
        assert states == [optuna.trial.TrialState.COMPLETE]  # it waited for the other worker's trial
    finally:
        worker.join()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")  # the test's own ask()
def test_a_dead_workers_trial_is_failed_retried_and_drained(tmp_path):
    """A RUNNING trial whose heartbeat stopped is failed after the grace period by the worker that
    drains the study, enqueued again by RetryFailedTrialCallback with its parameters, and run."""
    import optuna

    from kvcalib.optimize.study import drain, open_study, recover_interrupted, retry_of, trial_records

    space = _space()
    url = f"sqlite:///{tmp_path / 's.db'}"
    dead = open_study(url, "s", space, 2, heartbeat=1)
    killed = dead.ask()
    space.sample(killed, 2)
    dead._storage.record_heartbeat(killed._trial_id)  # then the process "dies": no more beats
    alive = open_study(url, "s", space, 2, heartbeat=1)
    ran = []

    def fn(trial):
        space.sample(trial, 2)
        ran.append(trial.number)
        return 1.0

    t0 = time.monotonic()
    assert drain(alive, fn, poll=0.2) == 1
    assert time.monotonic() - t0 >= 2.5  # not before the grace period (3 beats of 1 s)
    by_num = {t.number: t for t in alive.trials}
    assert by_num[killed.number].state == optuna.trial.TrialState.FAIL
    retry = by_num[ran[0]]
    assert retry.state == optuna.trial.TrialState.COMPLETE and retry_of(retry) == killed.number
    assert retry.params == by_num[killed.number].params
    assert recover_interrupted(alive, running=False) == []  # Optuna's retry counts as the retry
    rec = {r["number"]: r for r in trial_records(alive, space, 2, 4.0)}
    assert rec[ran[0]]["recovered_from"] == killed.number


def test_storage_failure_is_one_error_naming_the_fix():
    import sqlite3

    from kvcalib.optimize.study import storage_errors

    class OperationalError(Exception):  # what SQLAlchemy raises when the server is gone
        pass

    OperationalError.__module__ = "sqlalchemy.exc"
    with pytest.raises(KvcalibError) as err:
        with storage_errors("postgresql://bob:pw@db/optuna", "run the same command again"):
            try:
                raise OperationalError("connection refused\nmore lines")
            except OperationalError:
                x = None
                x.boom  # Optuna's bookkeeping failing while it handles the storage error
    text = str(err.value)
    assert "postgresql://bob:***@db/optuna failed mid-search (OperationalError: connection refused)" in text
    assert "every finished trial is kept" in text and "run the same command again" in text and "\n" not in text
    with pytest.raises(ZeroDivisionError):  # anything else is a bug: not dressed as a storage error
        with storage_errors("sqlite:///x.db", "again"):
            1 / 0
    with pytest.raises(KvcalibError, match=r"\(OperationalError: disk I/O error\)"):
        with storage_errors("sqlite:///x.db", "again"):
            raise sqlite3.OperationalError("disk I/O error")


# ------------------------------------------------------------------ Pareto mode
def _config(run, **kw):
    from kvcalib.optimize import SearchConfig

    base = dict(out=run, trials=10, budget_bits=4.0, space=dict(TINY_SPACE), eval=False, presets=("kivi-2",),
                context=256)
    base.update(kw)
    return SearchConfig(**base)


def test_pareto_mode_holds_the_front_and_exports_any_budget(tiny, tmp_path):
    from kvcalib.export import export_search_point
    from kvcalib.optimize import search_with
    from kvcalib.optimize.study import open_study

    from kvcalib.optimize.objective import SearchObjective

    model, info, stats, ids = tiny
    run = tmp_path / "run"
    run.mkdir()
    stats.save(run / "stats.safetensors")
    floor = SearchObjective(model, info, stats, ids, context=256).effective_bits(
        _space().floor_point(2), with_tensors=False)  # 6.31: window and scales weigh much at 256 tokens
    doc = search_with(_config(run, objective="pareto", budget_bits=round(floor + 1.0, 3)), model, info, stats, ids,
                      run, progress=False)
    assert doc["objective"] == "pareto"
    done = [t for t in doc["trials"] if t["state"] == "COMPLETE"]
    assert len(done) == 10 and all(t["kl"] is not None and t["effective_bits"] is not None for t in done)
    assert all(t["state"] != "PRUNED" for t in doc["trials"])  # no pruning in two objectives
    bits = sorted(t["effective_bits"] for t in done if t["warm_start"])
    assert bits[0] < floor + 0.5 and bits[-1] > floor + 2.0  # the warm start spans the range, not one budget
    front = [t for t in done if t["number"] in doc["pareto"]]
    assert len(front) >= 3
    for a in front:  # no trial beats a front member in both objectives
        assert not any(t["effective_bits"] <= a["effective_bits"] and t["kl"] < a["kl"] for t in done)
    # the front's cheapest and dearest members are what export picks at their bits
    low, high = min(front, key=lambda t: t["effective_bits"]), max(front, key=lambda t: t["effective_bits"])
    _, rec_low = export_search_point(run, tmp_path / "low.safetensors", budget_bits=low["effective_bits"])
    _, rec_high = export_search_point(run, tmp_path / "high.safetensors", budget_bits=high["effective_bits"])
    assert rec_low["number"] == low["number"] and rec_high["number"] == high["number"]
    assert rec_high["kl"] < rec_low["kl"]
    # one objective per study: a budget search cannot join a Pareto study, nor the reverse
    url = f"sqlite:///{run / 'study.db'}"
    with pytest.raises(KvcalibError, match="--objective pareto"):
        open_study(url, "kvcalib-search", _config(run).space, 2)
    with pytest.raises(KvcalibError, match="--objective budget"):
        open_study(f"sqlite:///{tmp_path / 'b.db'}", "b", _config(run).space, 2)  # make a budget study
        open_study(f"sqlite:///{tmp_path / 'b.db'}", "b", _config(run).space, 2, objective="pareto")


def test_config_refuses_bad_objective_and_workers(tmp_path):
    for kw, match in (({"objective": "nsga"}, "--objective 'nsga'"), ({"workers": 0}, "--workers"),
                      ({"workers": "many"}, "--workers"), ({"heartbeat": 0}, "--heartbeat")):
        with pytest.raises(KvcalibError, match=match):
            _config(tmp_path / "run", **kw)


def test_worker_environment_pins_one_gpu_each(monkeypatch):
    from kvcalib.optimize.workers import resolve_workers, visible_gpus, worker_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    gpus = visible_gpus(None)
    assert gpus == ["3", "5"] and visible_gpus("cpu") == []
    assert resolve_workers("auto", gpus) == 2 and resolve_workers("auto", []) == 1 and resolve_workers(3, gpus) == 3
    envs = [worker_env(i, gpus, 3, base={}) for i in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5", "3"]  # round robin past the GPUs
    assert "KVCALIB_QUIET" not in envs[0] and envs[1]["KVCALIB_QUIET"] == "1"
    cpu = worker_env(1, [], 2, base={})
    assert "CUDA_VISIBLE_DEVICES" not in cpu and int(cpu["KVCALIB_WORKER_THREADS"]) >= 1
    # GPU workers share the host's cores too: each gets its share of threads, torch's and OpenMP's
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    gpu_envs = [worker_env(i, gpus, 2, base={}) for i in range(2)]
    assert [(e["KVCALIB_WORKER_THREADS"], e["OMP_NUM_THREADS"]) for e in gpu_envs] == [("16", "16")] * 2
    assert worker_env(0, gpus, 2, base={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"  # the user's setting stays
    chosen = worker_env(1, gpus, 2, base={"KVCALIB_WORKER_THREADS": "4"})  # threads per worker, the user's choice
    assert (chosen["KVCALIB_WORKER_THREADS"], chosen["OMP_NUM_THREADS"]) == ("4", "4")


def test_workers_racing_to_create_a_fresh_databases_tables_try_again(monkeypatch):
    """PostgreSQL: workers that start together all create the study tables; the losers' IntegrityError
    means the tables are there now, so opening tries again (and a real failure is not retried forever)."""
    from kvcalib.optimize import study

    class IntegrityError(Exception):
        pass

    calls = []

    def storage_class():
        def make(url, **kw):
            calls.append(url)
            if len(calls) == 1:
                raise IntegrityError('duplicate key value violates unique constraint "pg_type_typname_nsp_index"')
            return "storage"
        return make

    monkeypatch.setattr(study, "_quiet_rdb", storage_class)
    assert study._create_rdb("postgresql://x/y", {}, {}) == "storage" and len(calls) == 2

    def always_refused():
        def make(url, **kw):
            raise ConnectionRefusedError("connection refused")
        return make

    monkeypatch.setattr(study, "_quiet_rdb", always_refused)
    with pytest.raises(ConnectionRefusedError):
        study._create_rdb("postgresql://x/y", {}, {})


_POP = """
import os, sys
import optuna
from kvcalib.optimize.study import open_storage
optuna.logging.set_verbosity(optuna.logging.ERROR)
study = optuna.load_study(study_name="s", storage=open_storage(sys.argv[1]))
def objective(trial):
    x = trial.suggest_int("x", 0, 10**6)
    with open(sys.argv[2], "a") as ran:  # one line per trial this process ran
        ran.write(f"{trial.number}\\n")
    return x
for _ in range(int(sys.argv[3])):
    study.optimize(objective, n_trials=1)
"""


def test_sqlite_workers_never_run_one_waiting_trial_twice(tmp_path):
    """Four processes pop 80 enqueued (WAITING) trials from one SQLite study. Before
    ``_serialize_sqlite`` two of them could read the same WAITING trial and both run it (SQLite
    ignores Optuna's SELECT ... FOR UPDATE): 5-9 of 120 trials ran twice in this setting, and the
    slower process died with "Cannot tell a PRUNED trial" in a 2-GPU search."""
    import subprocess
    import sys

    import optuna

    from kvcalib.optimize.study import open_storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    for i in range(80):
        study.enqueue_trial({"x": i})
    script = tmp_path / "pop.py"
    script.write_text(_POP)
    procs = [subprocess.Popen([sys.executable, str(script), url, str(tmp_path / f"ran{i}.txt"), "20"],
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    ran = [line for i in range(4) for line in (tmp_path / f"ran{i}.txt").read_text().split()]
    assert len(ran) == 80 and len(set(ran)) == 80, sorted(ran)
    states = {t.state for t in optuna.load_study(study_name="s", storage=open_storage(url)).trials}
    assert states == {optuna.trial.TrialState.COMPLETE}
