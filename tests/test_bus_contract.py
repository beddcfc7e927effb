"""The published bus contract: the checked-in JSON Schema, the clock fields, weights and shares, the
README's client snippet and `oserve top`, the last two against a live system under the deploy permissions."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import msgspec
import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oserve.streams import schemas as sc
from oserve.streams.contract import REGENERATE, SCHEMA_FILE, bus_messages, bus_schema, message_schema, schema_json
from oserve.streams.subjects import Subjects
from oserve.workers.clock import Clock
from oserve.workers.scheduler import shares_from_weights, strategy_from_decision

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "data" / "bus"
DEPLOY = REPO / "deploy"


# --- the schema ---------------------------------------------------------------------------------------


def test_the_checked_in_schema_is_current() -> None:
    checked_in = (REPO / SCHEMA_FILE).read_text(encoding="utf-8")
    assert checked_in == schema_json(), (
        f"{SCHEMA_FILE} is out of date with streams/schemas.py: run `{REGENERATE}` and commit the result")


def test_every_message_is_in_the_schema_on_a_subject() -> None:
    doc = bus_schema()
    groups = {g["name"]: g for g in doc["x-subjects"]}
    assert "unassigned" not in groups, (
        f"messages with no subject: {groups.get('unassigned', {}).get('messages')}; give each a group in "
        "streams/contract.py (_GROUPS), then run `{REGENERATE}`")
    tags = [t for g in doc["x-subjects"] for t in g["messages"]]
    assert sorted(set(tags)) == sorted(msgspec.inspect.type_info(m).tag for m in bus_messages())
    # a message travels on one subject, but for the requests a client may send on the shared subject or its own
    twice = {t for t in tags if tags.count(t) > 1}
    assert twice == {"submit.v1", "ping.v1", "cancel.v1"}, twice
    assert groups["submit.user"]["messages"] == ["submit.v1", "ping.v1"]
    assert groups["cancel.user"]["messages"] == ["cancel.v1"]
    assert groups["submit"]["messages"] == ["submit.v1", "ping.v1"]
    assert {"reply.v1", "error.v1", "pong.v1"} <= set(groups["replies"]["messages"])
    assert groups["heartbeats"]["stream"] == groups["telemetry"]["stream"] == Subjects().stream_telemetry()
    jsonschema.Draft202012Validator.check_schema(doc)


def test_a_message_added_later_is_found_and_a_chunk_goes_to_the_replies() -> None:
    class TokenChunk(sc._Msg, frozen=True, kw_only=True, tag="token_chunk.v9"):
        request_id: str

    class Orphan(sc._Msg, frozen=True, kw_only=True, tag="orphan.v1"):
        x: int

    try:
        groups = {g["name"]: g["messages"] for g in bus_schema()["x-subjects"]}
        assert "token_chunk.v9" in groups["replies"] and groups["unassigned"] == ["orphan.v1"]
    finally:
        del TokenChunk, Orphan
        gc.collect()  # `__subclasses__` holds weak references: the other tests must not see them
    assert "orphan.v1" not in schema_json()


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.name)
def test_golden_files_validate_against_the_schema(path: Path) -> None:
    doc = json.loads((REPO / SCHEMA_FILE).read_text(encoding="utf-8"))
    data = json.loads(path.read_bytes())
    kind = {msgspec.inspect.type_info(m).tag: m for m in bus_messages()}[data["type"]]  # by the file's own tag
    jsonschema.validate(data, message_schema(doc, kind), cls=jsonschema.Draft202012Validator)
    jsonschema.validate(data, doc, cls=jsonschema.Draft202012Validator)  # any bus message
    group = next(g for g in doc["x-subjects"] if data["type"] in g["messages"])
    jsonschema.validate(data, {"$defs": doc["$defs"], **group["schema"]}, cls=jsonschema.Draft202012Validator)


def test_the_schema_refuses_what_the_decoder_refuses() -> None:
    doc = json.loads((REPO / SCHEMA_FILE).read_text(encoding="utf-8"))
    submit = message_schema(doc, sc.SubmitRequest)
    for bad in ({"type": "submit.v1", "request_id": "r", "input_tokens": -1},
                {"type": "submit.v9", "request_id": "r", "input_tokens": 1},
                {"type": "submit.v1", "request_id": "", "input_tokens": 1},
                {"type": "submit.v1", "input_tokens": 1}):
        with pytest.raises(sc.SchemaError):
            sc.decode_submit(json.dumps(bad).encode())
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, submit, cls=jsonschema.Draft202012Validator)


def test_oserve_schema_prints_and_writes_the_schema(monkeypatch, capsys, tmp_path) -> None:
    from conftest import run_cli

    code, out, _ = run_cli(monkeypatch, capsys, "schema")
    assert code == 0 and out == schema_json()
    code, _, err = run_cli(monkeypatch, capsys, "schema", "--out", str(tmp_path / "s.json"))
    assert code == 0 and (tmp_path / "s.json").read_text() == schema_json() and "wrote" in err


# --- clock fields, weights and shares -----------------------------------------------------------------


def test_clock_fields_map_clock_time_to_wall_time() -> None:
    clock = Clock(speedup=20.0, start_s=100.0)
    wall = clock.epoch_unix_s + clock.now_s() / clock.speedup
    assert abs(wall - time.time()) < 0.05
    epoch = time.time() - 3.0
    shared = Clock.from_epoch(epoch, 10.0)
    assert shared.stamp() == {"clock_epoch_unix_s": epoch, "clock_speedup": 10.0}
    assert abs(shared.now_s() - 30.0) < 0.5
    hb = sc.Heartbeat(replica_id="r0", at_s=shared.now_s(), num_waiting=0, num_running=0, **shared.stamp())
    back = sc.decode(sc.encode(hb), sc.Heartbeat)
    assert abs(back.clock_epoch_unix_s + back.at_s / back.clock_speedup - time.time()) < 0.05
    # an old producer's message decodes with the defaults (no mapping known)
    old = sc.decode(b'{"type":"heartbeat.v1","replica_id":"r0","at_s":1.0,"num_waiting":0,"num_running":0}',
                    sc.Heartbeat)
    assert (old.clock_epoch_unix_s, old.clock_speedup) == (0.0, 1.0)


def test_one_replica_gets_every_class_whole_whatever_its_rates() -> None:
    weights = [{"r0": 0.77}, {"r0": 1.33}, {"r0": 349.59}]
    assert shares_from_weights(weights) == [{"r0": 1.0}, {"r0": 1.0}, {"r0": 1.0}]
    assert shares_from_weights([{"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 3.0}]) == [{}, {"a": 0.25, "b": 0.75}]


@given(st.lists(st.dictionaries(st.sampled_from(["r0", "r1", "r2"]), st.floats(0, 1e4)), min_size=1, max_size=5))
def test_shares_sum_to_one_per_class_and_keep_the_rates_proportions(weights) -> None:
    shares = shares_from_weights(weights)
    assert len(shares) == len(weights)
    for row, share in zip(weights, shares):
        total = sum(row.values())
        if total > 0:
            assert abs(sum(share.values()) - 1.0) < 1e-9 and set(share) == set(row)
            for rid, w in row.items():
                assert abs(share[rid] - w / total) < 1e-9
        else:
            assert share == {}


def test_the_strategy_event_carries_rates_and_shares() -> None:
    from oserve.decision import Decision
    from oserve.specs import Deployment, Replica, ReplicaShape

    dep = Deployment((Replica("r0", ReplicaShape(2, 1), (0, 1)), Replica("r1", ReplicaShape(2, 1), (2, 3))))
    decision = Decision(dep, ((3.0, 1.0), (0.0, 2.0)), 0.0, (4.0, 2.0), "test")
    s = strategy_from_decision(decision, "s1", 1)
    assert s.weights == [{"r0": 3.0, "r1": 1.0}, {"r0": 0.0, "r1": 2.0}]
    assert s.shares == [{"r0": 0.75, "r1": 0.25}, {"r0": 0.0, "r1": 1.0}]


# --- live: the README's snippet and `oserve top`, under the deploy permissions ------------------------


def readme_client_snippet() -> str:
    """The first python block of the README's "The bus contract" section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## The bus contract", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block under '## The bus contract'"
    return match.group(1)


def test_the_readme_names_every_subject_of_the_contract() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## The bus contract", 1)[1].split("\n## ", 1)[0]
    for g in bus_schema()["x-subjects"]:
        assert f"`{g['subject']}`" in section, f"README 'The bus contract' does not list {g['subject']}"
    assert SCHEMA_FILE in section and "oserve top" in section and "shares" in section
    assert "clock_epoch_unix_s" in section


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from oserve.cli import main; main()", *args]


async def _run(cmd: list[str], env: dict | None = None, timeout_s: float = 60.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_readme_client_and_oserve_top_work_against_a_live_system(tmp_path) -> None:
    from oserve.streams.client import OServeClient
    from oserve.streams.server import NatsServer
    from oserve.streams.schemas import ForecastMade, decode
    from oserve.workers.system import LiveSystem, SystemConfig, planning_inputs

    snippet = tmp_path / "client.py"
    snippet.write_text(readme_client_snippet())
    subjects = Subjects("oserve")  # the permissions name the production prefix
    config = SystemConfig(subjects=subjects, speedup=10.0, span_s=5.0, heartbeat_interval_wall_s=0.1,
                          history_minutes=10, twin=False)

    async def main(url: str, port: int) -> None:
        nc = await nats.connect(url, user="worker", password="test-worker")
        forecasts: asyncio.Queue = asyncio.Queue()

        async def on_forecast(msg) -> None:
            ev = decode(msg.data, ForecastMade)
            if sum(ev.observed_counts):
                forecasts.put_nowait(ev)

        await nc.subscribe(subjects.plan_event("forecast"), cb=on_forecast)
        async with LiveSystem(nc, config, planning_inputs(config)) as system:
            await system.wait_serving(20)
            # the README's client, as written, logged in as a client of the deploy permissions
            code, out, err = await _run([sys.executable, str(snippet)],
                                        {"NATS_URL": f"nats://alice:test-alice@127.0.0.1:{port}"})
            assert code == 0, err
            assert '"type": "reply.v1"' in out or "'type': 'reply.v1'" in out, out
            client = await OServeClient.connect(url, subjects=subjects, user="alice", password="test-alice")
            for i in range(5):
                await client.submit(input_tokens=100 + i, max_tokens=8, timeout_s=10)
            await client.close()
            await asyncio.wait_for(forecasts.get(), 20)  # a span with arrivals closed: a forecast is stored
            await asyncio.sleep(0.3)  # and a heartbeat or two after it
            login = ["--nats", url, "--user", "telemetry", "--password", "test-telemetry"]
            code, out, err = await _run(_cli("top", *login, "--json"))
            assert code == 0, err
            snap = json.loads(out)
            code, text, err = await _run(_cli("top", *login, "--once"))
            assert code == 0, err
            chosen = [st.strategy_id for st in system.scheduler.strategies]
        await nc.close()
        ids = {r["replica_id"]: r for r in snap["replicas"]}
        assert ids and all(r["state"] == "serving" for r in ids.values()), snap["replicas"]
        assert all(r["last_heartbeat_unix_s"] and abs(r["last_heartbeat_unix_s"] - time.time()) < 30
                   for r in ids.values())
        assert snap["strategy"] and set(ids) >= {r["replica_id"] for r in snap["strategy"]["replicas"]}
        for row in snap["strategy"]["shares"]:
            assert not row or abs(sum(row.values()) - 1.0) < 1e-9
        assert snap["serving_strategy_id"] in chosen  # the system keeps re-planning meanwhile
        assert snap["workload"] and len(snap["workload"]["forecast_rps"]) == config.num_types
        assert any("start" in s for s in snap["switches"])  # the initial deployment's start
        assert "Replicas" in text and re.search(r"serving: s\d+", text), text

    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        await asyncio.wait_for(main(srv.url, srv.port), 120)
