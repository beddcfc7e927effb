"""The bus contract: subjects, message schemas, JetStream streams and KV buckets, the NATS launcher.

Installed as `oserve.streams` (the folder `streams/` maps to that import name). Its contents arrive with
the live-pipeline work; the core never imports it.
"""
