"""OServe: LLM serving with spatial-temporal workload orchestration.

The core (this package's own modules) is synchronous and pure: no asyncio, no NATS, no OpenTelemetry,
no clock or environment reads. The bus contract, the services and the observability code live in the
subpackages `oserve.streams`, `oserve.workers` and `oserve.observability`.
"""

__version__ = "0.1.0"
