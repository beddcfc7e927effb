"""`oserve bench ...` subcommands."""

from __future__ import annotations

from oserve.cli import bench_app  # noqa: F401
