"""The live scheduler learns capacity as the simulator's OServe does: the engines' counters in their
heartbeats, the completions, one `SpanRecord` per span for `SelfCorrectingPlanner.observe`, the learner's
state in the strategy bucket across restarts, and the learned capacity on each strategy event."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import nats
import numpy as np
import pytest
from nats.js.errors import KeyNotFoundError

from oserve.planner.adaptive import SelfCorrectingPlanner, SpanRecord
from oserve.planner.learned import ReplicaWindow
from oserve.specs import ReplicaShape
from oserve.streams.jetstream import ensure_streams
from oserve.streams.schemas import (Arrival, Arrived, Completed, Completion, Dispatch, ForecastMade, Heartbeat,
                                    StrategyChosen, decode, encode)
from oserve.streams.subjects import Subjects
from oserve.streams.testing import running_server, unique_subjects, wait_until
from oserve.traces import load_trace
from oserve.workers.backends import EchoBackend, Job, SimBackend
from oserve.workers.clock import Clock
from oserve.workers.engine import EngineWorker, EngineWorkerConfig
from oserve.workers.scheduler import SchedulerConfig, SchedulerWorker, capacity_rows
from oserve.workers.span_telemetry import ReplicaCounters, span_record
from oserve.workers.system import SystemConfig, planning_inputs

SPAN_S = 10.0
TP1 = ReplicaShape(1, 1)


@pytest.fixture(scope="module")
def server():
    yield from running_server()


@pytest.fixture(scope="module")
def inputs():
    # a small cluster (three shapes), so learning and planning stay quick
    config = SystemConfig(model="llama2-7b", gpus=2, span_s=SPAN_S)
    return planning_inputs(config, load_trace("azure-conv").slice_time(0.0, 600.0)), config


def fresh_planner(inputs) -> SelfCorrectingPlanner:
    """A planner at the prior, as `planning_inputs` builds it (each test its own: a planner holds state)."""
    inp, config = inputs
    return SelfCorrectingPlanner(inp.ctx, config.planner_config(), mix=inp.prior.counts.sum(axis=0))


def taught(inputs) -> SelfCorrectingPlanner:
    """A planner told that a TP1 replica, saturated through a span, finished half what the model expects."""
    planner = fresh_planner(inputs)
    rate = planner.learner.saturated_rates(TP1)[0]
    window = ReplicaWindow(TP1, (0.5 * rate * SPAN_S, 0.0, 0.0, 0.0), SPAN_S, SPAN_S, after_saturated=True)
    planner.observe(SpanRecord((window,), 10.0, 10.0, SPAN_S), None)
    assert planner.correction.scales.get((TP1, 0), 1.0) > 1.2
    return planner


def _completion(replica_id: str, at_s: float, type_index: int, ttft_s: float = 0.5, e2e_s: float = 2.5,
                output_tokens: int = 11) -> Completion:
    return Completion(request_id=f"{replica_id}-{at_s}", replica_id=replica_id, input_tokens=100,
                      output_tokens=output_tokens, type_index=type_index, ttft_s=ttft_s, e2e_s=e2e_s,
                      finished_at_s=at_s)


def test_a_span_record_differences_each_replicas_counters_between_its_two_heartbeats() -> None:
    c = ReplicaCounters
    before = {"a": c("a", TP1, (0,), 9.5, 5.0, 2.0, 3, True), "b": c("b", TP1, (1,), 9.8, 8.0, 1.0, 0, True),
              "reset": c("reset", TP1, (2,), 9.0, 7.0, 6.0, 0, True),
              "gone": c("gone", TP1, (3,), 9.0, 7.0, 6.0, 4, True)}
    now = {"a": c("a", TP1, (0,), 19.0, 14.5, 11.5, 5, True),  # waited through all of its 9.5 s window
           "b": c("b", TP1, (1,), 20.1, 10.0, 1.5, 0, True),
           "reset": c("reset", TP1, (2,), 19.0, 1.0, 0.5, 0, True),  # restarted under its id: counts from 0
           "new": c("new", TP1, (4,), 19.9, 1.0, 0.5, 1, True)}  # switched in during the span
    done = [_completion("a", t, 0) for t in (10.0, 12.0, 18.9)] + [_completion("a", 15.0, 2, ttft_s=1.0, e2e_s=6.0)]
    done += [_completion("a", 9.4, 1), _completion("a", 19.5, 1)]  # before and after a's window
    done += [_completion("b", 20.0, 1), _completion("b", 11.0, 1), _completion("new", 15.0, 0)]
    record, saturated = span_record(before, now, done, 4, SPAN_S, arrivals=12, num_completed=9,
                                    saturated_before=frozenset({"a"}))
    assert [w.completed for w in record.windows] == [(3.0, 0.0, 1.0, 0.0), (0.0, 2.0, 0.0, 0.0)]
    a, b = record.windows
    assert a.seconds == pytest.approx(9.5) and a.saturated_s == pytest.approx(9.5) and a.after_saturated
    assert b.seconds == pytest.approx(10.3) and b.saturated_s == pytest.approx(0.5) and not b.after_saturated
    assert a.tpot_s == pytest.approx(np.mean([0.2, 0.2, 0.2, 0.5]))  # (e2e - ttft) / (output tokens - 1)
    assert saturated == {"a"}
    assert record.waiting_growth == 2.0  # over the replicas that served through: a's 3 -> 5
    assert (record.arrivals, record.completions, record.span_s) == (12.0, 9.0, SPAN_S)
    # the first snapshot has nothing to difference against
    first, none = span_record({}, now, done, 4, SPAN_S, arrivals=1, num_completed=1)
    assert first.windows == () and none == frozenset() and first.waiting_growth == 0.0


def test_backends_count_busy_and_saturated_seconds() -> None:
    backend = SimBackend("r0")
    for seq in range(40):  # more prompt tokens than one step takes: requests wait between steps
        backend.add(Job(seq, f"q{seq}", 4000, 4, 0, 0.0), 0.0)
    while backend.next_event_s() is not None:
        backend.advance(backend.next_event_s())
    load = backend.load()
    assert load.busy_s >= load.saturated_s > 0
    assert EchoBackend().load().busy_s == EchoBackend().load().saturated_s == 0.0


async def test_engine_heartbeats_carry_the_replicas_counters(server) -> None:
    subjects = unique_subjects()

    async def main() -> None:
        nc = await nats.connect(server.url)
        seen: list[Heartbeat] = []

        async def on_hb(msg) -> None:
            seen.append(decode(msg.data, Heartbeat))

        await nc.subscribe(subjects.heartbeats(), cb=on_hb)
        cfg = EngineWorkerConfig("r0", subjects=subjects, heartbeat_interval_wall_s=0.05)
        async with EngineWorker(nc, cfg, Clock(speedup=20.0)):
            for i in range(40):
                await nc.publish(subjects.replica("r0"), encode(Dispatch(
                    request_id=f"q{i}", input_tokens=4000, max_tokens=4, type_index=0, gateway_id="t")),
                    reply=f"{subjects.reply_prefix()}.nobody.{i}")
            await wait_until(lambda: any(h.saturated_s > 0 for h in seen), 10, "a heartbeat with saturated seconds")
        hb = next(h for h in seen if h.saturated_s > 0)
        assert hb.busy_s >= hb.saturated_s > 0 and hb.replica_id == "r0"
        await nc.close()

    await asyncio.wait_for(main(), 20)


class RecordingPlanner(SelfCorrectingPlanner):
    """Keeps the deployment in force (so its replica ids stay) and records what `observe` is told."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[SpanRecord] = []
        self.recent: list = []

    def observe(self, span, current):
        self.seen.append(span)
        return super().observe(span, current)

    def plan(self, rates_rps, current, recent, span_s):
        self.recent.append(recent)
        return current if current is not None else super().plan(rates_rps, current, recent, span_s)


async def test_heartbeats_and_completions_become_the_span_the_planner_observes(server, inputs) -> None:
    subjects = unique_subjects()
    inp, config = inputs
    planner = RecordingPlanner(inp.ctx, config.planner_config(), mix=inp.prior.counts.sum(axis=0))

    async def main() -> None:
        nc = await nats.connect(server.url)
        kv = await ensure_streams(nc.jetstream(), subjects)
        worker = SchedulerWorker(nc, kv, SchedulerConfig(subjects=subjects, span_s=SPAN_S), Clock(), planner,
                                 inp.initial_rps)
        async with worker:
            ids = [r.replica_id for r in worker.current.deployment.replicas]

            async def heartbeats(at_s: float, busy_s: float, saturated_s: float, waiting: int) -> None:
                for rid in ids:
                    await nc.publish(subjects.heartbeat(rid), encode(Heartbeat(
                        replica_id=rid, at_s=at_s, num_waiting=waiting, num_running=4, busy_s=busy_s,
                        saturated_s=saturated_s)))
                await wait_until(lambda: all(rid in worker.heartbeats and worker.heartbeats[rid].at_s == at_s
                                             for rid in ids), 5, "the heartbeats")

            async def forecast(span: int) -> None:
                await nc.publish(subjects.plan_event("forecast"), encode(ForecastMade(
                    span_index=span, span_start_s=span * SPAN_S, span_s=SPAN_S, observed_counts=[0, 0, 0, 0],
                    forecast_rps=[float(x) for x in inp.initial_rps])))
                await wait_until(lambda: len(worker.strategies) == span + 2, 10, f"the strategy after span {span}")

            await heartbeats(9.5, 5.0, 2.0, 1)
            await forecast(0)
            items = [_completion(ids[0], 11.0 + i, i % 2) for i in range(5)]
            await nc.publish(subjects.completions(), encode(Completed(replica_id=ids[0], items=items)))
            await wait_until(lambda: len(worker._completions) == 5, 5, "the completions")
            arrivals = [Arrival(request_id=f"a{i}", at_s=12.0 + i, input_tokens=50, est_output_tokens=20,
                                type_index=i % 2, replica_id=ids[0]) for i in range(3)]
            await nc.publish(subjects.arrivals(), encode(Arrived(gateway_id="g", items=arrivals)))
            await wait_until(lambda: len(worker._arrivals.get(1, ())) == 3, 5, "the arrivals")
            await heartbeats(19.5, 14.0, 11.0, 3)
            await forecast(1)
        await nc.close()
        return ids

    ids = await asyncio.wait_for(main(), 20)
    assert len(planner.seen) == 2 and planner.seen[0].windows == ()  # nothing to difference the first against
    record = planner.seen[1]
    assert len(record.windows) == len(ids)
    assert all(w.seconds == pytest.approx(10.0) and w.saturated_s == pytest.approx(9.0) for w in record.windows)
    assert record.windows[0].completed == (3.0, 2.0, 0.0, 0.0) and record.completions == 5.0
    assert record.waiting_growth == 2.0 * len(ids)
    # the twin is told what each class turned out to contain: the span's completions by class at arrival
    pattern = planner.recent[-1]
    assert list(pattern.classes) == [0, 1, 0]
    assert [len(i) for i, _ in pattern.lengths] == [3, 2, 0, 0]
    assert all(set(i) <= {100} and set(o) <= {11} for i, o in pattern.lengths)


async def test_the_learner_survives_a_restart_and_rides_on_each_strategy(server, inputs, caplog) -> None:
    subjects = unique_subjects()
    inp, _ = inputs
    planner = taught(inputs)

    async def main() -> None:
        nc = await nats.connect(server.url)
        kv = await ensure_streams(nc.jetstream(), subjects)
        published: list[StrategyChosen] = []

        async def on_strategy(msg) -> None:
            published.append(decode(msg.data, StrategyChosen))

        await nc.subscribe(subjects.plan_event("strategy"), cb=on_strategy)
        cfg = SchedulerConfig(subjects=subjects, span_s=SPAN_S)
        async with SchedulerWorker(nc, kv, cfg, Clock(), planner, inp.initial_rps) as first:
            await wait_until(lambda: len(published) == 1, 5, "the first strategy event")
        stored = json.loads((await kv.get(Subjects.LEARNED_KEY)).value)
        assert stored == json.loads(json.dumps(planner.learner.to_dict()))
        # the strategy carries the correction it was planned with: the taught shape's classes among its rows
        s = published[0]
        assert s.capacity_scales == first.strategies[0].capacity_scales == capacity_rows(planner.correction)
        rows = {(int(tp), int(pp), int(j)): (scale, sd) for tp, pp, j, scale, sd in s.capacity_scales}
        assert {(1, 1, j) for j in range(4)} <= set(rows)
        assert rows[(1, 1, 0)][0] == pytest.approx(planner.correction.scales[(TP1, 0)]) and rows[(1, 1, 0)][0] > 1.2
        assert 0 < rows[(1, 1, 0)][1] < 0.5 and s.guard_events == 0 and s.underserved is False
        # a restarted scheduler resumes with what was learned
        again = fresh_planner(inputs)
        async with SchedulerWorker(nc, kv, cfg, Clock(), again, inp.initial_rps):
            assert again.learner.to_dict() == stored
            assert again.correction.scales == planner.correction.scales  # and plans with it
        # a state for another prior is refused: the learner starts from the model's
        await kv.put(Subjects.LEARNED_KEY, json.dumps({**stored, "classes": ["a", "b"]}).encode())
        other = fresh_planner(inputs)
        with caplog.at_level(logging.WARNING, logger="oserve.workers.scheduler"):
            async with SchedulerWorker(nc, kv, cfg, Clock(), other, inp.initial_rps):
                assert other.learner.to_dict() == fresh_planner(inputs).learner.to_dict()
        assert "does not fit this planner" in caplog.text
        await nc.close()

    await asyncio.wait_for(main(), 30)


async def test_a_planner_that_does_not_learn_reads_no_telemetry(server, inputs) -> None:
    subjects = unique_subjects()
    inp, _ = inputs

    async def main() -> None:
        nc = await nats.connect(server.url)
        kv = await ensure_streams(nc.jetstream(), subjects)
        static = inp.static(fresh_planner(inputs).plan(inp.initial_rps, None, None, SPAN_S).deployment)
        async with SchedulerWorker(nc, kv, SchedulerConfig(subjects=subjects, span_s=SPAN_S), Clock(),
                                   static.planner, inp.initial_rps) as worker:
            assert not worker.learning and worker.strategies[0].capacity_scales == []
            assert len(worker._subs) == 2  # arrivals and forecasts only
        with pytest.raises(KeyNotFoundError):  # nothing learned was stored
            await kv.get(Subjects.LEARNED_KEY)
        await nc.close()

    await asyncio.wait_for(main(), 20)


def test_queues_from_a_mix_the_forecast_missed_are_not_held_against_the_model(inputs) -> None:
    """The guard blames the capacity model for queues that grew in a span where no class came beyond its
    plan (`oserve.routing.beyond_plan` over the span: the router then spread its surplus anywhere); a mix
    that moved past its forecast is the forecast's miss (`SpanRecord.arrivals_by_class`). A class a little
    above its plan, within Poisson's noise, is no excuse."""
    from oserve.decision import Decision
    from oserve.planner.candidates import homogeneous_deployment

    planner = fresh_planner(inputs)
    table = planner.ctx.table
    two = homogeneous_deployment(planner.ctx.cluster, TP1)
    k = len(planner.class_names)
    n0 = table.rate(TP1, 0)
    weights = tuple(tuple([0.3 * n0, 0.0] if j == 0 else [0.0, 0.3 * table.rate(TP1, j)] if j == 1 else [0.0, 0.0])
                    for j in range(k))
    decision = Decision(two, weights, forecast_rps=tuple(sum(w) for w in weights), label="reroute")

    def span(class0_rps: float) -> SpanRecord:
        by_class = tuple(class0_rps * SPAN_S if j == 0 else 0.0 for j in range(k))
        return SpanRecord((), sum(by_class), 0.0, SPAN_S, waiting_growth=0.5 * sum(by_class),
                          arrivals_by_class=by_class)

    assert planner.observe(span(0.3 * n0), decision).underserved  # as planned, yet queues grew: the model
    assert not planner.observe(span(3.0 * n0), decision).underserved  # 3x its capacity came: the forecast
    assert planner.observe(span(0.4 * n0), decision).underserved  # 1.33x its plan: within the router's plan
    # a replica far slower than the model expects is judged even when a class overran its plan, at the load
    # the router gave it; one the surplus filled past 90% of its capacity is excused
    slow = ReplicaWindow(TP1, (0.0,) * k, SPAN_S, 0.0, tpot_s=1.0)

    def with_slow(class0_rps: float) -> SpanRecord:
        return SpanRecord((slow,), class0_rps * SPAN_S, 0.0, SPAN_S, waiting_growth=0.0,
                          arrivals_by_class=tuple(class0_rps * SPAN_S if j == 0 else 0.0 for j in range(k)))
    just_beyond = (1.5 * 0.3 * n0 * SPAN_S + 10 + 5) / SPAN_S
    assert 1.5 * 0.3 * n0 * SPAN_S + 10 < just_beyond * SPAN_S
    assert planner.observe(with_slow(just_beyond), decision).underserved
    assert not planner.observe(with_slow(3.0 * n0), decision).underserved
    assert planner.observe(SpanRecord((), 3.0 * n0 * SPAN_S, 0.0, SPAN_S, waiting_growth=1.5 * n0 * SPAN_S),
                           decision).underserved  # without the arrivals per class, judged as before


def test_the_span_a_deployment_was_switched_in_at_judges_nothing(inputs) -> None:
    """A replica far slower than the model expects underserves, except in the span its deployment was switched
    in at (the decision in force moved replicas: `switch_s` > 0), when the replicas that stayed carried the
    share of those still switching. That span counts neither as underserved nor as clean; the next one is
    judged as any other."""
    from dataclasses import replace as dc_replace

    from oserve.decision import Decision
    from oserve.planner.adaptive import deployment_key
    from oserve.planner.candidates import homogeneous_deployment

    planner = fresh_planner(inputs)
    table = planner.ctx.table
    two = homogeneous_deployment(planner.ctx.cluster, TP1)
    k = len(planner.class_names)
    n0 = table.rate(TP1, 0)
    weights = tuple(tuple([0.3 * n0, 0.3 * n0] if j == 0 else [0.0, 0.0]) for j in range(k))
    switched = Decision(two, weights, switch_s=8.0, forecast_rps=tuple(sum(w) for w in weights), label="switch")
    slow = ReplicaWindow(TP1, (0.0,) * k, SPAN_S, 0.0, tpot_s=1.0)
    span = SpanRecord((slow,), 0.6 * n0 * SPAN_S, 0.0, SPAN_S, waiting_growth=0.0,
                      arrivals_by_class=tuple(0.6 * n0 * SPAN_S if j == 0 else 0.0 for j in range(k)))
    assert not planner.observe(span, switched).underserved
    record = planner.measured[deployment_key(two)]
    assert record.spans == record.underserved_spans == 0 and record.best_clean_demand_rps == 0.0
    assert planner.observe(span, dc_replace(switched, switch_s=0.0, label="reroute")).underserved
    assert record.spans == record.underserved_spans == 1


def test_the_guard_routes_a_spans_arrivals_as_the_router_does(inputs) -> None:
    """`SelfCorrectingPlanner._given_rates`: every class's arrivals are all given to some replica; a class
    within its plan goes exactly as the plan's weights split it; a class beyond it (or with no plan) sends
    its surplus to every replica in proportion to the replica's capacity for it. Hypothesis over counts
    and plans on a two-replica deployment."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from oserve.planner.candidates import homogeneous_deployment
    from oserve.routing import SURPLUS_FACTOR, SURPLUS_SLACK

    planner = fresh_planner(inputs)
    two = homogeneous_deployment(planner.ctx.cluster, TP1)
    k = len(planner.class_names)
    rows = planner.ctx.table.matrix(two.shapes())

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.floats(0, 500), min_size=k, max_size=k),
           st.lists(st.tuples(st.sampled_from([0.0, 0.5, 3.0]), st.sampled_from([0.0, 1.0, 20.0])),
                    min_size=k, max_size=k))
    def check(counts, weights) -> None:
        span = SpanRecord((), sum(counts), 0.0, SPAN_S, arrivals_by_class=tuple(counts))
        given_rates = planner._given_rates(two, tuple(weights), span)
        assert given_rates.shape[0] == 2 and (given_rates >= 0).all()
        for j, (count, row) in enumerate(zip(counts, weights)):
            assert given_rates[:, j].sum() == pytest.approx(count / SPAN_S, rel=1e-9, abs=1e-12)
            planned = sum(row)
            if planned > 0 and count <= SURPLUS_FACTOR * planned * SPAN_S + SURPLUS_SLACK:
                for r in range(2):
                    assert given_rates[r, j] == pytest.approx(count / SPAN_S * row[r] / planned, abs=1e-12)
            elif planned == 0:
                caps = [rows[r][j] for r in range(2)]
                for r in range(2):
                    assert given_rates[r, j] == pytest.approx(count / SPAN_S * caps[r] / sum(caps), abs=1e-12)

    check()


def test_a_deployment_that_decodes_slower_than_modelled_underserves_pooled_over_its_spans(inputs) -> None:
    """`GuardConfig.slow_factor`: a deployment the model alone chose underserves once, pooled over at least
    `slow_min_spans` of its spans (completion-weighted), its replicas with time to spare took more than
    `slow_factor` times the time per output token the model expects at their loads; no span alone needs to
    be beyond `tpot_factor`. Reference: the pooled ratio computed by a plain loop. A deployment measured on
    the history never underserves for it (its tail was measured), and a slow span counts as no clean one."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from oserve.decision import Decision
    from oserve.planner.adaptive import GuardConfig, MeasuredRun, deployment_key
    from oserve.planner.candidates import homogeneous_deployment

    cfg = GuardConfig()
    probe = fresh_planner(inputs)
    two = homogeneous_deployment(probe.ctx.cluster, TP1)
    k = len(probe.class_names)
    n0 = probe.ctx.table.rate(TP1, 0)
    weights = tuple(tuple([0.3 * n0, 0.3 * n0] if j == 0 else [0.0, 0.0]) for j in range(k))
    decision = Decision(two, weights, forecast_rps=tuple(sum(w) for w in weights), label="reroute")
    by_class = tuple(0.6 * n0 * SPAN_S if j == 0 else 0.0 for j in range(k))
    expected = probe._expected_tbt(two, probe._planned_rates(two, weights), 0, SpanRecord((), 0.0, 0.0, SPAN_S))
    assert 0 < expected < math.inf

    def span(ratio: float, done: int) -> SpanRecord:
        window = ReplicaWindow(TP1, (float(done),) + (0.0,) * (k - 1), SPAN_S, 0.0, tpot_s=ratio * expected)
        return SpanRecord((window, window), sum(by_class), 2.0 * done, SPAN_S, arrivals_by_class=by_class)

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.tuples(st.floats(0.5, 0.99 * cfg.tpot_factor), st.integers(1, 200)), min_size=1, max_size=6),
           st.booleans())
    def check(spans, measured_before) -> None:
        planner = fresh_planner(inputs)
        if measured_before:
            planner.seed([MeasuredRun(two, (), 20.0)])
        seen = done_total = 0.0
        peak = math.nan
        for i, (ratio, done) in enumerate(spans, start=1):
            out = planner.observe(span(ratio, done), decision)
            seen, done_total = seen + ratio * done, done_total + done
            if i >= cfg.slow_min_spans:
                peak = seen / done_total if math.isnan(peak) else max(peak, seen / done_total)
            assert planner.peak_slowness == pytest.approx(peak, rel=1e-9, nan_ok=True)
            slow = not measured_before and i >= cfg.slow_min_spans and seen / done_total > cfg.slow_factor
            assert out.slow == out.underserved == slow
            record = planner.measured[deployment_key(two)]
            assert record.slowness() == pytest.approx(seen / done_total, rel=1e-9)
        clean = sum(1 for _ in spans) - record.underserved_spans
        assert (record.best_clean_demand_rps > 0) == (clean > 0)

    check()


def test_the_guard_leaves_a_deployment_slower_than_modelled_for_the_one_measured_best(inputs) -> None:
    """Three spans 1.6x slower per output token than the model (none beyond `tpot_factor`, none saturated):
    the planner leaves the deployment its model chose for the one measured best on the history."""
    from oserve.decision import Decision
    from oserve.planner.adaptive import MeasuredRun, deployment_key
    from oserve.planner.candidates import homogeneous_deployment

    planner = fresh_planner(inputs)
    shapes = sorted(planner.ctx.table.shapes(planner.ctx.cluster.num_gpus), key=lambda s: (s.tp * s.pp, s.tp))
    two = homogeneous_deployment(planner.ctx.cluster, TP1)
    other = homogeneous_deployment(planner.ctx.cluster, next(s for s in shapes if s != TP1))
    k = len(planner.class_names)
    n0 = planner.ctx.table.rate(TP1, 0)
    by_class = tuple(0.6 * n0 * SPAN_S if j == 0 else 0.0 for j in range(k))
    planner.seed([MeasuredRun(other, (SpanRecord((), sum(by_class), sum(by_class), SPAN_S),), 12.0)])
    weights = tuple(tuple([0.3 * n0, 0.3 * n0] if j == 0 else [0.0, 0.0]) for j in range(k))
    decision = Decision(two, weights, forecast_rps=tuple(sum(w) for w in weights), label="reroute")
    expected = planner._expected_tbt(two, planner._planned_rates(two, weights), 0, SpanRecord((), 0.0, 0.0, SPAN_S))
    window = ReplicaWindow(TP1, (40.0,) + (0.0,) * (k - 1), SPAN_S, 0.0, tpot_s=1.6 * expected)
    rates = np.array(by_class) / SPAN_S
    for i in range(3):
        out = planner.observe(SpanRecord((window, window), sum(by_class), 80.0, SPAN_S, arrivals_by_class=by_class),
                              decision)
        assert out.underserved == out.slow == (i == 2)
    moved = planner.plan(rates, decision, None, SPAN_S)
    assert moved.label == "guard" and sorted(moved.deployment.shapes()) == sorted(other.shapes())
    assert planner.measured[deployment_key(two)].distrusted
