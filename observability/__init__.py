"""OpenTelemetry setup, trace-context propagation through NATS headers, telemetry views, report plots.

Installed as `oserve.observability`.
"""
