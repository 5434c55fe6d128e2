"""Optuna studies: storage, the constrained single-objective search, warm start and pruning.

Formulation. One objective, KL (``objective.py``), minimised by a TPE sampler with a constraint
``effective_bits - budget <= 0`` (``Trial.set_constraint``; ``TPESampler(constraints_func=...)`` on Optuna < 5): infeasible trials are
still scored, so the whole (effective bits, KL) Pareto front is recorded and ``kvcalib export
--budget-bits`` can pick another budget later without searching again. (A two-objective search
spends its trials along the whole front rather than at the budget, and Optuna cannot prune
multi-objective trials: that is the Pareto mode below, a choice, not the default.)

Warm start. A per-layer sensitivity sweep (each layer alone at the fewest bits, every other layer
uncompressed; KL on one sequence) orders layers; a greedy allocation then gives bits to the
(layer, K|V) with the largest estimated KL saving (sensitivity x 4^-(extra bits), the
quantization-error law) while the budget holds. Those points, the all-fewest-bits point and one
point over the budget are enqueued before the sampler takes over.

Local moves. With a tight budget almost no randomly sampled point is feasible, so after each
finished trial a neighbour of the best feasible trial (:func:`local_move`: bits to a sensitive
side or a switch flipped, then repaired to the budget) is enqueued with probability 0.7; TPE
proposes the others. Enqueued points are ordinary trials in the storage, so workers share them.

Pruning. Sequences are scored one at a time; after each one the running KL is reported and the
trial is pruned when a finished trial with no more effective bits already had a KL at least
``PRUNE_MARGIN`` times lower on the same sequences (it is Pareto-dominated so far).

Storage. SQLite in the run folder (``RUN_DIR/study.db``) by default; ``storage`` may be any
Optuna RDB URL (``sqlite:///path``, ``postgresql://...``) or a journal file (``journal:PATH`` or a
path ending in ``.log``/``.journal``) so several processes or machines join one study. The study
records a fingerprint of its space: another space under the same name is refused.

Many workers (issue 37). Every RDB storage records a heartbeat of each running trial
(``heartbeat`` seconds; :func:`open_storage`); a trial whose worker stopped beating for
``GRACE_BEATS`` heartbeats (SIGKILL, a lost machine) is failed by the next worker that asks for a
trial and re-enqueued by Optuna's ``RetryFailedTrialCallback`` (``RetryHeartbeatStaleTrialCallback``
since Optuna 4.9), so the others retry it; at the
end every worker waits for the study to fall quiet (:func:`drain`: no trial running, no retry
waiting), so all run folders report the same trials. The warm start runs once per study: the
worker that takes its lock (:func:`claim_warm_start`, a study named ``NAME:warm-start``, whose
creation is atomic in every storage) sweeps and enqueues while the others wait; a lock whose
holder stopped beating is taken over. Samplers are seeded per trial (:class:`TrialSeededTPE`):
a proposal depends on the seed, the trial number and the trials finished before it, never on which
worker asks, so workers never draw the same random point. A storage that fails mid-search
becomes one :class:`~kvcalib.errors.KvcalibError` (:func:`storage_errors`); its finished trials
are already committed.

Pareto mode (``objective="pareto"``): two objectives (KL, effective bits), both minimised by
Optuna's multi-objective TPE, warm-started with greedy points spread over the bits range
(:func:`front_warm_start_points`) and local moves that improve a random member of the front at its
own memory (:func:`make_local_callback` with ``pareto=True``); no pruning (Optuna cannot prune
multi-objective trials). One study holds the whole front; ``kvcalib export RUN --budget-bits B``
picks from it.
Optuna is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from kvcalib.errors import KvcalibError, StorageFailed, innermost_storage_error
from kvcalib.optimize.space import Point, SearchSpace, point_params

if TYPE_CHECKING:  # pragma: no cover
    import optuna

    from kvcalib.optimize.objective import KLParts, SearchObjective

log = logging.getLogger(__name__)

PRUNE_MARGIN = 1.25
DEFAULT_STUDY = "kvcalib-search"
ATTR_SPACE = "space_fingerprint"
ATTR_ACCOUNTING = "accounting"  # kvcalib.layout.ACCOUNTING of the trials' effective bits
ATTR_WARM_DONE = "warm_start_done"  # study user attr: the warm start's points are enqueued
ATTR_WORKER = "worker"  # trial user attr: "host:pid" of the worker that ran it
ATTR_KL_ORDINARY = "kl_ordinary"  # trial user attr: the KL of the ordinary scoring windows
ATTR_KL_COPY = "kl_copy"  # trial user attr: the KL of the copy windows (searches that score them)
DEFAULT_HEARTBEAT = 60  # seconds between a running trial's heartbeats
GRACE_BEATS = 3  # a trial is stale after this many missed heartbeats (Optuna's default is 2)
WARM_LOCK = ":warm-start"  # suffix of the study whose existence is the warm-start lock
RECOVER_LOCK = ":recover"  # ... and of the one held while a joining worker re-enqueues failed trials
OBJECTIVES = ("budget", "pareto")


# ------------------------------------------------------------------ storage


def _earlier_default_hint(space, num_layers: int, got: str | None) -> str:
    """A sentence for a study made with the default space before ``rotate`` joined it (2026-11-26):
    the same space with ``layer_methods`` ``["clip"]`` has the study's fingerprint."""
    from dataclasses import replace

    if got is None or "rotate" not in space.layer_methods:
        return ""
    earlier = replace(space, layer_methods=tuple(m for m in space.layer_methods if m != "rotate"))
    if earlier.fingerprint(num_layers) != got:
        return ""
    return ("It was made without rotate, the default space before 2026-11-26: to go on with it, pass --space "
            f"with {json.dumps({'layer_methods': list(earlier.layer_methods)})}. ")


def storage_url(storage: str | None, run_dir: Path) -> str:
    return storage if storage else f"sqlite:///{Path(run_dir).resolve() / 'study.db'}"


def _create_rdb(url: str, engine: dict, beat: dict, attempts: int = 5):
    """Optuna's RDB storage for ``url``. Workers that start together on a fresh database all
    create its tables at once; on PostgreSQL the losers of that race fail with an IntegrityError
    (or a ProgrammingError: "relation already exists"). Another try then finds the tables made."""
    import random
    import time as _time

    for attempt in range(attempts):
        try:
            return _quiet_rdb()(url, engine_kwargs=engine, **beat)
        except Exception as err:  # noqa: BLE001  (SQLAlchemy's types; matched by name, imported lazily)
            race = type(err).__name__ in ("IntegrityError", "ProgrammingError") or "already exists" in str(err)
            if not race or attempt == attempts - 1:
                raise
            _time.sleep(0.2 + random.random() * 0.5)  # jittered: the racers do not meet again
    raise AssertionError("unreachable")


def _serialize_sqlite(engine) -> None:
    """Make every SQLite transaction take the write lock when it begins (``BEGIN IMMEDIATE``).

    Why: Optuna hands a WAITING trial (a warm-start point, a retry) to a worker by reading its
    state and then writing RUNNING, with ``SELECT ... FOR UPDATE``, which SQLite ignores; and
    Python's sqlite3 driver opens no transaction before a SELECT. Two workers could both read
    WAITING and both run the trial: the slower one then died with "Cannot tell a PRUNED trial"
    (2 workers on 2 H200s, 2026-11-26), and 4 processes popping 120 enqueued trials ran 7 of them
    twice. With the driver's own transaction handling off and BEGIN IMMEDIATE at each begin
    (SQLAlchemy's recipe for pysqlite), the read and the write are one locked step; the others
    wait (the connection's 60 s busy timeout). Connections the storage opened while creating its
    tables predate the listeners, so the pool is emptied."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _driver_autocommit(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" below opens each transaction

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


def open_storage(url: str, heartbeat: int | None = None):
    """An Optuna storage for ``url``; KvcalibError when it cannot be reached.

    ``heartbeat`` (seconds, RDB storages only): running trials record a heartbeat this often; one
    silent for ``GRACE_BEATS`` beats is failed by the next worker that asks for a trial, and
    Optuna's retry callback (:func:`_retry_callback`) enqueues its point again (journal files keep no
    heartbeat: a killed worker's trial stays RUNNING until a resume with the run-folder storage)."""
    import optuna

    try:
        if url.startswith("journal:") or url.endswith((".log", ".journal")):
            from optuna.storages.journal import JournalFileBackend

            path = Path(url[len("journal:"):] if url.startswith("journal:") else url)
            if not path.parent.is_dir():
                raise KvcalibError(f"journal storage {path}: folder {path.parent} does not exist; create it or pass another path.")
            defer_interrupts_in_storage_calls()
            return _whole_calls(optuna.storages.JournalStorage)(JournalFileBackend(str(path)))
        if "://" not in url:
            raise KvcalibError(f"--storage {url!r} is neither a database URL (sqlite:///PATH, postgresql://...) "
                               "nor a journal file (journal:PATH or PATH.log)")
        if url.startswith("sqlite:///"):
            parent = Path(url[len("sqlite:///"):]).parent
            if not parent.is_dir():
                raise KvcalibError(f"--storage {url}: folder {parent} does not exist; create it or pass another URL.")
        engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        import warnings

        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna: a warning per worker
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            beat: dict[str, Any] = {}
            if heartbeat:
                beat = {"heartbeat_interval": int(heartbeat), "grace_period": GRACE_BEATS * int(heartbeat),
                        **_retry_callback()}
            defer_interrupts_in_storage_calls()
            storage = _create_rdb(url, engine, beat)
        if url.startswith("sqlite") and ":memory:" not in url and url.rstrip("/") != "sqlite:":
            _serialize_sqlite(storage.engine)  # a file several processes share (an in-memory one is private)
        return storage
    except KvcalibError:
        raise
    except Exception as err:  # SQLAlchemy/driver errors vary by backend; all mean "unreachable"
        raise KvcalibError(f"cannot open study storage {url}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
                           "Check the URL, the server and the credentials"
                           + (" (PostgreSQL needs a driver: pip install 'psycopg[binary]')"
                              if isinstance(err, ImportError) else "") + ".") from None


@contextlib.contextmanager
def probed_storage(url: str) -> Iterator[Any]:
    """``open_storage(url)`` for one look (does the study exist, is the server up), its connections
    closed on the way out. Why: Optuna's RDBStorage has no ``__del__``, so an engine opened for a
    probe keeps its pooled connection until the garbage collector finds it; a process that probes
    often (the storage check after an error, a test polling a study) then runs a PostgreSQL server
    out of its ``max_connections`` ("sorry, too many clients already", CI stop 58)."""
    storage = open_storage(url)
    try:
        yield storage
    finally:
        close_storage(storage)


def close_storage(storage: Any) -> None:
    """Close the pooled connections of an RDB storage (a journal storage holds none). The storage
    stays usable: SQLAlchemy opens a fresh pool on its next call."""
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()


def _retry_callback() -> dict[str, Any]:
    """RDBStorage's stale-trial callback argument: Optuna's retry of a trial whose worker stopped
    beating, each point retried at most twice. Optuna 4.9 renamed both
    (``RetryFailedTrialCallback`` / ``failed_trial_callback`` -> ``RetryHeartbeatStaleTrialCallback``
    / ``heartbeat_stale_trial_callback``; the old names warn): the new ones where they exist."""
    import optuna

    new = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if new is not None:
        return {"heartbeat_stale_trial_callback": new(max_retry=2)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=2)}


@functools.lru_cache(maxsize=None)
def _quiet_rdb():
    """RDBStorage whose heartbeat thread never prints a traceback: when the database goes away,
    the trial's own next write reports it (:func:`storage_errors`), once; and whose calls are
    never cut short by Ctrl-C (:func:`_whole_calls`). (A class made on first use: Optuna is
    imported lazily.)"""
    import optuna

    class QuietHeartbeatRDB(optuna.storages.RDBStorage):
        def record_heartbeat(self, trial_id: int) -> None:
            try:
                super().record_heartbeat(trial_id)
            except Exception as err:  # noqa: BLE001  (the main thread reports the storage failure)
                log.debug("heartbeat of trial id %s not recorded: %s", trial_id, err)

    return _whole_calls(QuietHeartbeatRDB)


# ------------------------------------------------------------------ Ctrl-C and the storage
# Why: a KeyboardInterrupt raised inside a storage call can land between SQLite's BEGIN IMMEDIATE
# and the rollback SQLAlchemy runs when the connection goes back to its pool ("Exception during
# reset or similar"); the connection then keeps the database's write lock, and every later write
# -- the interrupted trial's FAIL and its "interrupted" mark -- waits out the 60 s busy timeout and
# fails ("database is locked": 2 of 35 Ctrl-C's hung or took 242 s). A storage call now always runs
# to its end: a SIGINT that arrives during one is held and raised as the call returns (a second
# SIGINT while one is held is raised at once: the user insists).
_held = {"depth": 0, "pending": False}  # main thread only: signal handlers run there


def _on_sigint(signum: int, frame: Any) -> None:
    if _held["depth"] > 0 and not _held["pending"]:
        _held["pending"] = True
        return
    _held["pending"] = False
    signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as Python's own handler


def defer_interrupts_in_storage_calls() -> None:
    """Install the SIGINT handler that holds Ctrl-C during storage calls (outside them it is
    Python's own: KeyboardInterrupt at once). Only from the main thread, and only over Python's
    default handler (a handler someone else installed is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


@contextlib.contextmanager
def storage_call() -> Iterator[None]:
    """A storage call that Ctrl-C does not cut short (the module comment above): a SIGINT that
    arrives inside it is raised as KeyboardInterrupt when it returns."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
        if _held["depth"] == 0 and _held["pending"]:
            _held["pending"] = False
            raise KeyboardInterrupt


def _whole_calls(cls: type) -> type:
    """A subclass of the Optuna storage ``cls`` each of whose methods is one :func:`storage_call`
    (reads too: every SQLite transaction takes the write lock here, :func:`_serialize_sqlite`)."""
    import inspect

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def whole(*args: Any, **kwargs: Any) -> Any:
            with storage_call():
                return fn(*args, **kwargs)
        return whole

    methods = {name: wrap(getattr(cls, name)) for name in dir(cls)  # the private ones too: Optuna's
               if not name.startswith("__") and inspect.isfunction(inspect.getattr_static(cls, name))}  # cache calls them
    return type(cls.__name__, (cls,), {**methods, "__module__": __name__, "__doc__": cls.__doc__})


def open_study(storage_url_: str, name: str, space: SearchSpace, num_layers: int, *, sampler=None,
               pruner=None, create: bool = True, must_exist: bool = False, legacy_same: bool = False,
               objective: str = "budget", heartbeat: int | None = None) -> "optuna.Study":
    """Create or load study ``name``; refuse a study made over another space (nothing is changed).

    ``objective``: "budget" (one direction: KL under the budget constraint) or "pareto" (two: KL
    and effective bits); a study made for the other one is refused. ``heartbeat``: see
    :func:`open_storage`.

    A study records the memory accounting of its trials' effective bits (``ATTR_ACCOUNTING``). One
    made before it did counted every layer at the full context: it is adopted when that gives the
    same numbers (``legacy_same``: no sliding-window layer holds fewer tokens at the context) and
    refused otherwise, since its budget constraint and its trials' bits would mix two scales."""
    import optuna

    from kvcalib.layout import ACCOUNTING, LEGACY_ACCOUNTING

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our progress line says what happens
    storage = open_storage(storage_url_, heartbeat=heartbeat)
    fingerprint = space.fingerprint(num_layers)
    directions = ["minimize"] * (2 if objective == "pareto" else 1)
    existing = {s.study_name: s for s in storage.get_all_studies()} if hasattr(storage, "get_all_studies") else {}
    if name in existing and existing[name].user_attrs.get(ATTR_SPACE) is None:
        existing[name] = _await_fingerprint(storage, name, existing[name])
    if name in existing:
        got = existing[name].user_attrs.get(ATTR_SPACE)
        if got != fingerprint:
            raise KvcalibError(
                f"study {name!r} in {storage_url_} was made with another search space (fingerprint {got}, "
                f"this one {fingerprint}): pass the same --space and model, or another --study name. "
                f"{_earlier_default_hint(space, num_layers, got)}The existing study was not changed.")
        got = existing[name].user_attrs.get(ATTR_ACCOUNTING, LEGACY_ACCOUNTING)
        if got != ACCOUNTING and not (got == LEGACY_ACCOUNTING and legacy_same):
            raise KvcalibError(
                f"study {name!r} in {storage_url_} counted effective bits as {got!r} (every layer at the full "
                f"context), which differs on this model's sliding-window layers from today's {ACCOUNTING!r}: "
                "search again in another --out (kvcalib export RUN --budget-bits still reads the old run, converted).")
        got = len(existing[name].directions)
        if got != len(directions):
            raise KvcalibError(
                f"study {name!r} in {storage_url_} was made with --objective {OBJECTIVES[got - 1]}, not {objective}: "
                f"pass --objective {OBJECTIVES[got - 1]} to continue it, or another --study name.")
    elif must_exist:
        raise KvcalibError(f"no study {name!r} in {storage_url_} to resume: drop --resume to start one.")
    elif not create:
        raise KvcalibError(f"no study {name!r} in {storage_url_}.")
    try:
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, sampler=sampler,
                                    pruner=pruner, load_if_exists=True)
    except Exception as err:  # storage errors surface here for lazily-connecting backends
        raise KvcalibError(f"cannot open study {name!r} in {storage_url_}: {type(err).__name__}: {err}") from None
    if existing.get(name) is None or existing[name].user_attrs.get(ATTR_ACCOUNTING) != ACCOUNTING:
        study.set_user_attr(ATTR_ACCOUNTING, ACCOUNTING)  # new, or an old one whose numbers are the same
    if name not in existing:
        study.set_user_attr("space", space.to_dict())
        study.set_user_attr("num_layers", num_layers)
        study.set_user_attr(ATTR_SPACE, fingerprint)  # last: another worker reads it as "attributes written"
    return study


FINGERPRINT_WAIT = 15.0  # seconds a study without its fingerprint is watched before it is called foreign


def _await_fingerprint(storage, name: str, summary):
    """The study summary of ``name`` once its space fingerprint is written, or as it is after
    :data:`FINGERPRINT_WAIT` seconds. Why: a worker creating a shared study writes its attributes
    after the study itself (Optuna cannot do both at once), so a second worker starting at the same
    moment can see the study bare; refusing it as "made with another search space" then killed that
    worker (seen in CI with two workers on PostgreSQL). A study made outside kvcalib never gets one."""
    deadline = time.monotonic() + FINGERPRINT_WAIT
    while summary.user_attrs.get(ATTR_SPACE) is None and time.monotonic() < deadline:
        time.sleep(0.2)
        summary = next((s for s in storage.get_all_studies() if s.study_name == name), summary)
    return summary


# ------------------------------------------------------------------ many workers
def warm_start_done(study: "optuna.Study") -> bool:
    """Whether the study's warm start is over: its points enqueued (or the study made before
    the flag existed already holds trials)."""
    return bool(study.user_attrs.get(ATTR_WARM_DONE)) or len(study.get_trials(deepcopy=False)) > 0


class WarmStartLock:
    """The right to run a shared study's warm start: study ``NAME:warm-start`` in the same
    storage. Creating a study is atomic in every Optuna storage (the name is unique), so exactly
    one worker gets it; its holder beats (user attr ``beat``, wall-clock seconds) from a thread
    every ``heartbeat`` seconds, and a lock silent for ``GRACE_BEATS`` beats is taken over (deleted
    by id, so two waiters cannot both delete and re-take it)."""

    def __init__(self, study: "optuna.Study", heartbeat: int, suffix: str = WARM_LOCK) -> None:
        self.storage, self.name, self.heartbeat = study._storage, study.study_name + suffix, heartbeat
        self.study_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_take(self) -> bool:
        import optuna

        try:
            self.study_id = self.storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], self.name)
        except optuna.exceptions.DuplicatedStudyError:
            return False
        self._beat()
        self._thread = threading.Thread(target=self._beating, name="kvcalib-warm-start-beat", daemon=True)
        self._thread.start()
        return True

    def _beat(self) -> None:
        try:
            self.storage.set_study_user_attr(self.study_id, "beat", time.time())
            self.storage.set_study_user_attr(self.study_id, ATTR_WORKER, worker_name())
        except Exception as err:  # noqa: BLE001  (the main thread meets a broken storage itself)
            log.debug("warm-start lock beat not recorded: %s", err)

    def _beating(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self._beat()

    def take_over_if_stale(self) -> bool:
        """Delete the lock when its holder stopped beating and take it; False otherwise."""
        try:
            held = self.storage.get_study_id_from_name(self.name)
        except KeyError:
            return self.try_take()
        try:
            beat = self.storage.get_study_user_attrs(held).get("beat", 0.0)
        except KeyError:  # its holder released it between the two reads (CI saw it with PostgreSQL)
            return self.try_take()
        if time.time() - float(beat) <= GRACE_BEATS * self.heartbeat:
            return False
        log.warning("the worker holding %s stopped beating %.0f s ago: taking it over", self.name,
                    time.time() - float(beat))
        try:
            self.storage.delete_study(held)
        except KeyError:  # another waiter deleted it first; it may hold a new lock now
            pass
        return self.try_take()

    @contextlib.contextmanager
    def held(self) -> Iterator["WarmStartLock"]:
        """The lock while the body runs, released after it whether it succeeds or fails."""
        try:
            yield self
        finally:
            self.release()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.study_id is not None:
            with contextlib.suppress(KeyError):
                self.storage.delete_study(self.study_id)
            self.study_id = None


def claim_warm_start(study: "optuna.Study", shared: bool, heartbeat: int, *, poll: float = 0.5,
                     on_wait: Callable[[], None] | None = None) -> WarmStartLock | None:
    """A lock when this process must run the warm start of ``study``; None when it is done
    (by another worker, or earlier). In a ``shared`` storage a worker that finds the lock held
    waits (``on_wait`` once) until the holder is done, or takes it over when the holder stopped."""
    if warm_start_done(study):
        return None
    lock = WarmStartLock(study, heartbeat)
    if not shared:  # the run folder's own study: nobody else works on it
        return lock
    if lock.try_take():
        if warm_start_done(study):  # finished between our check and the lock
            lock.release()
            return None
        return lock
    waited = False
    while not warm_start_done(study):
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        if lock.take_over_if_stale():
            if warm_start_done(study):
                lock.release()
                return None
            return lock
        time.sleep(poll)
    return None


def recover_shared(study: "optuna.Study", heartbeat: int) -> list[int]:
    """:func:`recover_interrupted` for a shared study (RUNNING trials are left to the
    heartbeats), by one worker at a time: workers that start together would each re-enqueue the
    same failed trials. A worker that finds the lock held skips it: the holder does the work."""
    lock = WarmStartLock(study, heartbeat, RECOVER_LOCK)
    if not lock.try_take() and not lock.take_over_if_stale():
        return []
    try:
        return recover_interrupted(study, running=False)
    finally:
        lock.release()


def _storage_failure(err: BaseException) -> BaseException | None:
    """The innermost storage error in ``err``'s chain (SQLAlchemy, a DB driver, sqlite3, Optuna's
    ``StorageInternalError``), or None. Optuna's trial bookkeeping can fail with another error
    (an AssertionError, an UnboundLocalError) while handling the storage's, so the context chain
    is followed too."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return innermost_storage_error(seen)  # the driver's own words beat Optuna's wrapper's


@contextlib.contextmanager
def storage_errors(url: str, resume_hint: str) -> Iterator[None]:
    """Turn a storage that fails mid-search into one :class:`KvcalibError`: what failed, that the
    finished trials are kept (each is committed when it finishes), and how to go on."""
    try:
        yield
    except KvcalibError:
        raise
    except Exception as err:
        inner = _storage_failure(err)
        if inner is None:
            raise
        from kvcalib.optimize.provenance import describe_storage

        first = (str(inner).strip().splitlines() or [type(inner).__name__])[0][:160]
        where = describe_storage(url)
        if "disk is full" in first or "No space left" in first:
            raise StorageFailed(f"no space left on the device holding the study's database ({where}); every "
                                "finished trial is kept", f"free some space, then {resume_hint}.") from None
        if "not a database" in first or "malformed" in first:  # the file itself was overwritten
            raise StorageFailed(f"the study storage failed: {where} is corrupt ({type(inner).__name__}: {first}) "
                                "and its trials are lost with it",
                                "restore it from a copy, or start a new search with another --out.") from None
        raise StorageFailed(f"the study storage {where} failed mid-search ({type(inner).__name__}: {first}): every "
                            "finished trial is kept there",
                            f"once it is reachable again, {resume_hint} (the trial that was running is retried).") from None


def drain(study: "optuna.Study", fn: Callable, *, poll: float = 1.0, callbacks: tuple[Callable, ...] = (),
          on_wait: Callable[[int], None] | None = None, settle: float = 0.0) -> int:
    """After this worker's share of the trials: wait until the study is quiet -- no trial running,
    no retry waiting -- failing heartbeat-stale trials (their retries are enqueued by the storage's
    callback) and running the retries here. Every worker's outputs then report the same trials.
    Returns the number of retries this worker ran.

    ``settle`` (seconds; a study other workers share): quiet must hold over that long with no new
    trial. Another worker that checked the budget just before this one's last trial finished
    starts one more trial a moment later; a single look can fall between its check and its ask
    (then two run folders reported different trials: a CI run of the two-worker PostgreSQL test)."""
    import optuna
    from optuna.storages import fail_stale_trials
    from optuna.storages._heartbeat import is_heartbeat_enabled

    state = optuna.trial.TrialState
    ran = 0
    seen = None  # trials in the study when it was last found quiet (None: not quiet yet)
    while True:
        if is_heartbeat_enabled(study._storage):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                fail_stale_trials(study)
        trials = study.get_trials(deepcopy=False, states=(state.RUNNING, state.WAITING))
        retries = [t for t in trials if t.state == state.WAITING and t.system_attrs.get("failed_trial") is not None]
        if retries:  # Optuna runs the oldest waiting trial first: the retry comes within a few
            study.optimize(fn, n_trials=1, callbacks=list(callbacks), catch=(), gc_after_trial=False)
            ran += 1
            continue
        running = [t for t in trials if t.state == state.RUNNING]
        if not running or not is_heartbeat_enabled(study._storage):
            # quiet (without heartbeats, a journal file, a RUNNING trial may be a dead worker's: no wait)
            if settle <= 0:  # a lone study: no other worker can start a trial
                return ran
            count = len(study.get_trials(deepcopy=False))
            if count == seen:
                return ran
            seen = count
            time.sleep(settle)
            continue
        seen = None
        if on_wait is not None:
            on_wait(len(running))
        time.sleep(poll)


ATTR_INTERRUPTED = "interrupted"  # user attr of a trial stopped by Ctrl-C / SIGINT
ATTR_ERROR = "error"  # user attr of a trial whose objective raised
ATTR_RECOVERED = "recovered_from"  # user attr of a re-enqueued trial: the number it retries
ATTR_REQUEUED = "requeued"  # user attr of a WAITING trial moved behind the retries (it never ran)


def recover_interrupted(study: "optuna.Study", *, running: bool = True) -> list[int]:
    """Re-enqueue the points of trials an interrupted search left unfinished; returns their numbers.

    - FAIL trials (Ctrl-C / SIGINT mark the running trial FAIL, as does an exception in the
      objective) are retried once: a trial that already has a retry (a trial whose user attr
      ``recovered_from`` names it) is skipped, and so is a failed retry whose objective raised
      an error (the point itself fails, not the interruption).
    - RUNNING trials (the process was killed) are marked FAIL first, then retried; only with
      ``running=True``, for a study this process owns (the default run-folder storage): in a
      shared study a RUNNING trial may belong to a live worker.

    The retry gets the failed trial's parameters as fixed parameters (its enqueued parameters
    when it failed before sampling) and its user attrs (warm start, local move). Optuna's
    ``enqueue_trial(skip_if_exists=True)`` cannot be used: it finds the failed trial itself.

    Retries run first. Optuna runs WAITING trials oldest first, so with ``running=True`` (a
    study nobody else works on) the points still waiting from before (warm start, local moves)
    are enqueued again behind the retries and their old WAITING entries are closed (FAIL, user
    attr ``requeued``; :func:`trial_records` leaves them out). Otherwise a resumed search that
    needs only a few more trials could spend them all on the older queue and never retry the
    interrupted point. In a shared study retries keep Optuna's order (another worker may be
    taking a WAITING trial at this moment).
    """
    import optuna

    state = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    retried = {retry_of(t) for t in trials if retry_of(t) is not None}
    out: list[int] = []
    waiting = [t for t in trials if t.state == state.WAITING]
    for t in trials:
        if t.state == state.RUNNING and running:
            study._storage.set_trial_state_values(t._trial_id, state.FAIL)
        elif t.state != state.FAIL:
            continue
        if t.number in retried or t.user_attrs.get(ATTR_REQUEUED):
            continue
        if retry_of(t) is not None and t.user_attrs.get(ATTR_ERROR):
            log.warning("trial %d (a retry of trial %d) failed again with %s: not retried", t.number,
                        retry_of(t), t.user_attrs[ATTR_ERROR])
            continue
        params = {**t.system_attrs.get("fixed_params", {}), **t.params}
        if not params:  # failed before any parameter was fixed: nothing of it to keep
            continue
        attrs = {k: v for k, v in t.user_attrs.items()
                 if k not in ("effective_bits", ATTR_INTERRUPTED, ATTR_ERROR, ATTR_RECOVERED, ATTR_WORKER,
                              ATTR_KL_ORDINARY, ATTR_KL_COPY)}  # what the retry measures again
        study.enqueue_trial(params, user_attrs={**attrs, ATTR_RECOVERED: t.number})
        out.append(t.number)
    if out and running:
        for w in waiting:
            study.enqueue_trial(dict(w.system_attrs.get("fixed_params", {})), user_attrs=dict(w.user_attrs))
            study._storage.set_trial_user_attr(w._trial_id, ATTR_REQUEUED, True)
            study._storage.set_trial_state_values(w._trial_id, state.FAIL)
    return out


def retry_of(trial) -> int | None:
    """The number of the trial ``trial`` retries: ours (user attr ``recovered_from``, by
    :func:`recover_interrupted`) or Optuna's (system attr ``failed_trial``, by the
    ``RetryFailedTrialCallback`` of a heartbeat-stale trial); None for a first run."""
    mine = trial.user_attrs.get(ATTR_RECOVERED)
    return mine if mine is not None else trial.system_attrs.get("failed_trial")


def _has_set_constraint() -> bool:
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")  # Optuna >= 5; constraints_func before


def set_bits(trial, bits: float, budget: float | None) -> None:
    """Record a trial's effective bits and its budget constraint (feasible when bits - budget <= 0;
    ``budget`` None: no constraint, the Pareto mode)."""
    trial.set_user_attr("effective_bits", float(bits))
    if budget is not None and _has_set_constraint():
        trial.set_constraint("budget_bits", float(bits) - budget)


def trial_seed(seed: int, number: int) -> int:
    """The sampler seed of trial ``number`` (:class:`TrialSeededTPE`)."""
    return (seed * 1_000_003 + number * 7_919 + 1) % 2**32


@functools.lru_cache(maxsize=None)
def _trial_seeded_tpe():
    import optuna

    class TrialSeededTPE(optuna.samplers.TPESampler):
        """TPE whose random state is reset from (seed, trial number) before each trial: what it
        proposes depends on the trials finished before, never on the worker that asks, so two
        workers never draw the same random point and one worker repeats itself exactly."""

        def __init__(self, *args, seed: int = 0, **kwargs) -> None:
            super().__init__(*args, seed=seed, **kwargs)
            self._base_seed = seed

        def before_trial(self, study, trial) -> None:
            s = trial_seed(self._base_seed, trial.number)
            self._rng.rng.seed(s)  # TPE's own draws (the EI candidates)
            self._random_sampler._rng.rng.seed(s)  # the startup trials' and independent draws
            super().before_trial(study, trial)

    return TrialSeededTPE


def make_sampler(seed: int, budget: float, n_startup: int, objective: str = "budget"):
    """TPE over the space (seeded per trial, :class:`TrialSeededTPE`; ``constant_liar`` so that
    parallel workers do not propose next to each other's running trials): with the budget as a
    constraint, or, for ``objective="pareto"``, multi-objective TPE on (KL, effective bits)."""
    kwargs: dict[str, Any] = {}
    if objective == "budget" and not _has_set_constraint():
        def constraints(trial) -> list[float]:
            bits = trial.user_attrs.get("effective_bits")
            return [float(bits) - budget if bits is not None else 1.0]

        kwargs["constraints_func"] = constraints
    import warnings

    import optuna

    with warnings.catch_warnings():  # multivariate / constant_liar are "experimental" in Optuna
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _trial_seeded_tpe()(seed=seed, n_startup_trials=max(1, n_startup), multivariate=True,
                                   constant_liar=True, **kwargs)


def make_pruner(n_steps: int, margin: float = PRUNE_MARGIN):
    """Prune a trial that a finished trial with no more bits beats by ``margin`` on the same sequences."""
    import optuna

    class ParetoPruner(optuna.pruners.BasePruner):
        def prune(self, study, trial) -> bool:
            step = trial.last_step
            bits = trial.user_attrs.get("effective_bits")
            if step is None or bits is None or step >= n_steps - 1:
                return False
            value = trial.intermediate_values[step]
            for other in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
                ob, ov = other.user_attrs.get("effective_bits"), other.intermediate_values.get(step)
                if ob is not None and ov is not None and ob <= bits + 1e-9 and ov * margin < value:
                    return True
            return False

    return ParetoPruner()


# ------------------------------------------------------------------ warm start
def floor_bits(objective: "SearchObjective", space: SearchSpace) -> float:
    """Effective bits of the cheapest point of the space: every layer at the fewest bits, the
    cheapest schedule (schedule tiers counted), no method switch, or every switch of the space
    that saves bytes (``Method.saves_bytes``: 8-bit scale pairs) on every layer (their tables
    fitted for it)."""
    return min(objective.effective_bits(p, with_tensors="layers") for p in floor_points(objective.info.num_layers, space))


def floor_points(num_layers: int, space: SearchSpace) -> list:
    """The candidates for the space's cheapest point (:func:`floor_bits`): the floor point of every
    schedule, without method switches and with every byte-saving switch on every layer."""
    from dataclasses import replace

    from kvcalib.methods import registry

    points = [space.floor_point(num_layers, s) for s in space.schedules]
    savers = tuple(m for m in space.layer_methods if registry()[m].saves_bytes)
    if savers:
        points += [replace(p, methods=(savers,) * num_layers) for p in points]
    return points


def sensitivity_sweep(objective: "SearchObjective", space: SearchSpace,
                      on_layer: Callable[[int], None] | None = None) -> list[float]:
    """The objective on the first scoring window (and the first copy window, where the search has
    them: :attr:`SearchObjective.sweep_sequences`) with one layer at the fewest bits (K and V) and
    every other layer uncompressed."""
    from kvcalib.layout import LayerConfig

    floor = space.floor_point(objective.info.num_layers)
    low = floor.layer_configs()[0]
    out = []
    for i in range(objective.info.num_layers):
        configs = [LayerConfig(k_axis=space.k_axis)] * objective.info.num_layers
        configs[i] = low
        out.append(objective.kl_configs(configs, None, sequences=objective.sweep_sequences))
        if on_layer is not None:
            on_layer(i)
    return out


def greedy_point(objective: "SearchObjective", space: SearchSpace, sensitivity: list[float], budget: float,
                 methods: tuple[str, ...] = (), schedule: str | None = None, sinks: int | None = None) -> Point:
    """Bits to the (layer, side) with the largest estimated KL saving while the budget holds
    (``sinks``: the point's sinks, default the space's fewest)."""
    n = objective.info.num_layers
    base = space.floor_point(n, schedule)
    if sinks is not None:
        base = Point(base.group, base.window, sinks, base.k_bits, base.v_bits, base.methods, base.k_axis,
                     base.schedule)
    levels = list(space.bits)
    k = [0] * n
    v = [0] * n

    def point(k_, v_):
        return Point(base.group, base.window, base.sinks, tuple(levels[x] for x in k_), tuple(levels[x] for x in v_),
                     (methods,) * n, space.k_axis, base.schedule)

    def saving(i: int, lvl: int) -> float:
        if lvl + 1 >= len(levels):
            return -1.0
        b0, b1 = levels[lvl], levels[lvl + 1]
        return 0.5 * sensitivity[i] * (4.0 ** -(b0 - levels[0]) - 4.0 ** -(b1 - levels[0])) / (b1 - b0)

    blocked: set[tuple[int, str]] = set()
    while True:
        cands = [(saving(i, k[i]), i, "k") for i in range(n) if (i, "k") not in blocked] + \
                [(saving(i, v[i]), i, "v") for i in range(n) if (i, "v") not in blocked]
        cands = [c for c in cands if c[0] > 0]
        if not cands:
            break
        _, i, side = max(cands)
        trial_k, trial_v = list(k), list(v)
        (trial_k if side == "k" else trial_v)[i] += 1
        if objective.effective_bits(point(trial_k, trial_v), with_tensors="layers") <= budget - 1e-3:
            k, v = trial_k, trial_v
        else:
            blocked.add((i, side))
    return point(k, v)


def warm_start_points(objective: "SearchObjective", space: SearchSpace, sensitivity: list[float],
                      budget: float) -> list[Point]:
    """Distinct warm-start points: greedy at the budget for every method set (all the space's
    switches on every layer, none, and with two or more switches each one alone) at the space's
    fewest and most sinks, each schedule, below and above the budget, and the floor.

    Why each method alone and the most sinks: on SmolLM2-135M at 8k tokens (8,192-token scoring
    windows, 3.0 bits, H100, 2026-11-26) the greedy point with clipping on every layer scored KL
    0.384 and with none 0.119, with clipping and rotation 0.251: a warm start of all-or-nothing
    never showed the sampler rotation alone, and 40 trials turned it on in 2 of 30 layers. Four
    sinks at the same bits took 0.119 -> 0.080 (the sinks cost ~0.01 bits at that length), found
    only by a local move at trial 11."""
    n = objective.info.num_layers
    all_methods = tuple(space.layer_methods)
    floor = space.floor_point(n)
    floor = Point(floor.group, floor.window, floor.sinks, floor.k_bits, floor.v_bits, (all_methods,) * n, floor.k_axis,
                  floor.schedule)
    floor_bits = objective.effective_bits(floor, with_tensors="layers")
    method_sets = [all_methods] + ([()] if all_methods else []) + \
        ([(m,) for m in all_methods] if len(all_methods) > 1 else [])
    # the most sinks may not fit at all: at 2,048 tokens, 4 sinks leave a partial group of 60
    # tokens in full precision (0.36 bits) that no sink-free layout holds
    pts = [p for methods in method_sets for sinks in sorted({min(space.sinks), max(space.sinks)})
           if (p := fit_to_budget(greedy_point(objective, space, sensitivity, budget, methods, sinks=sinks),
                                  objective, space, sensitivity, budget)) is not None]
    for schedule in space.schedules[1:]:
        pts.append(greedy_point(objective, space, sensitivity, budget, all_methods, schedule))
    pts.append(floor)
    for b in (floor_bits + 0.5 * (budget - floor_bits), budget + 1.0):
        pts.append(greedy_point(objective, space, sensitivity, b, all_methods))
    out: list[Point] = []
    for p in pts:
        if p not in out:
            out.append(p)
    return out


def front_warm_start_points(objective: "SearchObjective", space: SearchSpace, sensitivity: list[float],
                            low: float, high: float, count: int = 6) -> list[Point]:
    """Distinct warm-start points of the Pareto mode: the floor, then the greedy allocation
    (methods on, and off when the space has any) at ``count`` budgets spread evenly over
    (``low``, ``high``], so the front starts covering the whole bits range."""
    n = objective.info.num_layers
    all_methods = tuple(space.layer_methods)
    floor = space.floor_point(n)
    pts = [Point(floor.group, floor.window, floor.sinks, floor.k_bits, floor.v_bits, (all_methods,) * n,
                 floor.k_axis, floor.schedule)]
    for j in range(1, count + 1):
        b = low + (high - low) * j / count
        pts.append(greedy_point(objective, space, sensitivity, b, all_methods))
        if all_methods and j % 2 == 0:
            pts.append(greedy_point(objective, space, sensitivity, b, ()))
    out: list[Point] = []
    for p in pts:
        if p not in out:
            out.append(p)
    return out


def enqueue(study: "optuna.Study", points: list[Point], space: SearchSpace, attrs: dict[str, Any] | None = None) -> None:
    """Queue ``points`` (the warm start's; ``attrs``: the trials' user attributes, default a
    warm-start mark); a point the study already holds is not queued again."""
    for p in points:
        study.enqueue_trial(point_params(p, space), user_attrs=attrs or {"warm_start": True}, skip_if_exists=True)


def replay_points(path: str | Path, space: SearchSpace, num_layers: int | None = None) -> list[Point]:
    """The points of the finished (complete and pruned) trials of an earlier run's ``search.json``
    (``path``: the file or its run folder), in its trial order, each checked against ``space``
    (and ``num_layers``, once the model is known). Raises KvcalibError naming the problem."""
    path = Path(path)
    if path.is_dir():
        path = path / "search.json"
    hint = "pass an earlier `kvcalib search` run folder (or its search.json) made over this search space"
    if not path.is_file():
        raise KvcalibError(f"--points-from {path}: no such file: {hint}.")
    try:
        doc = json.loads(path.read_text())
        records = [t for t in doc["trials"] if t.get("state") in ("COMPLETE", "PRUNED") and t.get("point")]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise KvcalibError(f"--points-from {path}: not a search.json ({type(err).__name__}: {err}): {hint}.") from None
    if not records:
        raise KvcalibError(f"--points-from {path}: the run holds no finished trial: {hint}.")
    points = []
    for rec in sorted(records, key=lambda t: t.get("number", 0)):
        try:
            point = Point.from_dict(rec["point"], space)
        except (KeyError, TypeError, ValueError) as err:
            raise KvcalibError(f"--points-from {path}: trial {rec.get('number')} has no readable point ({err}): {hint}.") from None
        why = _outside(point, space, num_layers)
        if why:
            raise KvcalibError(f"--points-from {path}: trial {rec.get('number')} is outside this search: {why}; {hint}.")
        points.append(point)
    return points


def _outside(point: Point, space: SearchSpace, num_layers: int | None) -> str | None:
    """Why ``point`` is not a point of ``space`` (None: it is)."""
    for name, value, allowed in (("group", point.group, space.groups), ("window", point.window, space.windows),
                                 ("sinks", point.sinks, space.sinks), ("schedule", point.schedule, space.schedules)):
        if value not in allowed:
            return f"{name} {value!r} is not one of {list(allowed)}"
    if point.k_axis != space.k_axis:
        return f"keys quantized per {point.k_axis}, this space per {space.k_axis}"
    bad = sorted({b for b in point.k_bits + point.v_bits if b not in space.bits})
    if bad:
        return f"bits {bad} are not in {list(space.bits)}"
    methods = sorted({m for layer in point.methods for m in layer if m not in space.layer_methods})
    if methods:
        return f"methods {methods} are not in {list(space.layer_methods)}"
    if num_layers is not None and (len(point.k_bits) != num_layers or len(point.v_bits) != num_layers):
        return f"{len(point.k_bits)} layers, this model has {num_layers}"
    return None


def local_move(best: Point, space: SearchSpace, sensitivity: list[float] | None, budget: float,
               bits_of: Callable[[Point], float], rng) -> Point:
    """A neighbour of the incumbent ``best`` that fits the budget.

    One move (bits to a sensitive layer side, a method switch, or a global setting), then a
    repair that takes bits from the least sensitive sides until the budget holds. This keeps
    trials near the budget, where per-layer random sampling of 60+ categorical parameters
    would almost never land (their average is far above a tight budget).
    """
    n = len(best.k_bits)
    sens = list(sensitivity) if sensitivity else [1.0] * n
    levels = list(space.bits)
    k = [levels.index(b) for b in best.k_bits]
    v = [levels.index(b) for b in best.v_bits]
    methods = [set(m) for m in (best.methods or ((),) * n)]
    group, window, sinks, schedule = best.group, best.window, best.sinks, best.schedule
    move = rng.random()
    if move < 0.6 or not space.layer_methods:  # upgrade a side, chosen in proportion to sensitivity
        for _ in range(1 + int(rng.random() < 0.3)):
            i = rng.choices(range(n), weights=[s + 1e-12 for s in sens])[0]
            side = k if rng.random() < 0.5 else v
            side[i] = min(side[i] + 1, len(levels) - 1)
    elif move < 0.85:
        i = rng.randrange(n)
        m = rng.choice(space.layer_methods)
        methods[i] ^= {m}
    else:
        which = rng.choice(["group", "window", "sinks"] + (["schedule"] if space.searches_schedule else []))
        if which == "group":
            group = rng.choice(space.groups)
        elif which == "window":
            window = rng.choice(space.windows)
        elif which == "sinks":
            sinks = rng.choice(space.sinks)
        else:
            schedule = rng.choice(space.schedules)

    def make() -> Point:
        return Point(group, window, sinks, tuple(levels[x] for x in k), tuple(levels[x] for x in v),
                     tuple(tuple(m for m in space.layer_methods if m in ms) for ms in methods), space.k_axis,
                     schedule)

    return lower_to_budget(make, k, v, sens, budget, bits_of, rng.random)


def lower_to_budget(make: Callable[[], Point], k: list[int], v: list[int], sensitivity: list[float], budget: float,
                    bits_of: Callable[[Point], float], tiebreak: Callable[[], float]) -> Point:
    """Repair: lower (in place) the level index of the side with the least sensitivity per
    level, in ``k`` / ``v`` (per layer), until ``bits_of(make())`` fits the budget or every side
    is at the fewest bits; returns ``make()`` (it may still be over the budget)."""
    for _ in range(4 * len(k)):
        if bits_of(make()) <= budget - 1e-3:
            break
        cands = [(sensitivity[i] * 4.0 ** -(lv), i, side) for side in (k, v) for i, lv in enumerate(side) if lv > 0]
        if not cands:
            break
        _, i, side = min(cands, key=lambda c: (c[0], tiebreak()))
        side[i] -= 1
    return make()


def fit_to_budget(point: Point, objective: "SearchObjective", space: SearchSpace, sensitivity: list[float],
                  budget: float) -> Point | None:
    """``point`` with bits taken from its least sensitive sides until its effective bits with
    every fitted tensor fit the budget; None when its settings (sinks, window, methods) do not
    fit at the fewest bits. The greedy allocation fits only the whole-layer tensors and plans the
    per-side ones (cheap: :meth:`SearchObjective.effective_bits`); what the runtime derives from
    them (a rotation's signs: 0.016 bits at 2,048 tokens) could still put it over."""
    levels = list(space.bits)
    k = [levels.index(b) for b in point.k_bits]
    v = [levels.index(b) for b in point.v_bits]

    def make() -> Point:
        return Point(point.group, point.window, point.sinks, tuple(levels[x] for x in k), tuple(levels[x] for x in v),
                     point.methods, point.k_axis, point.schedule)

    out = lower_to_budget(make, k, v, list(sensitivity), budget, objective.effective_bits, lambda: 0.0)
    return out if objective.effective_bits(out) <= budget - 1e-3 else None


def make_local_callback(objective: "SearchObjective", space: SearchSpace, budget: float, seed: int,
                        fraction: float = 0.7, pareto: bool = False) -> Callable:
    """After each finished trial, enqueue (with probability ``fraction``) a neighbour of the best
    feasible trial (``pareto``: of a random member of the front, repaired to its own bits, so the
    move tries to lower KL at that memory); the sampler (TPE) proposes the rest. The draws are
    seeded by (seed, trial number), like the sampler's: workers sharing a study draw apart."""
    import random

    import optuna

    n = objective.info.num_layers

    def callback(study: "optuna.Study", trial) -> None:
        rng = random.Random(trial_seed(seed, trial.number))
        if rng.random() >= fraction:
            return
        done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.values is not None and t.user_attrs.get("effective_bits") is not None]
        if pareto:
            records = [{"number": t.number, "state": "COMPLETE", "kl": t.values[0],
                        "effective_bits": t.user_attrs["effective_bits"]} for t in done]
            front = set(pareto_front(records))
            members = [t for t in done if t.number in front]
            if not members:
                return
            best = rng.choice(members)
            target = float(best.user_attrs["effective_bits"]) + 2e-3  # the repair keeps it at these bits
        else:
            feasible = [t for t in done if t.user_attrs["effective_bits"] <= budget + 1e-9]
            if not feasible:
                return
            best = min(feasible, key=lambda t: t.values[0])
            target = budget
        incumbent = Point.from_params(best.params, space, n)
        seen = {tuple(sorted(t.params.items())) for t in study.get_trials(deepcopy=False)}
        sens = study.user_attrs.get("sensitivity")
        def bits_of(q: Point) -> float:
            return objective.effective_bits(q, with_tensors="layers")

        for _ in range(20):
            p = local_move(incumbent, space, sens, target, bits_of, rng)
            params = point_params(p, space)
            # a move the repair cannot bring under the budget (more sinks, a smaller group or a
            # longer window at a short context) would be a trial spent over it: draw another.
            # Before, 8 of 30 trials of a 2,048-token search were such moves (SmolLM2, CPU).
            if bits_of(p) <= target - 1e-3 and tuple(sorted(params.items())) not in seen:
                study.enqueue_trial(params, user_attrs={"local_move": best.number})
                return

    return callback


# ------------------------------------------------------------------ running
def worker_name() -> str:
    """``host:pid``: which worker ran a trial (trial user attr ``worker``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def make_objective_fn(objective: "SearchObjective", space: SearchSpace, budget: float,
                      mode: str = "budget") -> Callable:
    """The trial function: KL of the sampled point (pruned when Pareto-dominated so far), or for
    ``mode="pareto"`` the pair (KL, effective bits), unpruned."""
    import optuna

    n = objective.info.num_layers
    pareto = mode == "pareto"

    def fn(trial: "optuna.Trial"):
        point = space.sample(trial, n)
        bits = objective.effective_bits(point)
        set_bits(trial, bits, None if pareto else budget)
        trial.set_user_attr(ATTR_WORKER, worker_name())
        if pareto:  # Optuna cannot report or prune multi-objective trials
            return record_parts(trial, objective.parts(point)), float(bits)

        def report(step: int, value: float) -> None:
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()

        return record_parts(trial, objective.parts(point, report=report))

    return tag_failures(fn)


def record_parts(trial, parts: "KLParts") -> float:
    """The trial's objective value; its ordinary and copy KL kept apart in its user attrs
    (``kl_ordinary``, ``kl_copy``: :func:`trial_records` reports them)."""
    trial.set_user_attr(ATTR_KL_ORDINARY, parts.ordinary)
    if parts.copy is not None:
        trial.set_user_attr(ATTR_KL_COPY, parts.copy)
    return parts.value


def tag_failures(fn: Callable) -> Callable:
    """Wrap an objective so a failed trial records why (:func:`recover_interrupted` reads it):
    user attr ``interrupted`` for KeyboardInterrupt (Ctrl-C, SIGINT), ``error`` for an exception.
    Optuna then marks the trial FAIL and re-raises, as without the wrapper."""
    import optuna

    def wrapped(trial: "optuna.Trial"):
        try:
            return fn(trial)
        except optuna.TrialPruned:
            raise
        except KeyboardInterrupt:
            _try_set_attr(trial, ATTR_INTERRUPTED, True)
            raise
        except Exception as err:
            _try_set_attr(trial, ATTR_ERROR, f"{type(err).__name__}: {err}"[:500])
            raise

    return wrapped


def _try_set_attr(trial, key: str, value: Any) -> None:
    try:
        trial.set_user_attr(key, value)
    except Exception as err:  # the storage itself may be what failed: keep the original error
        log.debug("could not record %s on trial %s: %s", key, getattr(trial, "number", "?"), err)


def finished_count(study: "optuna.Study", trials: Sequence[Any] | None = None) -> int:
    """Complete and pruned trials of the study (counted in ``trials`` when the caller read them already)."""
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    if trials is not None:
        return sum(t.state in states for t in trials)
    return len(study.get_trials(deepcopy=False, states=states))


def run_trials(study: "optuna.Study", fn: Callable, n_trials: int, *, timeout: float | None = None,
               on_trial: Callable[["optuna.Study", Any], None] | None = None,
               extra_callbacks: tuple[Callable, ...] = ()) -> None:
    """Run until the study holds ``n_trials`` finished (complete + pruned) trials, all workers together."""
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    left = n_trials - finished_count(study)
    if left <= 0:
        return
    callbacks = [optuna.study.MaxTrialsCallback(n_trials, states=states), *extra_callbacks]
    if on_trial is not None:
        callbacks.append(on_trial)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(fn, n_trials=left, timeout=timeout, callbacks=callbacks, catch=(), gc_after_trial=False)


def trial_records(study: "optuna.Study", space: SearchSpace, num_layers: int, budget: float) -> list[dict[str, Any]]:
    """Every trial: number, state, KL (value or last intermediate), effective bits, point."""
    out = []
    import optuna

    for t in study.get_trials(deepcopy=False):
        if t.state == optuna.trial.TrialState.WAITING:  # enqueued, not run yet (a resume runs it)
            continue
        if t.user_attrs.get(ATTR_REQUEUED):  # a waiting entry moved behind a retry: never ran
            continue
        bits = t.user_attrs.get("effective_bits")
        kl = t.values[0] if t.values is not None else (t.intermediate_values[t.last_step] if t.last_step is not None else None)
        try:
            point = Point.from_params(t.params, space, num_layers).to_dict()
        except KeyError:
            point = None
        out.append({"number": t.number, "state": t.state.name, "kl": kl,
                    "kl_ordinary": t.user_attrs.get(ATTR_KL_ORDINARY), "kl_copy": t.user_attrs.get(ATTR_KL_COPY),
                    "effective_bits": bits,
                    "feasible": bits is not None and bits <= budget + 1e-9,
                    "sequences": len(t.intermediate_values), "warm_start": bool(t.user_attrs.get("warm_start")),
                    "local_move_of": t.user_attrs.get("local_move"), "recovered_from": retry_of(t),
                    "worker": t.user_attrs.get(ATTR_WORKER),
                    "started": t.datetime_start.isoformat() if t.datetime_start else None,
                    "finished": t.datetime_complete.isoformat() if t.datetime_complete else None,
                    "seconds": t.duration.total_seconds() if t.duration else None, "point": point})
    return out


def pareto_front(records: list[dict[str, Any]]) -> list[int]:
    """Numbers of the complete trials no other complete trial beats in both bits and KL (by bits)."""
    done = sorted((r for r in records if r["state"] == "COMPLETE" and r["kl"] is not None and r["effective_bits"] is not None),
                  key=lambda r: (r["effective_bits"], r["kl"]))
    front, best = [], math.inf
    for r in done:
        if r["kl"] < best:
            front.append(r["number"])
            best = r["kl"]
    return front


def choose(records: list[dict[str, Any]], budget: float | None = None, trial: int | None = None) -> dict[str, Any]:
    """The lowest-KL complete trial at or under ``budget``, or trial number ``trial``."""
    done = [r for r in records if r["state"] == "COMPLETE" and r["kl"] is not None and r["point"] is not None]
    if trial is not None:
        for r in records:
            if r["number"] == trial:
                if r not in done:
                    raise KvcalibError(f"trial {trial} is {r['state']}, not complete: pick a complete trial "
                                       f"({', '.join(str(d['number']) for d in done[:20])}...)")
                return r
        raise KvcalibError(f"there is no trial {trial}: the study holds trials 0..{len(records) - 1}")
    assert budget is not None
    ok = [r for r in done if r["effective_bits"] <= budget + 1e-9]
    if not ok:
        lowest = min((r["effective_bits"] for r in done), default=None)
        raise KvcalibError(f"no complete trial is at or under {budget} effective bits"
                           + (f" (the cheapest has {lowest:.3f}): raise the budget or search more" if lowest else ""))
    return min(ok, key=lambda r: (r["kl"], r["effective_bits"]))
