"""The services on the bus (gateway/router, forecaster stage, scheduler, switch planner, engines).

Installed as `oserve.workers`. Each worker is one class built from a frozen config dataclass, with
`start()`, `drain()` and `stop()` (idempotent) and `async with` support (`base.Worker`):
- `gateway`: validation, classification, smooth-WRR routing, ownership until answered, re-dispatch;
- `engine`: one replica behind a backend (`backends`: `sim`, `echo`), replies, completions, heartbeats;
- `control`: forecaster stage, scheduler worker, switch planner, engine host;
- `system`: everything in one process (`oserve up`) and the trace replay; `bench`: `oserve bench bus`;
- `clock`: the shared, speed-up-able `Clock`; `router`: the pure routing helpers.
"""
