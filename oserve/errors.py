"""Typed errors raised by the core. Pure: no I/O, no logging."""

from __future__ import annotations


class OServeError(Exception):
    """Base class of every error OServe raises on purpose."""


class ConfigError(OServeError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class UnknownNameError(OServeError, KeyError):
    """A preset name (model, GPU, cluster, search, ...) is not known; the message lists the known ones."""

    def __init__(self, kind: str, name: str, known: list[str] | tuple[str, ...]) -> None:
        self.kind = kind
        self.name = name
        self.known = tuple(known)
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(self.known)}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])

    def __reduce__(self):  # rebuilt from its three fields, so it crosses a process pool intact
        return type(self), (self.kind, self.name, self.known)


class TraceError(OServeError, ValueError):
    """A trace file cannot be used: missing column, bad value (with its line number), empty."""


class InfeasibleError(OServeError):
    """No solution exists for the inputs (for example a model that fits on no replica of the cluster)."""
