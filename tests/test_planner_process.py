"""Decisions in a child process (`oserve.planner.process`): the same decisions and the same learned state as on
the caller's thread (reference: a copy of the planner run here), a child that dies costs nothing, and a live
scheduler with `planner_process` plans through one."""

from __future__ import annotations

import os
import pickle
import signal

import nats
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oserve.planner.adaptive import SelfCorrectingPlanner, SpanRecord
from oserve.planner.learned import ReplicaWindow
from oserve.planner.process import PlannerFailed, PlannerProcess, observe_and_plan
from oserve.streams.jetstream import ensure_streams
from oserve.streams.testing import running_server, unique_subjects
from oserve.workers.clock import Clock
from oserve.workers.scheduler import SchedulerConfig, SchedulerWorker
from oserve.workers.system import SystemConfig, planning_inputs

SPAN_S = 60.0


@pytest.fixture(scope="module")
def server():
    yield from running_server()


@pytest.fixture(scope="module")
def inputs():
    return planning_inputs(SystemConfig())


@pytest.fixture(scope="module")
def child():
    process = PlannerProcess()
    yield process
    process.close()


def copy(planner):
    return pickle.loads(pickle.dumps(planner))


def busy_span(decision, scale: float, k: int) -> SpanRecord:
    """A span in which every replica of `decision` was saturated and finished `scale` of a round count per class."""
    windows = tuple(ReplicaWindow(r.shape, tuple(float(round(40 * scale)) for _ in range(k)), SPAN_S, SPAN_S)
                    for r in decision.deployment.replicas)
    return SpanRecord(windows, 100.0 * scale, 90.0 * scale, SPAN_S, waiting_growth=2.0)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scales=st.lists(st.floats(0.3, 2.5), min_size=1, max_size=2), seed=st.integers(0, 3))
def test_decisions_in_a_child_are_those_made_here(inputs, child, scales, seed):
    """Reference: the same planner state and inputs on this thread. Every decision and the learned state after
    each are the same, and the caller gets back a planner that is not the one it handed in (the mirror)."""
    here = copy(inputs.planner)
    there = copy(inputs.planner)
    assert isinstance(here, SelfCorrectingPlanner)
    k = len(here.class_names)
    rng = np.random.default_rng(seed)
    rates = inputs.initial_rps * rng.uniform(0.5, 1.5, size=k)
    current_here = observe_and_plan(here, None, None, rates, None, SPAN_S)
    current_there, mirror = child.decide(there, None, None, rates, None, SPAN_S)
    assert current_there == current_here and mirror is not there
    for scale in scales:
        record = busy_span(current_here, scale, k)
        rates = rates * scale
        current_here = observe_and_plan(here, record, current_here, rates, None, SPAN_S)
        current_there, mirror = child.decide(mirror, record, current_there, rates, None, SPAN_S)
        assert current_there == current_here
        assert mirror.learner.to_dict() == here.learner.to_dict()
        assert mirror.correction == here.correction and mirror.last == here.last
    assert here.learner.to_dict() != inputs.planner.learner.to_dict()  # the spans taught it something


def test_a_planner_the_child_did_not_send_is_handed_over(inputs, child):
    """A decision with a planner object other than the mirror (one loaded or replaced meanwhile) plans with it."""
    a = copy(inputs.planner)
    rates = inputs.initial_rps
    first, mirror = child.decide(a, None, None, rates, None, SPAN_S)
    other = copy(inputs.planner)
    other.learner.observe(ReplicaWindow(first.deployment.replicas[0].shape, (300.0,) * len(rates), SPAN_S, SPAN_S))
    other.refresh()
    want = observe_and_plan(copy(other), None, None, rates * 3, None, SPAN_S)
    got, mirror2 = child.decide(other, None, None, rates * 3, None, SPAN_S)
    assert got == want and mirror2.learner.to_dict() == other.learner.to_dict()


def test_a_child_that_dies_costs_one_decision_made_here_and_nothing_learned(inputs):
    process = PlannerProcess()
    try:
        here = copy(inputs.planner)
        k = len(here.class_names)
        rates = inputs.initial_rps
        first, mirror = process.decide(copy(inputs.planner), None, None, rates, None, SPAN_S)
        want_first = observe_and_plan(here, None, None, rates, None, SPAN_S)
        assert first == want_first
        os.kill(process.child_pid(), signal.SIGKILL)
        record = busy_span(first, 1.5, k)
        want = observe_and_plan(here, record, want_first, rates * 1.5, None, SPAN_S)
        got, mirror = process.decide(mirror, record, first, rates * 1.5, None, SPAN_S)
        assert got == want and process.num_fallbacks == 1
        assert mirror.learner.to_dict() == here.learner.to_dict()  # learned on this thread, kept
        record = busy_span(got, 0.5, k)
        want = observe_and_plan(here, record, want, rates * 0.5, None, SPAN_S)
        got, mirror = process.decide(mirror, record, got, rates * 0.5, None, SPAN_S)
        assert got == want and process.num_children == 2 and process.num_fallbacks == 1
        assert mirror.learner.to_dict() == here.learner.to_dict()
    finally:
        process.close()


def test_a_planner_that_raises_in_the_child_raises_here_and_keeps_what_it_learned(inputs, child):
    """Reference: the same on this thread, where `observe` changes the planner before `plan` raises."""
    here = copy(inputs.planner)
    rates = inputs.initial_rps
    first, mirror = child.decide(copy(inputs.planner), None, None, rates, None, SPAN_S)
    observe_and_plan(here, None, None, rates, None, SPAN_S)
    record = busy_span(first, 2.0, len(rates))
    with pytest.raises(Exception):
        observe_and_plan(here, record, first, rates[:-1], None, SPAN_S)  # one rate short: plan raises
    with pytest.raises(PlannerFailed, match="the planner raised"):
        child.decide(mirror, record, first, rates[:-1], None, SPAN_S)
    kept = child._mirror
    assert kept is not mirror and kept.learner.to_dict() == here.learner.to_dict() != mirror.learner.to_dict()
    again, _ = child.decide(kept, None, first, rates, None, SPAN_S)  # the child goes on
    assert again == observe_and_plan(here, None, first, rates, None, SPAN_S)


def test_a_closed_one_decides_here(inputs):
    process = PlannerProcess()
    process.close()
    planner = copy(inputs.planner)
    got, back = process.decide(planner, None, None, inputs.initial_rps, None, SPAN_S)
    assert back is planner and process.num_fallbacks == 1 and process.num_children == 0
    assert got == observe_and_plan(copy(inputs.planner), None, None, inputs.initial_rps, None, SPAN_S)


async def test_a_live_scheduler_plans_in_its_child(server, inputs):
    """`SchedulerConfig.planner_process`: a live scheduler's decisions come from a child process, and the
    planner it holds after them is the child's; the child stops with the worker."""
    planner = copy(inputs.planner)
    want = observe_and_plan(copy(inputs.planner), None, None, inputs.initial_rps, None, SPAN_S)
    subjects = unique_subjects()
    nc = await nats.connect(server.url)
    try:
        kv = await ensure_streams(nc.jetstream(), subjects)
        cfg = SchedulerConfig(subjects=subjects, span_s=SPAN_S, planner_process=True)
        async with SchedulerWorker(nc, kv, cfg, Clock(), planner, inputs.initial_rps) as worker:
            assert worker.planner_process is not None and worker.planner_process.num_children == 1
            assert worker.planner is not planner  # the child's, sent back
            got = worker.current
            assert worker.strategies[0].label == "initial" and got.weights == want.weights
            assert [(r.shape, r.gpu_ids) for r in got.deployment.replicas] == \
                [(r.shape, r.gpu_ids) for r in want.deployment.replicas]  # the worker renames new replicas
        assert worker.planner_process.child_pid() is None
    finally:
        await nc.close()


def test_a_child_ignores_ctrl_c_and_exits_when_its_parent_is_killed():
    """A terminal's Ctrl-C reaches the whole process group, and the parent, not the child, answers it; a scheduler
    process killed outright (SIGKILL: no shutdown runs) leaves no planner child behind. The kernel's disposition is
    read, not Python's: polars, imported with the planner, installs a SIGINT handler in C that Python does not
    see (the child imports it before ignoring SIGINT, `_child_init`)."""
    import select
    import subprocess
    import sys
    import time

    code = ("import time\n"
            "from oserve.planner.process import PlannerProcess\n"
            "from oserve.planner.static import StaticPlanner\n"
            "from oserve.planner.candidates import homogeneous_deployment\n"
            "from oserve.specs import ReplicaShape, cluster_for_gpus\n"
            "if __name__ == '__main__':\n"
            "    p = PlannerProcess()\n"
            "    dep = homogeneous_deployment(cluster_for_gpus(8), ReplicaShape(4))\n"
            "    p.decide(StaticPlanner(dep, ('a', 'b')), None, None, [1.0, 2.0], None, 60.0)\n"
            "    print(p.child_pid(), flush=True)\n"
            "    time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        assert ready, "the parent did not start its child within 60 s"
        child = int(parent.stdout.readline())
        assert gone(child) is False
        with open(f"/proc/{child}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if gone(child):
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the planner child outlived its killed parent by 10 s")


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie not yet reaped by whoever adopted it counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True
