"""The live forecaster stage with a real NATS server: the LSTM trains on a thread, is saved in the JetStream
object store, and a restarted stage loads it (with its class names) instead of training again."""

from __future__ import annotations

import asyncio
import json

import nats
import numpy as np
import pytest
import torch

from oserve.forecast.baselines import LastValue
from oserve.forecast.gate import GatedForecaster
from oserve.forecast.lstm import LSTMForecaster
from oserve.forecast.registry import forecaster_from_dict
from oserve.streams.jetstream import ensure_model_store, ensure_streams
from oserve.streams.schemas import ForecastMade, decode
from oserve.streams.subjects import Subjects
from oserve.streams.testing import running_server, unique_subjects
from oserve.workers.clock import Clock
from oserve.workers.forecaster import ForecasterConfig, ForecasterStage

NAMES = ("SISO", "SILO", "LISO", "LILO")
SPAN_S = 3600.0  # the span loop never closes a span by itself here: the test closes them


@pytest.fixture(scope="module")
def server():
    yield from running_server()


def gate(history: np.ndarray) -> GatedForecaster:
    lstm = LSTMForecaster(4, lookback_spans=4, min_train_spans=8, retrain_every_spans=50, epochs=8, hidden_size=4)
    for row in history:
        lstm.learn_one(row)
    return GatedForecaster(LastValue(4).fit(history), SPAN_S, challenger=lstm)


async def until(predicate, timeout_s: float = 20.0) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(wait(), timeout_s)


async def test_a_restarted_stage_reuses_the_trained_lstm_and_its_class_names(server) -> None:
    rng = np.random.default_rng(0)
    history = rng.poisson([40, 10, 20, 5], size=(12, 4)).astype(float)

    async def main() -> dict:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js, subjects)
        store = await ensure_model_store(js, subjects)
        clock = Clock(speedup=1.0)
        events: list[ForecastMade] = []

        async def on_forecast(msg) -> None:
            events.append(decode(msg.data, ForecastMade))
        await nc.subscribe(subjects.plan_event("forecast"), cb=on_forecast)
        cfg = ForecasterConfig(subjects=subjects, span_s=SPAN_S, num_types=4)

        first = ForecasterStage(nc, cfg, clock, forecaster=gate(history), js=js, store=store, class_names=NAMES)
        await first.start()
        await until(lambda: first.num_trainings >= 1)  # trained on its own thread, the loop kept running
        for j, n in enumerate((30, 12, 25, 4)):
            first.observe(j, 5.0, n)
        await first.emit(0)
        trained = first.forecaster.challenger
        assert trained is not None and trained.ready
        await until(lambda: len(events) >= 1)
        saved = json.loads((await store.get(Subjects.FORECASTER_OBJECT)).data)
        weights = {k: v.clone() for k, v in trained.trained.net.state_dict().items()}
        await first.stop()  # as good as killed: nothing more is saved

        second = ForecasterStage(nc, cfg, clock, forecaster=gate(history), js=js, store=store, class_names=NAMES)
        await second.start()
        other = ForecasterStage(nc, cfg, clock, forecaster=gate(history), js=js, store=store,
                                class_names=("a", "b", "c", "d"))
        await other._load_saved()
        loaded = second.forecaster.challenger
        out = {"saved_meta": saved["meta"], "loaded": second.loaded_from_store, "ready": loaded.ready,
               "forecast": loaded.forecast(), "expected": forecaster_from_dict(saved["forecaster"]).forecast(),
               "same_weights": all(torch.equal(weights[k], v) for k, v in loaded.trained.net.state_dict().items()),
               "other_loaded": other.loaded_from_store, "event": events[0]}
        await asyncio.sleep(0.3)  # a loaded network is not retrained
        out["second_trainings"] = second.num_trainings
        await second.stop()
        await nc.close()
        return out

    r = await asyncio.wait_for(main(), 60)
    assert r["saved_meta"]["class_names"] == list(NAMES) and r["saved_meta"]["span_s"] == SPAN_S
    assert r["loaded"] and r["ready"] and r["second_trainings"] == 0
    assert r["same_weights"]  # the very network the first stage trained, bit for bit
    np.testing.assert_array_equal(r["forecast"], r["expected"])  # and the state it saved
    assert not r["other_loaded"]  # a network trained for other classes is not reused
    ev = r["event"]
    # span 0 was forecast by both (last value fitted on the history, the LSTM from its training on)
    assert set(ev.recent_rrmse) == {"last_value", "lstm"}
    assert ev.forecaster in ("last_value", "lstm")
    assert ev.forecaster == "lstm" or ev.forecaster_note  # either in force, or the reason it is not


async def test_a_restarted_stage_learns_only_the_spans_after_the_saved_network(server) -> None:
    """Spans the saved LSTM learned are rebuilt from the arrivals stream but not learned twice."""
    from oserve.streams.schemas import Arrival, Arrived, encode

    rng = np.random.default_rng(1)
    history = rng.poisson([40, 10, 20, 5], size=(12, 4)).astype(float)

    async def main() -> tuple[int, int]:
        subjects = unique_subjects()
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js, subjects)
        store = await ensure_model_store(js, subjects)
        span_s = 1.0
        clock = Clock(speedup=1.0)
        cfg = ForecasterConfig(subjects=subjects, span_s=span_s, num_types=4, grace_wall_s=0.05)

        def fresh() -> GatedForecaster:
            g = gate(history)
            g.span_s = span_s
            return g
        first = ForecasterStage(nc, cfg, clock, forecaster=fresh(), js=js, store=store, class_names=NAMES)
        await first.start()
        await until(lambda: first.num_trainings >= 1)
        # arrivals in two spans, published to the stream as a gateway does
        now = clock.now_s()
        items = [Arrival(request_id=f"q{i}", type_index=i % 4, at_s=now + (i % 2) * span_s, input_tokens=10,
                         est_output_tokens=10, replica_id="r0") for i in range(8)]
        await js.publish(subjects.arrivals(), encode(Arrived(gateway_id="g", items=items)))
        await until(lambda: first.num_events >= 3)
        spans_before = first.forecaster.challenger.num_spans
        await first._save()  # as the stage saves after a training
        await first.stop()
        second = ForecasterStage(nc, cfg, clock, forecaster=fresh(), js=js, store=store, class_names=NAMES)
        await second.start()
        await until(lambda: second.num_events >= 1)
        spans_after = second.forecaster.challenger.num_spans
        emitted = second._emitted
        await second.stop()
        # a stage on another clock (a restart without a shared epoch) cannot match the saved span numbers:
        # it keeps the network and learns every span it sees rather than skipping spans it never learned
        other_clock = ForecasterStage(nc, cfg, Clock(speedup=1.0, start_s=-1000.0), forecaster=fresh(), js=js,
                                      store=store, class_names=NAMES)
        await other_clock._load_saved()
        assert other_clock.loaded_from_store and other_clock._learned_through == -1
        assert second._learned_through >= 0  # the same clock kept it
        await nc.close()
        return spans_before, spans_after, emitted, first._emitted

    before, after, emitted_second, emitted_first = await asyncio.wait_for(main(), 60)
    # the second stage's network learned exactly the spans closed after the first one saved it
    assert after == before + (emitted_second - emitted_first)
