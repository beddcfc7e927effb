"""Security of the deploy/ configs against real nats-server processes: the launcher starts the production
config, one identity per worker role with only its subjects (every role at work under its own login,
and every identity probed on what it must not do), TLS with a self-signed CA, auth on by default off
loopback, and no secret in an error, a log line or the server's log tail.

`ROLES` below is the permission table, built from `oserve.streams.subjects.Subjects` and the stream names
of `oserve.streams.jetstream`; `deploy/nats-server.conf` must grant exactly it (the probes then check
that the server enforces it, and the live test that the workers need nothing more).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import traceback
import urllib.request
from pathlib import Path

import nats
import pytest

from conftest import REPO
from oserve.errors import ConfigError
from oserve.streams.jetstream import ensure_model_store, ensure_streams, stream_configs
from oserve.streams.server import (NatsServer, NatsServerError, config_requires_auth, config_store_dir,
                                   is_loopback, read_config, redact, strip_comments, with_store_dir)
from oserve.streams.subjects import Subjects

DEPLOY = REPO / "deploy"
S = Subjects()  # the permissions name the production prefix

# --- the permission table --------------------------------------------------------------------------


def _wild(subject_of) -> str:
    """A per-id subject with its id as `*` (`oserve.engine.*.dispatch`)."""
    return subject_of("ID").replace(".ID.", ".*.")


STREAMS = [c.name for c in stream_configs(S)]
KV_STREAM = f"KV_{S.strategy_bucket()}"
OBJ_STREAM = f"OBJ_{S.models_bucket()}"
JS_REPLIES = "_INBOX.>"  # nats.py's default inbox: the JetStream API answers the workers there
CLIENT_INBOXES = f"{S.reply_prefix()}.>"
KV_READ = f"$JS.API.STREAM.MSG.GET.{KV_STREAM}"
SETUP = frozenset({"$JS.API.STREAM.INFO.*", *(f"$JS.API.STREAM.CREATE.{n}" for n in [*STREAMS, KV_STREAM]),
                   *(f"$JS.API.STREAM.UPDATE.{n}" for n in STREAMS)})  # ensure_streams, in every worker


def _kv(key: str) -> str:
    return f"$KV.{S.strategy_bucket()}.{key}"


ACKS = f"{S.prefix}.ack.>"  # the switch planner's command acknowledgements (`Subjects.control_ack`)


def _inbox(user: str) -> str:
    return f"{S.reply_prefix()}.{user}.>"


def _ordered_consumer(stream: str) -> set[str]:
    return {f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.*", f"$JS.FC.{stream}.>"}


# the gateway's journal of owned requests, read back with the completions after a restart (`Gateway._recover`)
JOURNAL = {S.ownerships(), f"$JS.API.STREAM.MSG.GET.{S.stream_ownership()}",
           *_ordered_consumer(S.stream_ownership()), *_ordered_consumer(S.stream_completions()),
           *(f"$JS.API.CONSUMER.INFO.{n}.*" for n in (S.stream_ownership(), S.stream_completions()))}
ROLES: dict[str, tuple[frozenset[str], frozenset[str]]] = {  # user: (publish, subscribe)
    "gateway": (SETUP | {_wild(S.replica), S.arrivals(), CLIENT_INBOXES, KV_READ} | JOURNAL,
                frozenset({S.submit(), S.cancel(), S.users_submit(), S.users_cancel(), S.heartbeats(), S.completions(),
                           S.plan_event("assignment"), _wild(S.gateway_moves),
                           JS_REPLIES})),
    "engines": (SETUP | {S.completions(), S.heartbeats(), S.all_telemetry(), S.plan_event("replica"), CLIENT_INBOXES,
                         ACKS, _wild(S.gateway_moves)},
                frozenset({_wild(S.replica), _wild(S.host_control), JS_REPLIES})),
    "forecaster": (SETUP | {S.plan_event("forecast"), f"$O.{S.models_bucket()}.>", f"$JS.API.STREAM.CREATE.{OBJ_STREAM}",
                            f"$JS.API.STREAM.MSG.GET.{OBJ_STREAM}", f"$JS.API.STREAM.PURGE.{OBJ_STREAM}",
                            "$JS.API.STREAM.NAMES"}
                   | _ordered_consumer(S.stream_arrivals()) | _ordered_consumer(OBJ_STREAM),
                   frozenset({S.arrivals(), S.completions(), JS_REPLIES})),
    "scheduler": (SETUP | {S.plan_event("strategy"), _kv(S.STRATEGY_KEY), _kv(S.LEARNED_KEY), KV_READ},
                  frozenset({S.arrivals(), S.completions(), S.heartbeats(), S.plan_event("forecast"), JS_REPLIES})),
    "switch-planner": (SETUP | {S.plan_event("switch"), S.plan_event("assignment"), _wild(S.host_control),
                                _kv(S.ASSIGNMENT_KEY)},
                       frozenset({S.plan_event("strategy"), S.plan_event("replica"), S.heartbeats(), ACKS, JS_REPLIES})),
    "http": (SETUP | {S.submit(), S.cancel()}, frozenset({_inbox("http"), JS_REPLIES})),
}
WORKER_EXTRA_PUBLISH = {"_INBOX.>",  # `oserve up`'s own HTTP front takes its answers on nats.py's default inbox
                        "$JS.API.CONSUMER.LIST.*", "$JS.API.CONSUMER.NAMES.*"}  # read-only listing
IDENTITIES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    **ROLES,
    "worker": (frozenset().union(*(p for p, _ in ROLES.values())) | WORKER_EXTRA_PUBLISH,
               frozenset().union(*(s for _, s in ROLES.values()))),
    "alice": (frozenset({S.user_submit("alice"), S.user_cancel("alice")}), frozenset({_inbox("alice")})),
    "bob": (frozenset({S.user_submit("bob"), S.user_cancel("bob")}), frozenset({_inbox("bob")})),
    "telemetry": (frozenset({f"$JS.API.STREAM.INFO.{S.stream_telemetry()}", f"$JS.API.STREAM.INFO.{S.stream_plans()}",
                             *(f"$JS.API.DIRECT.GET.{n}{tail}" for n in (S.stream_telemetry(), S.stream_plans())
                               for tail in ("", ".>"))}),
                  frozenset({S.heartbeats(), S.all_telemetry(), S.plan_events(), _inbox("telemetry")})),
}
INBOX_PREFIX = {u: f"{S.reply_prefix()}.{u}" for u in ("alice", "bob", "telemetry", "http")}


def password_variable(user: str) -> str:
    return f"OSERVE_{user.upper().replace('-', '_')}_PASSWORD"


# --- helpers ----------------------------------------------------------------------------------------

def _covers(pattern: str, subject: str) -> bool:
    """Whether the NATS permission `pattern` allows `subject` (which may hold wildcards, for a subscription)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]) or (tok == "*" and s[i] == ">"):
            return False
    return len(s) == len(p)


def _allowed(patterns, subject: str) -> bool:
    return any(_covers(p, subject) for p in patterns)


def _permissions_of(text: str) -> dict[str, tuple[set[str], set[str], str]]:
    """{user: (publish, subscribe, password as written)} of a NATS config's authorization block."""
    body = strip_comments(text)

    def lists(chunk: str) -> tuple[set[str], set[str]]:
        out = []
        for key in ("publish", "subscribe"):
            m = re.search(key + r"\s*:\s*\[(.*?)\]", chunk, re.S)
            out.append(set(re.findall(r'"([^"]*)"', m.group(1))) if m else set())
        return out[0], out[1]

    named = {m.group(1): lists(m.group(2)) for m in re.finditer(r"^\s*([A-Z_]+)\s*=\s*\{(.*?)^\s*\}", body, re.M | re.S)}
    users = {}
    for m in re.finditer(r"\{\s*user:\s*([\w-]+),\s*password:\s*([^,\s]+),\s*permissions:\s*(\$\w+|\{.*?\})\s*\}",
                         body, re.S):
        perms = m.group(3)
        users[m.group(1)] = (*(named[perms[1:]] if perms.startswith("$") else lists(perms)), m.group(2))
    return users


def _passwords() -> dict[str, str]:
    return {user: secrets.token_hex(16) for user in IDENTITIES}


def _env(passwords: dict[str, str]) -> dict[str, str]:
    return {password_variable(u): p for u, p in passwords.items()}


class Login:
    """One connection and the permission violations the server reported on it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    @classmethod
    async def connect(cls, url: str, user: str, password: str, **kwargs) -> Login:
        self = cls()

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        if user in INBOX_PREFIX:
            kwargs.setdefault("inbox_prefix", INBOX_PREFIX[user])
        self.nc = await nats.connect(url, user=user, password=password, error_cb=on_error, allow_reconnect=False,
                                     **kwargs)
        return self

    def violations(self) -> set[tuple[str, str]]:
        """(publish | subscription, subject) of every permission violation (nats.py lower-cases the subject)."""
        found = set()
        for e in self.errors:
            m = re.search(r'permissions violation for (publish|subscription) to "([^"]+)"', e)
            if m:
                found.add((m.group(1), m.group(2)))
        return found


def _production(tmp_path: Path, passwords: dict[str, str], config: str = "nats-server.conf",
                extra_env: dict[str, str] | None = None) -> NatsServer:
    return NatsServer(config_file=DEPLOY / config, store_dir=tmp_path / "store",
                      env={**_env(passwords), **(extra_env or {})})


# --- 1. the launcher starts the production config ---------------------------------------------------

def test_the_config_helpers_read_store_dir_and_auth() -> None:
    prod = read_config(DEPLOY / "nats-server.conf")
    assert config_store_dir(prod) == "/var/lib/oserve/nats"
    assert config_store_dir("jetstream {}\n# store_dir: /x\n") is None
    assert config_requires_auth(prod) and config_requires_auth(read_config(DEPLOY / "nats-test.conf"))
    assert not config_requires_auth("jetstream {}\n# users: []\n")
    assert not config_requires_auth('authorization { users: [{user: a, password: b}] }\nno_auth_user: a\n')
    copy = with_store_dir(prod, "/tmp/x y")
    assert config_store_dir(copy) == "/tmp/x y" and copy.count("store_dir") == 1
    assert read_config(DEPLOY / "nats-server-tls.conf").count("authorization {") == 1  # the include, inlined
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    assert not is_loopback("nats.example")


async def test_the_launcher_starts_the_production_config_and_its_users_log_in(tmp_path) -> None:
    passwords = _passwords()
    with _production(tmp_path, passwords) as srv:
        assert srv.store_dir == tmp_path / "store"

        async def main() -> None:
            for user, password in passwords.items():
                login = await Login.connect(srv.url, user, password)
                await login.nc.flush()
                await login.nc.close()
            worker = await nats.connect(srv.url, user="worker", password=passwords["worker"])
            await ensure_streams(worker.jetstream(), S)
            await worker.close()
            # the quoted "$VAR" of the old config was the password itself: it logs in as nobody now
            for user in ("worker", "alice"):
                for wrong in (f"${password_variable(user)}", passwords[user] + "x", ""):
                    with pytest.raises((nats.errors.Error, OSError)):
                        await nats.connect(srv.url, user=user, password=wrong, allow_reconnect=False,
                                           max_reconnect_attempts=0, connect_timeout=2)

        await asyncio.wait_for(main(), 20)
        assert (tmp_path / "store" / "jetstream").is_dir()  # JetStream wrote to the store we gave


def test_a_config_with_its_own_store_dir_runs_on_it(tmp_path) -> None:
    store = tmp_path / "own-store"
    conf = tmp_path / "own.conf"
    conf.write_text(f'jetstream {{\n  store_dir: "{store}"\n}}\n')
    with NatsServer(config_file=conf) as srv:  # no -sd beside the config's own (nats-server: "Duplicate")
        assert srv.store_dir == store and store.is_dir()
        srv.restart()
        assert srv.store_dir == store
    assert store.is_dir()  # the config's store is not ours to remove


# --- 2. least privilege -------------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["nats-server.conf", "nats-test.conf", "k8s"])
def test_each_config_grants_exactly_the_permission_table(config) -> None:
    if config == "k8s":
        import yaml

        docs = yaml.safe_load_all((DEPLOY / "k8s" / "base" / "nats.yaml").read_text())
        text = next(d for d in docs if d and d["kind"] == "ConfigMap")["data"]["nats-server.conf"]
    else:
        text = read_config(DEPLOY / config)
    users = _permissions_of(text)
    assert set(users) == set(IDENTITIES), set(users) ^ set(IDENTITIES)
    for user, (publish, subscribe) in IDENTITIES.items():
        got_pub, got_sub, password = users[user]
        assert got_pub == publish, (user, "publish", sorted(got_pub - publish), sorted(publish - got_pub))
        assert got_sub == subscribe, (user, "subscribe", sorted(got_sub - subscribe), sorted(subscribe - got_sub))
        # unquoted: read from the environment (a quoted "$VAR" would be the password itself)
        expected = f'"test-{user}"' if config == "nats-test.conf" else f"${password_variable(user)}"
        assert password == expected, (config, user, password)
    for _, subscribe in ROLES.values():  # no worker role reads a client's inbox but its own
        assert not any(_covers(p, _inbox("alice")) for p in subscribe)


PUBLISH_PROBES = [
    S.submit(), S.cancel(), S.user_submit("alice"), S.user_cancel("alice"), S.user_submit("bob"), S.user_cancel("bob"),
    S.control_ack("planner", 1), S.replica("r0"), S.replica_control("r0"), S.host_control("h0"), S.arrivals(),
    S.completions(), *(S.plan_event(k) for k in ("forecast", "strategy", "switch", "assignment", "replica")),
    S.heartbeat("evil"), S.telemetry("r0"), f"{S.reply_prefix()}.alice.1", f"{S.reply_prefix()}.bob.1",
    f"{S.reply_prefix()}.http.1", "_INBOX.forged.1", *(_kv(k) for k in (S.STRATEGY_KEY, S.ASSIGNMENT_KEY, S.LEARNED_KEY)),
    f"$O.{S.models_bucket()}.C.x", f"$JS.API.STREAM.INFO.{S.stream_plans()}",
    f"$JS.API.STREAM.CREATE.{S.stream_plans()}", f"$JS.API.STREAM.UPDATE.{S.stream_plans()}",
    f"$JS.API.STREAM.CREATE.EVIL", f"$JS.API.STREAM.DELETE.{S.stream_plans()}",
    f"$JS.API.STREAM.PURGE.{S.stream_arrivals()}", f"$JS.API.STREAM.MSG.DELETE.{S.stream_plans()}", KV_READ,
    f"$JS.API.DIRECT.GET.{S.stream_plans()}", f"$JS.API.CONSUMER.CREATE.{S.stream_plans()}",
    f"$JS.API.CONSUMER.CREATE.{S.stream_arrivals()}", f"$JS.API.CONSUMER.LIST.{S.stream_plans()}", "$JS.API.INFO",
    "evil.subject",
]
SUBSCRIBE_PROBES = [
    S.submit(), S.cancel(), S.users_submit(), S.users_cancel(), S.user_submit("alice"), S.control_acks(), S.replica("r0"), S.host_control("h0"), S.arrivals(), S.completions(),
    *(S.plan_event(k) for k in ("forecast", "strategy", "switch", "assignment", "replica")), S.plan_events(),
    S.heartbeats(), S.all_telemetry(), f"{S.prefix}.>", _inbox("alice"), _inbox("bob"), _inbox("telemetry"),
    _inbox("http"), CLIENT_INBOXES, "_INBOX.>", f"$KV.{S.strategy_bucket()}.>", "$JS.API.>", ">",
]


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory):
    passwords = _passwords()
    with _production(tmp_path_factory.mktemp("probe"), passwords) as srv:  # no streams: probes change nothing
        yield srv, passwords


@pytest.mark.parametrize("user", list(IDENTITIES))
async def test_the_server_refuses_each_identity_exactly_what_the_table_does_not_grant(probe_server, user) -> None:
    srv, passwords = probe_server
    publish, subscribe = IDENTITIES[user]

    async def main() -> None:
        login = await Login.connect(srv.url, user, passwords[user])
        for subject in PUBLISH_PROBES:
            await login.nc.publish(subject, b"probe")
        subs = [await login.nc.subscribe(subject) for subject in SUBSCRIBE_PROBES]
        await login.nc.flush()
        expected = {("publish", s.lower()) for s in PUBLISH_PROBES if not _allowed(publish, s)} | \
                   {("subscription", s.lower()) for s in SUBSCRIBE_PROBES if not _allowed(subscribe, s)}
        for _ in range(100):  # the -ERRs come before the flush's PONG; their callbacks run as tasks
            if login.violations() >= expected:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        assert login.violations() == expected, (sorted(login.violations() - expected),
                                                sorted(expected - login.violations()))
        for sub in subs:
            await sub.unsubscribe()
        await login.nc.close()

    await asyncio.wait_for(main(), 10)
    # the refusals the issue asked for, spelled out
    if user in ("alice", "bob", "telemetry", "http"):
        for forbidden in (S.plan_event("switch"), _kv(S.STRATEGY_KEY), S.heartbeat("x"), S.replica("r0")):
            assert not _allowed(publish, forbidden), (user, forbidden)
    if user == "engines":
        for forbidden in (S.plan_event("strategy"), S.plan_event("assignment"), _kv(S.STRATEGY_KEY),
                          _kv(S.ASSIGNMENT_KEY), S.host_control("h0"), "_INBOX.x"):
            assert not _allowed(publish, forbidden), forbidden


async def test_each_role_keeps_its_jetstream_state_under_its_own_identity(tmp_path) -> None:
    """The JetStream side of each role: the scheduler and the switch planner write their keys only, the
    gateway and the scheduler read the bucket, the forecaster round-trips a model through the object
    store (an ordered consumer), as the workers do."""
    passwords = _passwords()

    async def main(url: str) -> None:
        logins = {u: await Login.connect(url, u, passwords[u]) for u in ROLES}
        kvs = {u: await ensure_streams(lo.nc.jetstream(), S) for u, lo in logins.items()}
        await kvs["scheduler"].put(S.STRATEGY_KEY, b'{"s": 1}')
        await kvs["scheduler"].put(S.LEARNED_KEY, b"{}")
        await kvs["switch-planner"].put(S.ASSIGNMENT_KEY, b'{"a": 1}')
        assert (await kvs["gateway"].get(S.ASSIGNMENT_KEY)).value == b'{"a": 1}'
        assert (await kvs["scheduler"].get(S.STRATEGY_KEY)).value == b'{"s": 1}'
        store = await ensure_model_store(logins["forecaster"].nc.jetstream(), S)
        blob = secrets.token_bytes(600_000)  # several chunks
        await store.put(S.FORECASTER_OBJECT, blob)
        await store.put(S.FORECASTER_OBJECT, blob[::-1])  # a second save purges the first's chunks
        assert (await store.get(S.FORECASTER_OBJECT)).data == blob[::-1]
        for lo in logins.values():
            await lo.nc.flush()
        assert all(not lo.errors for lo in logins.values()), {u: lo.errors for u, lo in logins.items()}
        # and not the others' keys: an engine or a gateway cannot write a strategy or an assignment
        for user, key in (("engines", S.STRATEGY_KEY), ("gateway", S.ASSIGNMENT_KEY),
                          ("switch-planner", S.STRATEGY_KEY), ("scheduler", S.ASSIGNMENT_KEY)):
            with pytest.raises((TimeoutError, nats.errors.NoRespondersError)):  # refused: no ack comes
                await asyncio.wait_for(kvs[user].put(key, b"forged"), 0.5)
            assert ("publish", _kv(key).lower()) in logins[user].violations()
        assert (await kvs["gateway"].get(S.ASSIGNMENT_KEY)).value == b'{"a": 1}'
        assert (await kvs["scheduler"].get(S.STRATEGY_KEY)).value == b'{"s": 1}'
        for lo in logins.values():
            await lo.nc.close()

    with _production(tmp_path, passwords) as srv:
        await asyncio.wait_for(main(srv.url), 30)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=15) as resp:
        return json.loads(resp.read())


async def test_every_worker_serves_under_its_own_identity_and_is_refused_nothing(tmp_path) -> None:
    """The whole pipeline, each worker its own login on the production config, the HTTP front included
    (its connection on the `_INBOX_oserve.http` inbox prefix), alice as a client and `oserve top`'s
    telemetry user: requests answered, a stream cancelled, every plan event seen, no permission refused.
    Then alice's replies forged onto control subjects land nowhere a worker role may not publish."""
    from oserve.observability.top import TopConfig, snapshot_once
    from oserve.streams.client import OServeClient
    from oserve.streams.schemas import SubmitRequest, encode
    from oserve.workers.clock import Clock
    from oserve.workers.system import LiveSystem, SystemConfig, planning_inputs

    passwords = _passwords()
    config = SystemConfig(subjects=S, speedup=10.0, span_s=5.0, heartbeat_interval_wall_s=0.1, history_minutes=10,
                          twin=False)
    inputs = planning_inputs(config)
    order = ("engines", "switch-planner", "gateway", "forecaster", "scheduler", "http")  # consumers first

    async def main(url: str) -> None:
        tele = await Login.connect(url, "telemetry", passwords["telemetry"])
        kinds: set[str] = set()
        plans: list[tuple[str, bytes]] = []

        async def on_plan(msg) -> None:
            kinds.add(msg.subject.rsplit(".", 1)[1])
            plans.append((msg.subject, msg.data))

        await tele.nc.subscribe(S.plan_events(), cb=on_plan)
        await tele.nc.flush()
        clock = Clock(config.speedup)
        logins: dict[str, Login] = {}
        systems: list[LiveSystem] = []
        try:
            for name in order:
                logins[name] = await Login.connect(url, name, passwords[name], name=f"oserve-{name}")
                system = LiveSystem(logins[name].nc, dataclasses.replace(config, workers=(name,)), inputs, clock=clock)
                await system.start()
                systems.append(system)
            alice = await Login.connect(url, "alice", passwords["alice"])
            client = OServeClient(alice.nc, S, owns_connection=True, user="alice")  # on alice's own subjects
            for _ in range(100):
                try:
                    if (await client.ping(timeout_s=0.5)).num_replicas > 0:
                        break
                except Exception:
                    pass
                await asyncio.sleep(0.1)
            replies = await asyncio.gather(*[client.submit(input_tokens=100 + i, max_tokens=8, timeout_s=10)
                                             for i in range(8)])
            assert all(r.output_tokens == 8 for r in replies)
            stream = client.stream(input_tokens=100, max_tokens=2000, timeout_s=10)
            async for _ in stream:
                break  # the first chunk, then the client goes away (a cancel)
            await stream.aclose()
            front = next(s.http for s in systems if s.http is not None)
            answer = await asyncio.to_thread(_post, f"{front.url}/completions",
                                             {"model": config.model, "prompt": "hello", "max_tokens": 5})
            assert answer["usage"]["completion_tokens"] == 5, answer
            for _ in range(200):
                if {"forecast", "strategy", "switch", "assignment", "replica"} <= kinds:
                    break
                await asyncio.sleep(0.05)
            assert {"forecast", "strategy", "switch", "assignment", "replica"} <= kinds, kinds
            view = await snapshot_once(tele.nc, TopConfig(subjects=S))
            assert view.strategy is not None and view.heartbeats
            for lo in (*logins.values(), alice, tele):
                await lo.nc.flush()
            await asyncio.sleep(0.1)
            refused = {name: lo.errors for name, lo in {**logins, "alice": alice, "telemetry": tele}.items() if lo.errors}
            assert not refused, refused

            # reply-subject injection: whatever the gateway does with these, no worker role may publish there
            kv = await ensure_streams(logins["gateway"].nc.jetstream(), S)
            strategy_rev = (await kv.get(S.STRATEGY_KEY)).revision
            spy = await Login.connect(url, "worker", passwords["worker"])
            landed: list[str] = []

            async def on_spy(msg) -> None:
                if b"inject-" in msg.data:
                    landed.append(msg.subject)

            targets = [S.plan_event("strategy"), S.plan_event("assignment"), S.host_control("h0"), "_INBOX.forged.1",
                       _kv(S.STRATEGY_KEY)]
            for t in targets[:-1]:
                await spy.nc.subscribe(t, cb=on_spy)
            await spy.nc.flush()
            # bob's own inbox: a well-formed inbox, but not alice's, so not for what alice sends
            bob = await Login.connect(url, "bob", passwords["bob"])
            bobs_inbox = f"{INBOX_PREFIX['bob']}.bobsclient.1"
            await bob.nc.subscribe(f"{INBOX_PREFIX['bob']}.>", cb=on_spy)
            await bob.nc.flush()
            before = len(plans)
            for i, target in enumerate([*targets, S.plan_event("switch"), bobs_inbox]):
                await alice.nc.publish(S.user_submit("alice"), encode(SubmitRequest(
                    request_id=f"inject-{i}", input_tokens=10, max_tokens=2)), reply=target)
            await alice.nc.flush()
            await asyncio.sleep(1.0)
            assert landed == []
            assert not alice.errors  # alice may publish on her subject: the gateway, not the server, refused these
            await bob.nc.close()
            forged = [subject for subject, data in plans[before:] if b"inject-" in data]
            assert forged == [], forged
            assert (await kv.get(S.STRATEGY_KEY)).revision >= strategy_rev  # the scheduler may have moved on
            assert b"inject-" not in (await kv.get(S.STRATEGY_KEY)).value
            await spy.nc.close()

            # the gateway crashes with a request it owns in its journal; its restart, under the gateway identity,
            # reads its journal and the completions back (consumers, consumer info, direct get), refused nothing
            from oserve.streams.schemas import Dispatch, Owned
            gw_system = next(x for x in systems if x.gateway is not None)
            await logins["gateway"].nc.publish(S.ownership(gw_system.gateway.config.gateway_id), encode(Owned(
                gateway_id=gw_system.gateway.config.gateway_id, reply=f"{INBOX_PREFIX['alice']}.gone.1",
                dispatch=Dispatch(request_id="journaled", input_tokens=10, max_tokens=2, type_index=0,
                                  gateway_id=gw_system.gateway.config.gateway_id))))
            await logins["gateway"].nc.flush()
            await logins["gateway"].nc.close()  # as a SIGKILL would: nothing drained
            await gw_system.stop()
            systems.remove(gw_system)
            logins["gateway"] = await Login.connect(url, "gateway", passwords["gateway"], name="oserve-gateway-2")
            restarted = LiveSystem(logins["gateway"].nc, dataclasses.replace(config, workers=("gateway",)), inputs,
                                   clock=clock)
            await restarted.start()
            systems.append(restarted)
            assert restarted.gateway.num_recovered >= 1 and "journaled" in restarted.gateway.pending
            reply = await client.submit(input_tokens=30, max_tokens=3, timeout_s=10)  # and it serves
            assert reply.output_tokens == 3
            await logins["gateway"].nc.flush()
            assert not logins["gateway"].errors, logins["gateway"].errors
            await client.close()
        finally:
            for system in reversed(systems):
                await system.drain()
                await system.stop()
            for lo in logins.values():
                await lo.nc.close()
            await tele.nc.close()

    with _production(tmp_path, passwords) as srv:
        await asyncio.wait_for(main(srv.url), 60)


# --- 3. TLS ---------------------------------------------------------------------------------------------

def make_certificates(folder: Path) -> dict[str, Path]:
    """A throw-away CA and a server certificate for localhost / 127.0.0.1 signed by it (openssl CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("TLS tests need the openssl CLI (the `cryptography` package is not installed either)")
    files = {k: folder / f"{k}.pem" for k in ("ca", "ca_key", "cert", "key", "csr")}
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(files["ca_key"]), "-out", str(files["ca"]),
        "-days", "2", "-subj", "/CN=oserve-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(files["key"]), "-out", str(files["csr"]),
        "-subj", "/CN=localhost")
    run("x509", "-req", "-in", str(files["csr"]), "-CA", str(files["ca"]), "-CAkey", str(files["ca_key"]),
        "-CAcreateserial", "-out", str(files["cert"]), "-days", "2", "-extfile", str(ext))
    return files


def tls_env(certs: dict[str, Path]) -> dict[str, str]:
    return {"OSERVE_NATS_TLS_CERT": str(certs["cert"]), "OSERVE_NATS_TLS_KEY": str(certs["key"])}


async def test_tls_lets_in_a_client_that_trusts_the_ca_and_refuses_plaintext(tmp_path) -> None:
    certs = make_certificates(tmp_path)
    passwords = _passwords()

    async def main(port: int) -> None:
        trusting = ssl.create_default_context(cafile=str(certs["ca"]))
        alice = await Login.connect(f"tls://localhost:{port}", "alice", passwords["alice"], tls=trusting)
        worker = await Login.connect(f"tls://127.0.0.1:{port}", "worker", passwords["worker"], tls=trusting)

        async def echo(msg) -> None:
            await worker.nc.publish(msg.reply, b"ok")

        await worker.nc.subscribe(S.users_submit(), cb=echo)
        await worker.nc.flush()
        # the worker's interest can reach alice's side of the server a moment after its flush on a loaded machine
        # (it came once with "no responders" in CI): asked again for up to 5 s, as `OServeClient` does
        for _ in range(50):
            try:
                reply = await alice.nc.request(S.user_submit("alice"), b"hi", timeout=5)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the worker's subscription never reached alice over TLS")
        assert reply.data == b"ok"
        await alice.nc.publish(S.plan_event("switch"), b"forged")  # the permissions hold over TLS too
        await alice.nc.flush()
        for _ in range(50):
            if alice.violations():
                break
            await asyncio.sleep(0.02)
        assert alice.violations() == {("publish", S.plan_event("switch"))}
        # a client that does not trust the CA: the handshake fails before any password is sent
        with pytest.raises(ssl.SSLCertVerificationError):
            await nats.connect(f"tls://127.0.0.1:{port}", user="alice", password=passwords["alice"],
                               tls=ssl.create_default_context(), allow_reconnect=False, connect_timeout=2)
        await alice.nc.close()
        await worker.nc.close()

    with _production(tmp_path, passwords, "nats-server-tls.conf", tls_env(certs)) as srv:
        await asyncio.wait_for(main(srv.port), 20)
        # a plaintext client with the right password: the server wants TLS first and closes on the CONNECT
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            info = json.loads(sock.recv(65536).decode().split(" ", 1)[1])
            assert info["tls_required"] is True
            sock.sendall(b'CONNECT {"user":"alice","pass":"' + passwords["alice"].encode() + b'","verbose":true}\r\n'
                         b"PING\r\n")
            got = b""
            try:
                while chunk := sock.recv(65536):
                    got += chunk
            except (ConnectionResetError, TimeoutError):
                pass
            assert b"+OK" not in got and b"PONG" not in got, got
        assert "TLS required for client connections" in srv.log_tail(400)


# --- 4. auth on by default off loopback -------------------------------------------------------------

def test_the_launcher_refuses_a_non_loopback_address_without_auth(tmp_path) -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", "nats.example"):
        with pytest.raises(ConfigError, match="not loopback.*authentication"):
            NatsServer(host=host)
    open_conf = tmp_path / "open.conf"
    open_conf.write_text("jetstream {}\n# authorization { users: [] }\n")
    guest = tmp_path / "guest.conf"
    guest.write_text('authorization { users: [{user: a, password: b}] }\nno_auth_user: a\n')
    for conf in (open_conf, guest):
        with pytest.raises(ConfigError, match="without credentials"):
            NatsServer(host="0.0.0.0", config_file=conf).start()
    with NatsServer(config_file=open_conf):  # on loopback it runs as it is
        pass


async def test_off_loopback_the_production_config_starts_and_wants_a_login(tmp_path, caplog) -> None:
    passwords = _passwords()
    srv = NatsServer(config_file=DEPLOY / "nats-server.conf", store_dir=tmp_path / "store", env=_env(passwords),
                     host="0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="oserve.nats"), srv:
        assert srv.url.startswith("nats://127.0.0.1:")
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(srv.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        nc = await nats.connect(srv.url, user="alice", password=passwords["alice"])
        await nc.close()
    assert "without TLS" in caplog.text  # off loopback without TLS: said once, loudly


# --- 5. no secret in an error, a log line or the log tail ---------------------------------------------

async def test_no_password_in_errors_logs_or_the_server_log(tmp_path, caplog) -> None:
    from oserve.streams.client import ClientError, OServeClient

    passwords = _passwords()
    wrong = "WRONG-" + secrets.token_hex(8)
    texts: list[str] = []

    def record(exc: BaseException) -> None:
        texts.append("".join(traceback.format_exception(exc)))
        texts.append(repr(exc))

    caplog.set_level(logging.DEBUG)
    with _production(tmp_path, passwords) as srv:
        for kwargs in ({"url": f"nats://alice:{wrong}@127.0.0.1:{srv.port}"},
                       {"url": srv.url, "user": "alice", "password": wrong},
                       {"url": f"nats://alice:{passwords['bob']}@127.0.0.1:{srv.port}"}):  # a real one, wrong user
            with pytest.raises(ClientError) as info:
                await OServeClient.connect(**kwargs, subjects=S, connect_timeout_s=0.5)
            record(info.value)
        texts.append(srv.log_tail(400))
    # launcher failures: a config that does not load, a port in use, a variable that is not an address
    bad = tmp_path / "bad.conf"
    bad.write_text("authorization { users: [ {user: a, password: $OSERVE_ALICE_PASSWORD} ] }\nlisten: $OSERVE_BOB_PASSWORD\n")
    with pytest.raises(NatsServerError) as info:
        NatsServer(config_file=bad, env=_env(passwords), ready_timeout_s=5).start()
    record(info.value)
    assert "could not parse address" in str(info.value) and "***" in str(info.value)  # the server printed it
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(NatsServerError) as info:
            NatsServer(config_file=DEPLOY / "nats-server.conf", store_dir=tmp_path / "s2", env=_env(passwords),
                       port=busy.getsockname()[1], ready_timeout_s=5).start()
        record(info.value)
    texts.append(caplog.text)
    everything = "\n".join(texts)
    assert "Authorization Violation" in everything and "alice:***@" in everything  # the failures were seen
    for secret in (*passwords.values(), wrong):
        assert secret not in everything
    assert redact("nats://u:p4ss@h:1 and p4ss", ["p4ss"]) == "nats://u:***@h:1 and ***"


async def test_oserve_worker_http_under_its_own_identity_gets_its_answers(capsys) -> None:
    """`oserve worker http` (`live_cmds._serve` with the `http` worker alone) connects on the `http` role's
    inbox prefix, so the answers to its requests reach it under the role's permissions (on nats-py's
    default `_INBOX` they were refused, and the front of `k8s/` got no answer)."""
    from oserve.cli.live_cmds import _serve, _system_config
    from oserve.workers.clock import Clock
    from oserve.workers.engine import EngineWorker, EngineWorkerConfig
    from oserve.workers.gateway import Gateway, GatewayConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        def url(user: str) -> str:
            return f"nats://{user}:test-{user}@127.0.0.1:{srv.port}"
        subjects = Subjects()  # the configs' permissions are for the `oserve` prefix
        gw_nc, engine_nc = await nats.connect(url("gateway")), await nats.connect(url("engines"))
        clock = Clock(speedup=50.0)
        engine = EngineWorker(engine_nc, EngineWorkerConfig("r0", subjects=subjects, heartbeat_interval_wall_s=0.05),
                              clock)
        gw = Gateway(gw_nc, GatewayConfig(subjects=subjects), clock)
        await engine.start()
        await gw.start()
        config = _system_config("oserve", "llama2-7b", 8, 50.0, 60.0, "azure-conv", "none", "", workers=("http",),
                                http_port=http_port)
        front = asyncio.create_task(_serve(url("http"), config, duration_s=30.0, label="http"))
        try:
            await gw.wait_for_replicas(1, 5)
            body = json.dumps({"model": "llama2-7b", "prompt": "hello", "max_tokens": 4}).encode()

            def post() -> dict:
                req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return json.loads(resp.read())
            answer = None
            for _ in range(100):  # until the front is up
                try:
                    answer = await asyncio.to_thread(post)
                    break
                except OSError:
                    await asyncio.sleep(0.1)
            assert answer is not None and answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 4
        finally:
            front.cancel()
            await asyncio.gather(front, return_exceptions=True)
            await gw.stop()
            await engine.stop()
            await gw_nc.close()
            await engine_nc.close()


async def test_refused_credentials_fail_at_once_not_at_the_connect_timeout() -> None:
    from oserve.streams.client import CannotConnect, OServeClient

    with NatsServer(config_file=str(DEPLOY / "nats-test.conf")) as srv:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(CannotConnect) as info:
            await OServeClient.connect(f"nats://127.0.0.1:{srv.port}", user="alice", password="not-hers-4711",
                                       connect_timeout_s=8.0)
        assert loop.time() - began < 2.0, "waited for the timeout after the server said no"
        assert "not-hers-4711" not in str(info.value) and "authorization" in str(info.value).lower()
