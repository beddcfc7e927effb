"""Every NATS subject, stream and bucket name OServe uses, built from one prefix. Pure.

Nobody spells a subject string elsewhere: workers, the client, tests and the NATS permissions in
`deploy/` all take their names from a `Subjects`. Tests give each one its own prefix so they cannot
hear each other on a shared server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from oserve.errors import ConfigError

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def _check_token(what: str, value: str) -> str:
    if not _TOKEN_RE.match(value):
        raise ConfigError(f"{what} must be letters, digits, '_' or '-' (one subject token), got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject and JetStream names under one prefix (`oserve` in production, one per test)."""

    prefix: str = "oserve"
    """First subject token of every subject; also the stem of stream and bucket names."""

    def __post_init__(self) -> None:
        _check_token("Subjects.prefix", self.prefix)

    # --- request path (core NATS, request/reply) ----------------------------------------------

    def submit(self) -> str:
        """Clients publish `SubmitRequest`s here; the gateways' queue group listens."""
        return f"{self.prefix}.req.submit"

    def cancel(self) -> str:
        """Clients publish `CancelRequest`s here (no queue group: every gateway hears it, the owner acts)."""
        return f"{self.prefix}.req.cancel"

    def user_submit(self, user: str) -> str:
        """Where the authenticated client `user` publishes its `SubmitRequest`s: the gateways serve a request
        from here only with a reply under that user's own inbox (`user_inbox_root`), so with permissions that
        let each user publish on its own subject alone (deploy/nats-server.conf), a client can have answers
        sent only to itself. The shared `submit` subject is for trusted identities and servers without auth."""
        return f"{self.prefix}.req.u.{_check_token('user', user)}.submit"

    def user_cancel(self, user: str) -> str:
        """Where `user` publishes its `CancelRequest`s; they may name only inboxes under `user_inbox_root`."""
        return f"{self.prefix}.req.u.{_check_token('user', user)}.cancel"

    def users_submit(self) -> str:
        """Every user's submit subject (the gateways' queue group listens)."""
        return f"{self.prefix}.req.u.*.submit"

    def users_cancel(self) -> str:
        return f"{self.prefix}.req.u.*.cancel"

    def user_of(self, subject: str) -> str | None:
        """The user a per-user submit or cancel subject belongs to; None for any other subject. Pure."""
        parts = subject.split(".")
        if len(parts) == 5 and parts[0] == self.prefix and parts[1:3] == ["req", "u"] and \
                parts[4] in ("submit", "cancel") and _TOKEN_RE.match(parts[3]):
            return parts[3]
        return None

    def user_inbox_root(self, user: str) -> str:
        """The inbox prefix of `user`'s connection (`OServeClient.connect`): its replies come under
        `<root>.`, which its permissions let it read and nobody else's."""
        return f"{self.reply_prefix()}.{_check_token('user', user)}"

    def replica(self, replica_id: str) -> str:
        """The gateway forwards `Dispatch`es to one engine worker here."""
        return f"{self.prefix}.engine.{_check_token('replica_id', replica_id)}.dispatch"

    def replica_control(self, replica_id: str) -> str:
        """Commands to one engine worker (start, drain)."""
        return f"{self.prefix}.engine.{_check_token('replica_id', replica_id)}.control"

    def reply_prefix(self) -> str:
        """Inbox prefix of clients; a client reads only replies under its own inbox."""
        return f"_INBOX_{self.prefix}"

    # --- events (captured by JetStream streams) -----------------------------------------------

    def arrivals(self) -> str:
        return f"{self.prefix}.evt.arrived"

    def completions(self) -> str:
        return f"{self.prefix}.evt.completed"

    def ownership(self, gateway_id: str) -> str:
        """One gateway's journal of the requests it owns (`Owned`, `Settled`), kept by the ownership stream so a
        gateway restarted under the same id takes them back."""
        return f"{self.prefix}.own.{_check_token('gateway_id', gateway_id)}"

    def ownerships(self) -> str:
        return f"{self.prefix}.own.*"

    def gateway_moves(self, gateway_id: str) -> str:
        """Where engines ask one gateway whether to move a request that outgrew its class (`MoveAsk`)."""
        return f"{self.prefix}.gw.{_check_token('gateway_id', gateway_id)}.move"

    def plan_event(self, kind: str) -> str:
        """Control-plane events: `forecast`, `strategy`, `switch`, `replica`, `assignment`."""
        return f"{self.prefix}.plan.{_check_token('kind', kind)}"

    def plan_events(self) -> str:
        return f"{self.prefix}.plan.>"

    def host_control(self, host_id: str) -> str:
        """Commands (`StartReplica`, `DrainReplica`) to one engine host."""
        return f"{self.prefix}.host.{_check_token('host_id', host_id)}.control"

    def control_ack(self, commander: str, n: int) -> str:
        """The reply subject of one acknowledged command (`CommandAck`) from `commander` (a switch planner's
        own token): engine hosts answer only under `{prefix}.ack.`, never on a command's arbitrary reply."""
        return f"{self.prefix}.ack.{_check_token('commander', commander)}.{int(n)}"

    def control_acks(self, commander: str = "*") -> str:
        """Every acknowledgement to `commander` (all commanders: the default)."""
        return f"{self.prefix}.ack.{commander if commander == '*' else _check_token('commander', commander)}.*"

    def is_control_ack(self, subject: str) -> bool:
        """Whether `subject` is a command's acknowledgement subject (`control_ack`). Pure."""
        parts = subject.split(".")
        return len(parts) == 4 and parts[0] == self.prefix and parts[1] == "ack" and \
            bool(_TOKEN_RE.match(parts[2])) and parts[3].isdigit()

    # --- liveness and telemetry (core NATS; the telemetry stream keeps the last hour) -----------

    def heartbeat(self, replica_id: str) -> str:
        return f"{self.prefix}.hb.{_check_token('replica_id', replica_id)}"

    def heartbeats(self) -> str:
        return f"{self.prefix}.hb.*"

    def telemetry(self, source_id: str) -> str:
        return f"{self.prefix}.telemetry.{_check_token('source_id', source_id)}"

    def all_telemetry(self) -> str:
        return f"{self.prefix}.telemetry.*"

    # --- JetStream names ------------------------------------------------------------------------

    def stream_arrivals(self) -> str:
        return f"{self.prefix.upper()}_ARRIVALS"

    def stream_completions(self) -> str:
        return f"{self.prefix.upper()}_COMPLETIONS"

    def stream_plans(self) -> str:
        return f"{self.prefix.upper()}_PLANS"

    def stream_ownership(self) -> str:
        """The gateways' journals (`ownership`), kept as long as a request may live."""
        return f"{self.prefix.upper()}_OWNED"

    def stream_telemetry(self) -> str:
        """Heartbeats and telemetry, kept for a bounded time so a consumer (`oserve top`) starts with state."""
        return f"{self.prefix.upper()}_TELEMETRY"

    def strategy_bucket(self) -> str:
        return f"{self.prefix}_strategy"

    def models_bucket(self) -> str:
        """The object store of trained models (the forecaster stage's LSTM)."""
        return f"{self.prefix}_models"

    # KV keys of the strategy bucket: the latest chosen strategy (deployment + weights), the
    # assignment the routers follow (written when a switch completes), and the scheduler's learned
    # capacity (`CapacityLearner.to_dict()` as JSON, written after each decision)
    STRATEGY_KEY = "current"
    ASSIGNMENT_KEY = "assignment"
    LEARNED_KEY = "learned"
    # object of the models bucket: the forecaster stage's trained LSTM with its class names
    FORECASTER_OBJECT = "forecaster-lstm"


def dedupe_key(reply: str, request_id: str) -> str:
    """The key requests are de-duplicated on: the reply inbox's client part and the request id. Pure.

    A client's inboxes share one prefix (one connection: `<root>.<user>.<random>.<n>`, or nats-py's
    `<root>.<random>.<n>`), so its retries and the gateway's re-dispatches are duplicates, while another
    client reusing the request id is not (it never gets the first's reply). The client part is the inbox
    without its last token; an inbox of two tokens (`_INBOX.<random>`, what nats-py's `new_inbox()` makes)
    is its client's alone, so it is kept whole: dropping the last token would leave `_INBOX`, shared by
    every such client.
    """
    return f"{client_part(reply)} {request_id}"


def client_part(reply: str) -> str:
    """The client part of a reply inbox (see `dedupe_key`): the inbox without its last token, or the whole
    inbox when it has two tokens. Pure."""
    head = reply.rpartition(".")[0]
    return head if "." in head else reply


def owner_of(gateway_id: str, reply: str) -> str:
    """Who holds a dispatched request: the gateway that sent it and its client's part of the inbox. Pure.

    Engines name it beside each request id in `Completed` (`Completion.owner`, `Migration.owner`,
    `Completed.released_owners`, `Completed.requeue_owners`); a gateway acts on an entry only when it names
    that gateway and the client of the request it holds under that id, so with several gateways, two clients
    that chose one request id never clear, re-dispatch or migrate each other's request.
    """
    return f"{gateway_id} {client_part(reply)}"


MAX_REPLY_CHARS = 256
_REPLY_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def gateway_of(owner: str) -> str:
    """The gateway id of an `owner_of` string (empty for an empty owner: an older gateway's dispatch). Pure."""
    return owner.split(" ", 1)[0]


def reply_error(reply: str, roots: tuple[str, ...]) -> str | None:
    """Why `reply` may not be used as a request's reply subject, or None when it may. Pure.

    The gateway forwards a client's reply subject to an engine, which publishes the answer there with a
    worker's permissions; unchecked, a client could make a worker publish on any subject (a control
    subject, a stream, a KV bucket, another client's inbox). A reply must be an inbox: one of `roots`
    (`Subjects.reply_prefix()`, and nats-py's default `_INBOX` where allowed) followed by at least one
    more token, every token letters, digits, `_` or `-` (no wildcard, no empty token).
    """
    if not reply:
        return "no reply subject: nobody would receive the answer"
    if len(reply) > MAX_REPLY_CHARS:
        return f"reply subject longer than {MAX_REPLY_CHARS} characters"
    root, _, rest = reply.partition(".")
    if root not in roots or not rest:
        return f"reply subject must be an inbox under {' or '.join(r + '.' for r in roots)}"
    if not all(_REPLY_TOKEN_RE.match(t) for t in rest.split(".")):
        return "reply subject tokens must be letters, digits, '_' or '-'"
    return None
