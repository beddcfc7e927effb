"""The bus contract without a server: subjects, strict edge decoding, golden files, engine backends, Clock."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oserve.streams import schemas as sc
from oserve.streams.subjects import Subjects
from oserve.workers.backends import EchoBackend, Job, SimBackend
from oserve.workers.clock import Clock

GOLDEN = Path(__file__).parent / "data" / "bus"
KINDS = {"submit": sc.SubmitRequest, "dispatch": sc.Dispatch, "reply": sc.Reply, "error": sc.ErrorReply,
         "arrived": sc.Arrived, "completed": sc.Completed, "heartbeat": sc.Heartbeat, "telemetry": sc.Telemetry,
         "assignment": sc.AssignmentSet, "reply_chunk": sc.ReplyChunk, "cancel": sc.CancelRequest,
         "abort": sc.AbortRequest, "start_replica": sc.StartReplica, "send_weights": sc.SendWeights,
         "weights_received": sc.WeightsReceived, "drain_replica": sc.DrainReplica,
         "switch_completed": sc.SwitchCompleted, "move_ask": sc.MoveAsk, "move_answer": sc.MoveAnswer}


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.name)
def test_golden_files_keep_decoding(path: Path) -> None:
    data = path.read_bytes()
    kind = KINDS[path.name.split(".")[0]]
    msg = sc.decode_submit(data) if kind is sc.SubmitRequest else sc.decode(data, kind)
    assert isinstance(msg, kind)
    # the round trip keeps every field the file gives
    again = json.loads(sc.encode(msg))
    for key, value in json.loads(data).items():
        assert again[key] == value


def _submit(**fields) -> bytes:
    base = {"type": "submit.v1", "request_id": "r1", "input_tokens": 10, "max_tokens": 5}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None}).encode()


@pytest.mark.parametrize("data,code", [
    (b"{not json", sc.ErrorCode.BAD_JSON),
    (b"", sc.ErrorCode.BAD_JSON),
    (_submit(type="submit.v9"), sc.ErrorCode.BAD_VERSION),
    (json.dumps({"request_id": "r1", "input_tokens": 3}).encode(), sc.ErrorCode.BAD_VERSION),
    (_submit(input_tokens=-1), sc.ErrorCode.INVALID),
    (_submit(max_tokens=0), sc.ErrorCode.INVALID),
    (_submit(input_tokens=10**12), sc.ErrorCode.INVALID),
    (_submit(output_hint_tokens=-3), sc.ErrorCode.INVALID),
    (_submit(request_id=""), sc.ErrorCode.INVALID),
    (_submit(input_tokens="many"), sc.ErrorCode.BAD_SCHEMA),
    (b"[1, 2]", sc.ErrorCode.BAD_SCHEMA),
    (_submit(prompt="hello"), sc.ErrorCode.INVALID),  # both prompt and input_tokens
    (_submit(input_tokens=None), sc.ErrorCode.INVALID),  # neither
    (b" " * (sc.MAX_MESSAGE_BYTES + 1), sc.ErrorCode.TOO_LARGE),
])
def test_bad_submissions_raise_structured_errors(data: bytes, code: str) -> None:
    with pytest.raises(sc.SchemaError) as info:
        sc.decode_submit(data)
    assert info.value.code == code
    assert info.value.message


@given(st.binary(max_size=300))
def test_decode_submit_never_raises_anything_but_schema_error(data: bytes) -> None:
    try:
        sc.decode_submit(data)
    except sc.SchemaError:
        pass


def test_prompt_text_is_counted_in_tokens() -> None:
    msg = sc.decode_submit(_submit(input_tokens=None, prompt="x" * 41))
    assert isinstance(msg, sc.SubmitRequest) and msg.prompt_tokens() == 11


def test_subjects_are_built_from_one_prefix_and_checked() -> None:
    s = Subjects("abc")
    assert s.submit() == "abc.req.submit"
    assert s.replica("r-1") == "abc.engine.r-1.dispatch"
    assert s.plan_event("forecast").startswith("abc.plan.")
    names = [s.submit(), s.replica("r"), s.arrivals(), s.completions(), s.heartbeat("r"), s.telemetry("r"),
             s.plan_events()]
    assert all(n.startswith("abc.") for n in names)
    for bad in ("a.b", "a b", "", "a*", "a>"):
        with pytest.raises(ValueError):
            Subjects(bad)
        with pytest.raises(ValueError):
            s.replica(bad)


def test_clock_runs_at_its_speedup() -> None:
    t = [100.0]
    clock = Clock(speedup=60.0, start_s=5.0, monotonic=lambda: t[0])
    assert clock.now_s() == 5.0
    t[0] += 2.0
    assert clock.now_s() == pytest.approx(125.0)
    assert clock.wall_seconds_until(185.0) == pytest.approx(1.0)
    assert clock.wall_seconds_until(0.0) == 0.0
    with pytest.raises(ValueError):
        Clock(speedup=0)


def test_core_does_not_import_the_bus() -> None:
    code = ("import sys, oserve, oserve.specs, oserve.traces, oserve.engine_model, oserve.planner.oserve, "
            "oserve.evaluation.compare\n"
            "bad = [m for m in ('nats', 'asyncio', 'opentelemetry', 'msgspec') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_clocks_from_one_epoch_agree() -> None:
    import time

    epoch = time.time() - 10.0
    a, b = Clock.from_epoch(epoch, speedup=60.0), Clock.from_epoch(epoch, speedup=60.0)
    assert a.now_s() == pytest.approx(600.0, abs=6.0)
    assert abs(a.now_s() - b.now_s()) < 1.0


def test_every_event_survives_its_own_encoding() -> None:
    quiet = sc.Telemetry(source_id="r0", at_s=1.0, window_s=5.0, num_requests=0, requests_per_s=0.0)
    assert sc.decode(sc.encode(quiet), sc.Telemetry) == quiet
    hb = sc.Heartbeat(replica_id="r0", at_s=0.0, num_waiting=0, num_running=0)
    assert sc.decode(sc.encode(hb), sc.Heartbeat) == hb


@pytest.mark.parametrize("make", [EchoBackend, lambda: SimBackend("r0")], ids=["echo", "sim"])
def test_engine_backend_contract(make) -> None:
    """Every backend finishes every job exactly once, with the tokens asked for, never before it arrived."""
    backend = make()
    rng = np.random.default_rng(1)
    jobs = {}
    finished = []
    now = 0.0
    for seq in range(1, 41):
        now += float(rng.exponential(0.05))
        job = Job(seq, f"q{seq}", int(rng.integers(1, 2000)), int(rng.integers(1, 300)), 0, now,
                  int(rng.integers(0, 400)))
        jobs[seq] = job
        finished += backend.add(job, now)
    while (t := backend.next_event_s()) is not None:
        finished += backend.advance(t)
    assert sorted(f.seq for f in finished) == sorted(jobs)
    for f in finished:
        job = jobs[f.seq]  # the simulated answer's length, capped at max tokens (max tokens when not given)
        assert not f.error and f.output_tokens == (min(job.output_tokens, job.max_tokens) or job.max_tokens)
        assert jobs[f.seq].arrival_s <= f.first_token_s <= f.finish_s
    load = backend.load()
    assert load.num_waiting == 0 and load.num_running == 0


def test_heartbeat_replica_ids_must_be_one_subject_token() -> None:
    for bad in ("", "a.b", "a b", "a*", "a>"):
        raw = json.dumps({"type": "heartbeat.v1", "replica_id": bad, "at_s": 0.0, "num_waiting": 0,
                          "num_running": 0}).encode()
        with pytest.raises(sc.SchemaError):
            sc.decode(raw, sc.Heartbeat)
    ok = sc.decode(sc.encode(sc.Heartbeat(replica_id="r-0_a", at_s=0.0, num_waiting=0, num_running=0)), sc.Heartbeat)
    assert ok.replica_id == "r-0_a"


def test_completed_without_released_ids_still_decodes() -> None:
    old = json.dumps({"type": "completed.v1", "replica_id": "r0", "items": []}).encode()
    ev = sc.decode(old, sc.Completed)
    assert isinstance(ev, sc.Completed) and ev.released == []
    new = sc.decode(sc.encode(sc.Completed(replica_id="r0", items=[], released=["q1"])), sc.Completed)
    assert new.released == ["q1"]


async def test_a_typed_subscription_hands_over_decoded_messages_and_counts_bad_ones() -> None:
    from types import SimpleNamespace

    from oserve.workers.base import Worker

    worker, seen = Worker(), []

    async def handler(ev, msg) -> None:
        seen.append(ev)

    callback = worker.typed(sc.Heartbeat, handler)
    good = sc.Heartbeat(replica_id="r0", at_s=1.0, num_waiting=0, num_running=2)
    for data in (sc.encode(good), b"{not json", sc.encode(sc.Ping())):
        await callback(SimpleNamespace(data=data, subject="x"))
    assert seen == [good] and worker.num_bad_messages == 2


async def test_stop_ends_a_loop_that_swallowed_its_cancellation() -> None:
    """Python 3.11's `asyncio.wait_for` returns the result it got at the moment its task was cancelled: a
    worker loop that waits with it (a heartbeat's `nc.flush`) can go on after `stop()` cancelled it. A stop
    that waited for such a loop never ended (a drained replica was never reported drained); it cancels
    again until the loops are gone."""
    from oserve.workers.base import RECANCEL_WALL_S, Worker

    loop = asyncio.get_running_loop()
    ready: list = []

    class Swallowing(Worker):
        def _loops(self):
            return [self._loop]

        async def _loop(self) -> None:
            while True:
                fut = loop.create_future()
                ready.append(fut)
                await asyncio.wait_for(fut, 60)  # done at the moment the task is cancelled: no CancelledError

    w = Swallowing()
    await w.start()
    while not ready:
        await asyncio.sleep(0)
    stopping = asyncio.create_task(w.stop())
    await asyncio.sleep(0)  # stop() has cancelled the runner; the TaskGroup cancels the loop
    ready[-1].set_result(None)  # ... just as what it waited for arrived
    await asyncio.wait_for(stopping, 10 * RECANCEL_WALL_S)
    assert w._runner is None and all(t.done() for t in w._loop_tasks)
