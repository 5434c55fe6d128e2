"""A throw-away PostgreSQL server for tests: ``initdb`` into a temporary folder, ``pg_ctl`` start and
stop, listening on 127.0.0.1 only (and a Unix socket inside its folder), trust authentication.

Debian's ``postgresql`` package puts the binaries in ``/usr/lib/postgresql/VERSION/bin`` (not on
PATH); ``.ci/run`` installs it. PostgreSQL refuses to run as root, so as root the server runs as
the ``postgres`` user the package creates (``runuser -u postgres``), in a folder it owns.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_bindir() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``: on PATH, else Debian's newest version."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(os.path.realpath(on_path)).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def unavailable_reason() -> str | None:
    """Why no test server can start here (None when it can)."""
    if find_bindir() is None:
        return ("PostgreSQL binaries not found (initdb/pg_ctl on PATH or /usr/lib/postgresql/*/bin): "
                "install Debian's `postgresql` package, as .ci/run does")
    try:
        import psycopg  # noqa: F401  (SQLAlchemy 2.1 reads postgresql:// with psycopg 3)
    except ImportError:
        return "the psycopg driver is not installed: pip install 'psycopg[binary]' (the test extras have it)"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root and `runuser` is missing"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One server in a temporary folder. ``start()``/``stop()`` may be called again (a stop
    mid-search, then a restart keeps the data)."""

    def __init__(self) -> None:
        self.bindir = find_bindir()
        assert self.bindir is not None
        self.root = Path(tempfile.mkdtemp(prefix="kvcalib-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:  # the server's user must own its folder (and reach it)
            import pwd

            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            os.chmod(self.root, 0o700)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / tool), *args]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"  # psycopg 3, whatever SQLAlchemy's default driver

    def start(self) -> None:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=100"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60",
                  "-o", opts, "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def close(self) -> None:
        if self.running():
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def wait_for(predicate, timeout: float, poll: float = 0.2, what: str = "condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
