"""A throwaway PostgreSQL server: the one place that starts one, for the tests and the benchmarks.

``tests/conftest.py``'s ``postgres_url`` fixture and ``benchmarks/store_load.py`` both use
``temporary_postgres()``: initdb into a temp folder, trust auth, listening on a free port on
127.0.0.1 only, stopped and deleted on exit. initdb refuses to run as root, so as root the
server runs as the ``postgres`` user (via runuser). Standard library only, so a benchmark can
import it without pytest.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PG_BIN_DIRS = ("/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/15/bin",
               "/usr/lib/postgresql/14/bin")


def pg_bin(name: str) -> str | None:
    """``name`` (initdb, pg_ctl) on PATH, else in the newest /usr/lib/postgresql/*/bin."""
    found = shutil.which(name)
    if found:
        return found
    for d in PG_BIN_DIRS:
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def unavailable() -> str | None:
    """Why no server can be started here (a skip reason), or None when one can."""
    if pg_bin("initdb") is None or pg_bin("pg_ctl") is None:
        return "PostgreSQL binaries (initdb, pg_ctl) not found on PATH or in /usr/lib/postgresql/*/bin"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg (the store extra) is not installed"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run initdb as"
    return None


@contextmanager
def temporary_postgres(database: str = "guarduq_test", *, durable: bool = False) -> Iterator[str]:
    """``postgresql+psycopg://postgres@127.0.0.1:PORT/<database>`` on a fresh server.

    ``durable=False`` (tests) turns fsync and full-page writes off: a test server need not
    survive power loss, and commits still reach the server before a client returns (what the
    store's kill -9 tests check). ``durable=True`` keeps PostgreSQL's defaults, so a benchmark
    pays a real fsync per commit, as SQLite's ``synchronous=FULL`` does.
    Raises RuntimeError when ``unavailable()`` gives a reason or the server fails to start.
    """
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    import psycopg

    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    assert initdb is not None and pg_ctl is not None  # checked by unavailable()
    as_user: list[str] = []
    root = tempfile.mkdtemp(prefix="guarduq-pg-")
    if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres user
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, log = os.path.join(root, "data"), os.path.join(root, "server.log")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def run(*cmd: str) -> None:
        proc = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            server_log = Path(log).read_text()[-3000:] if os.path.exists(log) else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}{server_log}")

    try:
        run(initdb, "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
        opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {root}"
        if not durable:
            opts += " -c fsync=off -c full_page_writes=off"
        run(pg_ctl, "start", "-D", data, "-w", "-t", "60", "-l", log, "-o", opts)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{database}"')
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/{database}"
    finally:
        subprocess.run([*as_user, pg_ctl, "stop", "-D", data, "-m", "fast", "-w"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)
