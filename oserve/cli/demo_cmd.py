"""`oserve demo`."""

from __future__ import annotations

from oserve.cli import app  # noqa: F401
