"""The published bus contract: which message goes on which subject, and the JSON Schema of each. Pure.

`bus_schema()` finds every bus message by itself (each subclass of `schemas._Msg`, so a message added
later is picked up without a list to keep) and groups them by the subject they travel on. A message no
group names lands in the `unassigned` group, where `tests/test_bus_contract.py` fails until it is given
a subject in `_GROUPS`. The output is one JSON Schema document (draft 2020-12): its `$defs` hold every
message, its `anyOf` accepts any bus message, and `x-subjects` lists the subjects with the messages
each carries. `oserve schema --out docs/bus-schema.json` regenerates the checked-in copy.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from dataclasses import dataclass
from typing import Callable

import msgspec

from oserve.streams import schemas
from oserve.streams.subjects import Subjects

SCHEMA_FILE = "docs/bus-schema.json"
"""Where the generated schema is checked in, relative to the repository root."""
REGENERATE = f"oserve schema --out {SCHEMA_FILE}"
_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def bus_messages() -> list[type[msgspec.Struct]]:
    """Every bus message: the subclasses of `_Msg`, at any depth, in definition order of their module. Pure."""
    seen: dict[type, None] = {}
    todo = list(schemas._Msg.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls not in seen:
            seen[cls] = None
            todo.extend(cls.__subclasses__())
    return list(seen)


def tag_of(cls: type[msgspec.Struct]) -> str:
    """The version tag a message carries in its `type` field (`"submit.v1"`). Pure."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{cls.__name__} has no string tag: every bus message needs tag='name.vN'")
    return tag


@dataclass(frozen=True, slots=True)
class _Group:
    name: str
    subject: Callable[[Subjects], str]
    """The subject, with placeholders (`REPLICA_ID`) where a token varies."""
    kind: str
    """How it travels: `request` (core NATS request/reply), `reply`, `event` (core publish) or `command`."""
    stream: Callable[[Subjects], str] | None
    """The JetStream stream that captures it, if any."""
    tags: tuple[str, ...]
    description: str


def _reply_subject(s: Subjects) -> str:
    return f"{s.reply_prefix()}.>"


_GROUPS: tuple[_Group, ...] = (
    _Group("submit", Subjects.submit, "request", None, ("submit.v1", "ping.v1"),
           "Clients send a request here with a reply inbox (NATS request/reply); the gateways' queue group answers."),
    _Group("cancel", Subjects.cancel, "command", None, ("cancel.v1",),
           "Clients abandon a request they sent (a stream closed early, a timeout); every gateway hears it, the one "
           "that owns the request checks the inbox prefix and acts."),
    _Group("submit.user", lambda s: s.user_submit("USER"), "request", None, ("submit.v1", "ping.v1"),
           "An authenticated client's own submit subject (permissions let only that user publish on it): as "
           "`submit`, but the gateways answer only a reply inbox of that user's, `_INBOX_<prefix>.<user>.`."),
    _Group("cancel.user", lambda s: s.user_cancel("USER"), "command", None, ("cancel.v1",),
           "An authenticated client's own cancel subject: it may cancel only requests sent with its own inboxes."),
    _Group("replies", _reply_subject, "reply", None, ("reply.v1", "error.v1", "pong.v1", "accepted.v1"),
           "What comes back to the request's reply inbox (a client reads only its own, `_INBOX_<prefix>.<user>.>`). "
           "Every reply message of another kind (a token chunk) arrives here too."),
    _Group("dispatch", lambda s: s.replica("REPLICA_ID"), "command", None,
           ("dispatch.v1", "abort.v1", "move_answer.v1"),
           "Internal: the gateway forwards a validated request to one engine, which replies to the client; aborts "
           "it there when its client cancelled it; and answers the engine's ask to move a request that outgrew "
           "its class."),
    _Group("move", lambda s: s.gateway_moves("GATEWAY_ID"), "command", None, ("move_ask.v1",),
           "Workers only: an engine asks the gateway that dispatched a request that outgrew its class whether to "
           "hand it back (answered on the engine's dispatch subject)."),
    _Group("arrivals", Subjects.arrivals, "event", Subjects.stream_arrivals, ("arrived.v1",),
           "Requests the gateways accepted (batched)."),
    _Group("completions", Subjects.completions, "event", Subjects.stream_completions, ("completed.v1",),
           "Requests the engines answered, with true output lengths (batched)."),
    _Group("ownership", lambda s: s.ownership("GATEWAY_ID"), "event", Subjects.stream_ownership,
           ("owned.v1", "settled.v1"),
           "Workers only: one gateway's journal of the requests it owns (before it tells a client it accepted one) "
           "and of those it no longer owns; a gateway restarted under the same id takes back the rest."),
    _Group("plan.forecast", lambda s: s.plan_event("forecast"), "event", Subjects.stream_plans, ("forecast.v1",),
           "At each span boundary: the span's per-type arrivals and the next span's forecast rates."),
    _Group("plan.strategy", lambda s: s.plan_event("strategy"), "event", Subjects.stream_plans, ("strategy.v1",),
           "The scheduler's decision: a deployment and per-class routing rates (`weights`) and fractions (`shares`)."),
    _Group("plan.switch", lambda s: s.plan_event("switch"), "event", Subjects.stream_plans,
           ("switch_planned.v1", "switch_completed.v1", "switch_rolled_back.v1", "replica_restarted.v1"),
           "A switch between deployments: planned, then completed or rolled back; and a replica of the deployment "
           "in force started again after it fell silent."),
    _Group("plan.replica", lambda s: s.plan_event("replica"), "event", Subjects.stream_plans,
           ("replica_ready.v1", "replica_drained.v1", "replica_failed.v1", "weights_received.v1", "weights_sent.v1"),
           "An engine host brought a replica up, released it or could not start it; in a live switch, a new replica "
           "received its weights and a serving one sent its part."),
    _Group("plan.assignment", lambda s: s.plan_event("assignment"), "event", Subjects.stream_plans,
           ("assignment.v1",), "The assignment the routers follow from now on (also in the strategy KV bucket)."),
    _Group("host.control", lambda s: s.host_control("HOST_ID"), "command", None,
           ("start_replica.v1", "drain_replica.v1", "send_weights.v1"),
           "Workers only: commands to one engine host (the switch planner's, with an id it wants acknowledged)."),
    _Group("control.ack", lambda s: s.control_ack("COMMANDER", 1), "reply", None, ("command_ack.v1",),
           "Workers only: an engine host acknowledges a command on its reply subject, under the commanding switch "
           "planner's own token; a command sent again with the same id is acknowledged `duplicate` and not run "
           "twice."),
    _Group("heartbeats", lambda s: s.heartbeat("REPLICA_ID"), "event", Subjects.stream_telemetry, ("heartbeat.v1",),
           "Each replica's liveness and load, twice a wall second; the router balances on it."),
    _Group("telemetry", lambda s: s.telemetry("SOURCE_ID"), "event", Subjects.stream_telemetry, ("telemetry.v1",),
           "Per-replica load and latency over the last window."),
)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a Struct's fields (a string literal right after `x: int`), by field name. Reads
    the class's source; {} where the source is not available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for field, after in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[field.target.id] = " ".join(after.value.value.split())
    return docs


def _describe_fields(defs: dict) -> None:
    """Give each property of `defs` the docstring under its field, where it has one (in place)."""
    for name, schema in defs.items():
        cls = getattr(schemas, name, None)
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            continue
        docs = {}
        for base in reversed(cls.__mro__):
            if isinstance(base, type) and issubclass(base, msgspec.Struct) and base.__module__ == schemas.__name__:
                docs.update(_field_docs(base))
        for field, prop in schema.get("properties", {}).items():
            if field in docs and "description" not in prop:
                prop["description"] = docs[field]


def _group_of(tag: str) -> str:
    for g in _GROUPS:
        if tag in g.tags:
            return g.name
    if "chunk" in tag or "delta" in tag:  # streamed pieces of an answer go to the reply inbox
        return "replies"
    return "unassigned"


def bus_schema(subjects: Subjects = Subjects()) -> dict:
    """The JSON Schema document of the bus under `subjects`' prefix, grouped by subject. Pure, deterministic."""
    messages = bus_messages()
    by_tag = {tag_of(cls): cls for cls in messages}
    _, defs = msgspec.json.schema_components(messages, ref_template="#/$defs/{name}")
    _describe_fields(defs)
    names = {tag: cls.__name__ for tag, cls in by_tag.items()}

    def refs(tags: list[str]) -> dict:
        return {"anyOf": [{"$ref": f"#/$defs/{names[t]}"} for t in tags]}

    # a message goes on every subject whose group names it (a request on the shared and the per-user subject)
    grouped: dict[str, list[str]] = {g.name: [t for t in by_tag if t in g.tags] for g in _GROUPS}
    for tag in by_tag:
        first = _group_of(tag)
        if tag not in grouped.get(first, []):
            grouped.setdefault(first, []).append(tag)
    out = []
    for g in (*_GROUPS, _Group("unassigned", lambda s: "", "", None, (), "Messages no subject names yet.")):
        tags = grouped.get(g.name, [])
        if not tags and g.name == "unassigned":
            continue
        out.append({"name": g.name, "subject": g.subject(subjects), "kind": g.kind,
                    "stream": g.stream(subjects) if g.stream else None, "description": g.description,
                    "messages": tags, "schema": refs(tags)})
    return {
        "$schema": _DIALECT,
        "$id": "https://oserve.invalid/bus-schema.json",
        "title": "OServe bus contract",
        "description": (
            f"Every message on the OServe NATS bus (subject prefix `{subjects.prefix}`), JSON with its version tag "
            "in `type`. Producers may add fields with defaults; consumers ignore fields they do not know. "
            "`at_s` and other clock times are on the workers' clock: wall_unix_s = clock_epoch_unix_s + "
            "at_s / clock_speedup. Generated by `oserve schema`; do not edit."),
        "anyOf": [{"$ref": f"#/$defs/{names[t]}"} for t in by_tag],
        "x-subjects": out,
        "$defs": defs,
    }


def schema_json(subjects: Subjects = Subjects()) -> str:
    """`bus_schema` as the text `oserve schema` writes (two-space indent, trailing newline). Pure."""
    return json.dumps(bus_schema(subjects), indent=2, ensure_ascii=False) + "\n"


def message_schema(document: dict, cls: type[msgspec.Struct]) -> dict:
    """A standalone schema for one message, referring into `document`'s `$defs`. Pure."""
    return {"$schema": _DIALECT, "$defs": document["$defs"], "$ref": f"#/$defs/{cls.__name__}"}
