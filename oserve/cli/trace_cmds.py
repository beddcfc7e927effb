"""`oserve trace ...` subcommands."""

from __future__ import annotations

from oserve.cli import trace_app  # noqa: F401
