"""A live terminal view of the running system, fed by its telemetry and control-plane events.

`LiveView.apply(subject, data)` folds one message into the view's state (per-replica load and
latency, per-type arrivals and forecast, the deployment in force, switch events); `render()` turns
the state into a rich table. `attach()` subscribes it to a NATS connection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table

from oserve.streams.schemas import (ForecastMade, SchemaError, StrategyChosen, SwitchCompleted, SwitchEvent,
                                    SwitchPlanned, SwitchRolledBack, Telemetry, decode)
from oserve.streams.subjects import Subjects


@dataclass
class LiveView:
    """What the operator sees; updated message by message."""

    subjects: Subjects
    replicas: dict[str, Telemetry] = field(default_factory=dict)  # replica_id -> latest telemetry
    forecast: ForecastMade | None = None
    strategy: StrategyChosen | None = None
    serving_strategy_id: str = ""
    switch_log: list[str] = field(default_factory=list)  # latest last
    num_ignored: int = 0

    def apply(self, subject: str, data: bytes) -> None:
        """Fold one message in; messages it cannot read are counted and skipped."""
        s = self.subjects
        try:
            if subject.startswith(s.prefix + ".telemetry."):
                t = decode(data, Telemetry)
                assert isinstance(t, Telemetry)
                self.replicas[t.source_id] = t
            elif subject == s.plan_event("forecast"):
                self.forecast = decode(data, ForecastMade)  # type: ignore[assignment]
            elif subject == s.plan_event("strategy"):
                self.strategy = decode(data, StrategyChosen)  # type: ignore[assignment]
            elif subject == s.plan_event("switch"):
                ev = decode(data, SwitchEvent)
                if isinstance(ev, SwitchPlanned) and (ev.start_ids or ev.retire_ids):
                    self.switch_log.append(f"{ev.strategy_id}: start {ev.start_ids}, retire {ev.retire_ids}")
                elif isinstance(ev, SwitchCompleted):
                    self.serving_strategy_id = ev.strategy_id
                elif isinstance(ev, SwitchRolledBack):
                    self.switch_log.append(f"{ev.strategy_id}: rolled back ({ev.reason})")
                del self.switch_log[:-5]
            else:
                self.num_ignored += 1
        except SchemaError:
            self.num_ignored += 1

    def render(self) -> Group:
        reps = Table(title="Replicas")
        for col in ("replica", "req/s", "p50 e2e s", "p99 e2e s", "waiting", "running", "KV load"):
            reps.add_column(col, justify="left" if col == "replica" else "right")
        for rid, t in sorted(self.replicas.items()):
            reps.add_row(rid, f"{t.requests_per_s:.2f}", _fmt(t.p50_e2e_s), _fmt(t.p99_e2e_s), str(t.num_waiting),
                         str(t.num_running), f"{t.kv_load_frac:.0%}")
        plan = Table(title="Workload and plan")
        plan.add_column("type", justify="right")
        plan.add_column("arrived last span", justify="right")
        plan.add_column("forecast req/s", justify="right")
        if self.forecast is not None:
            for j, (n, r) in enumerate(zip(self.forecast.observed_counts, self.forecast.forecast_rps)):
                plan.add_row(str(j), str(n), f"{r:.2f}")
        deployment = "none yet"
        if self.strategy is not None:
            shapes = ", ".join(f"{r.replica_id}=TP{r.tp}xPP{r.pp}" for r in self.strategy.replicas)
            deployment = f"chosen {self.strategy.strategy_id} ({self.strategy.label}): {shapes}"
        lines = Table.grid()
        lines.add_row(f"deployment: {deployment}; serving: {self.serving_strategy_id or '-'}")
        for entry in self.switch_log:
            lines.add_row(f"switch {entry}")
        return Group(reps, plan, lines)

    async def attach(self, nc) -> list:
        """Subscribe to telemetry and plan events; returns the subscriptions."""
        async def on_msg(msg) -> None:
            self.apply(msg.subject, msg.data)

        return [await nc.subscribe(self.subjects.all_telemetry(), cb=on_msg),
                await nc.subscribe(self.subjects.plan_events(), cb=on_msg)]


def _fmt(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"
