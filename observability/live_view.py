"""A live terminal view of the running system, fed by its telemetry and control-plane events.

`LiveView.apply(subject, data)` folds one message into the view's state (per-replica load and
latency, per-type arrivals and forecast, the deployment in force, switch events); `render()` turns
the state into a rich table and `snapshot()` into plain data (`oserve top --json`). `attach()` subscribes
it to a NATS connection (new messages only); `oserve.observability.top` feeds it from the JetStream
streams instead, history first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table

from oserve.streams.schemas import (AssignmentSet, ForecastMade, Heartbeat, SchemaError, StrategyChosen,
                                    SwitchCompleted, SwitchEvent, SwitchPlanned, SwitchRolledBack, Telemetry, decode)
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
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)  # replica_id -> latest heartbeat
    assignment: AssignmentSet | None = None
    """The assignment the routers follow (its strategy is the one serving)."""
    silent_after_wall_s: float = 5.0
    """A replica whose last heartbeat is older than this (wall seconds) is shown as silent."""

    def apply(self, subject: str, data: bytes) -> None:
        """Fold one message in; messages it cannot read are counted and skipped."""
        s = self.subjects
        try:
            if subject.startswith(s.prefix + ".telemetry."):
                t = decode(data, Telemetry)
                assert isinstance(t, Telemetry)
                self.replicas[t.source_id] = t
            elif subject.startswith(s.prefix + ".hb."):
                hb = decode(data, Heartbeat)
                assert isinstance(hb, Heartbeat)
                self.heartbeats[hb.replica_id] = hb
            elif subject == s.plan_event("assignment"):
                a = decode(data, AssignmentSet)
                assert isinstance(a, AssignmentSet)
                self.assignment = a
                self.serving_strategy_id = a.strategy_id
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

    def replica_state(self, replica_id: str, now_unix_s: float | None = None) -> str:
        """`serving`, `draining` (not accepting), `silent` (no heartbeat for `silent_after_wall_s`, judged on
        the heartbeat's clock fields when it has them) or `unknown` (telemetry only)."""
        hb = self.heartbeats.get(replica_id)
        if hb is None:
            return "unknown"
        if now_unix_s is not None and hb.clock_epoch_unix_s > 0:
            seen_unix_s = hb.clock_epoch_unix_s + hb.at_s / hb.clock_speedup
            if now_unix_s - seen_unix_s > self.silent_after_wall_s:
                return "silent"
        return "serving" if hb.accepting else "draining"

    def snapshot(self, now_unix_s: float | None = None) -> dict:
        """The view as plain data (JSON-ready): replicas, workload, plan in force, recent switches."""
        reps = []
        for rid in sorted(set(self.replicas) | set(self.heartbeats)):
            t, hb = self.replicas.get(rid), self.heartbeats.get(rid)
            reps.append({
                "replica_id": rid, "state": self.replica_state(rid, now_unix_s),
                "requests_per_s": t.requests_per_s if t else None,
                "p50_e2e_s": t.p50_e2e_s if t else None, "p99_e2e_s": t.p99_e2e_s if t else None,
                "num_waiting": (hb or t).num_waiting, "num_running": (hb or t).num_running,  # type: ignore[union-attr]
                "kv_load_frac": (hb or t).kv_load_frac,  # type: ignore[union-attr]
                "last_heartbeat_unix_s": hb.clock_epoch_unix_s + hb.at_s / hb.clock_speedup
                if hb and hb.clock_epoch_unix_s > 0 else None})
        f, st = self.forecast, self.strategy
        return {
            "replicas": reps,
            "workload": None if f is None else {
                "span_index": f.span_index, "observed_counts": list(f.observed_counts),
                "forecast_rps": list(f.forecast_rps), "forecaster": f.forecaster},
            "strategy": None if st is None else {
                "strategy_id": st.strategy_id, "label": st.label,
                "replicas": [{"replica_id": r.replica_id, "tp": r.tp, "pp": r.pp} for r in st.replicas],
                "weights_rps": st.weights, "shares": st.shares},
            "serving_strategy_id": self.serving_strategy_id or None,
            "switches": list(self.switch_log),
            "num_ignored": self.num_ignored,
        }

    def render(self, now_unix_s: float | None = None) -> Group:
        reps = Table(title="Replicas")
        for col in ("replica", "state", "req/s", "p50 e2e s", "p99 e2e s", "waiting", "running", "KV load"):
            reps.add_column(col, justify="left" if col in ("replica", "state") else "right")
        for r in self.snapshot(now_unix_s)["replicas"]:
            reps.add_row(r["replica_id"], r["state"], _fmt(r["requests_per_s"]), _fmt(r["p50_e2e_s"]),
                         _fmt(r["p99_e2e_s"]), str(r["num_waiting"]), str(r["num_running"]), f"{r['kv_load_frac']:.0%}")
        plan = Table(title="Workload and plan")
        plan.add_column("type", justify="right")
        plan.add_column("arrived last span", justify="right")
        plan.add_column("forecast req/s", justify="right")
        plan.add_column("planned shares", justify="left")
        if self.forecast is not None:
            shares = self.strategy.shares if self.strategy is not None else []
            for j, (n, r) in enumerate(zip(self.forecast.observed_counts, self.forecast.forecast_rps)):
                row = shares[j] if j < len(shares) else {}
                plan.add_row(str(j), str(n), f"{r:.2f}",
                             ", ".join(f"{rid} {x:.0%}" for rid, x in sorted(row.items()) if x > 0) or "-")
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
