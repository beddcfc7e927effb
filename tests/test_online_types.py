"""Online workload types: stable labels under drift, arrival-time classification, misclassification rate."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oserve.errors import ConfigError
from oserve.online_types import MisclassificationMeter, OnlineTypes, replay_misclassification
from oserve.workload_types import fit_types
from oserve.traces import load_trace

# true cluster centres in (log1p input, log1p output): SISO, SILO, LISO, LILO
CENTRES = np.array([[5.0, 3.0], [5.0, 6.0], [8.0, 3.0], [8.0, 6.0]])
SIGMA = 0.25


def tokens(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = np.rint(np.expm1(points)).astype(np.int64)
    return t[:, 0], t[:, 1]


def offline_types(seed: int = 0):
    rng = np.random.default_rng(seed)
    g = rng.integers(0, 4, 4000)
    inp, out = tokens(CENTRES[g] + rng.normal(0, SIGMA, (4000, 2)))
    types = fit_types(inp, out, k=4, seed=seed)
    assert types.names == ("SISO", "SILO", "LISO", "LILO")
    return types


TYPES = offline_types()


@settings(max_examples=8, deadline=None)
@given(drift=st.lists(st.tuples(st.floats(-0.5, 0.5), st.floats(-0.5, 0.5)), min_size=4, max_size=4),
       seed=st.integers(0, 2**16))
def test_labels_stay_stable_while_centroids_drift(drift, seed):
    rng = np.random.default_rng(seed)
    drift = np.array(drift)
    online = OnlineTypes(TYPES, learn_regressor=False)
    n = 6000
    g = rng.integers(0, 4, n)
    frac = (np.arange(n) / n)[:, None]
    points = CENTRES[g] + drift[g] * frac + rng.normal(0, SIGMA, (n, 2))
    inp, out = tokens(points)
    labels = np.array([online.learn_one(int(a), int(b)) for a, b in zip(inp, out)])
    # generating cluster j is type j throughout: no swap, even at the end where the drift is largest
    assert np.mean(labels == g) > 0.98
    assert np.mean(labels[-1000:] == g[-1000:]) > 0.98
    assert online.names == TYPES.names
    # and each centroid followed its own cluster
    final = CENTRES + drift
    assert np.max(np.linalg.norm(online.centroids_log - final, axis=1)) < 0.35
    snap = online.snapshot()
    assert snap.names == TYPES.names and np.allclose(np.array(snap.centroids_log), online.centroids_log)


def test_starts_from_the_offline_fit():
    online = OnlineTypes(TYPES)
    assert np.allclose(online.centroids_log, np.array(TYPES.centroids_log))
    assert online.classify_one(150, 20) == TYPES.classify_one(150, 20)


def test_predict_one_is_pure_and_uses_hint_then_estimate():
    online = OnlineTypes(TYPES)
    rng = np.random.default_rng(1)
    for _ in range(500):  # short prompts get long answers for tag "chat", short ones for tag "tool"
        online.learn_one(150, int(rng.integers(300, 500)), tag="chat")
        online.learn_one(150, int(rng.integers(10, 25)), tag="tool")
    state = pickle.dumps((online._kmeans, online._regressor, online.num_learned))
    assert online.predict_one(150, output_hint=400) == TYPES.index("SILO")
    assert online.predict_one(150, output_hint=20) == TYPES.index("SISO")
    assert online.predict_one(150, tag="chat") == TYPES.index("SILO")
    assert online.predict_one(150, tag="tool") == TYPES.index("SISO")
    assert online.estimate_output_one(150, tag="chat", max_tokens=50) <= 50
    assert online.predict_one(150, tag="chat", max_tokens=16) == TYPES.index("SISO")
    online.predict_one(150, tag="never-seen")
    assert pickle.dumps((online._kmeans, online._regressor, online.num_learned)) == state


def test_prior_estimate_before_any_completion():
    online = OnlineTypes(TYPES)
    est = online.estimate_output_one(1000)
    assert est == pytest.approx(np.expm1(online.prior_log_output))
    assert 0 <= online.predict_one(1000) < 4


def test_rejects_bad_values():
    with pytest.raises(ConfigError, match="halflife"):
        OnlineTypes(TYPES, halflife=1.5)
    with pytest.raises(ConfigError, match="grace_period"):
        OnlineTypes(TYPES, grace_period=0)
    online = OnlineTypes(TYPES)
    with pytest.raises(ConfigError, match="input_tokens"):
        online.predict_one(-1)
    with pytest.raises(ConfigError, match="output_tokens"):
        online.learn_one(10, -3)


def test_meter_counts():
    m = MisclassificationMeter(2)
    assert np.isnan(m.rate)
    for p, t in [(0, 0), (1, 0), (1, 1), (1, 1)]:
        m.update(p, t)
    assert m.count == 4 and m.rate == pytest.approx(0.25)
    assert m.per_type_rate() == [pytest.approx(0.5), 0.0]


def test_replay_on_azure_conv_measures_a_rate():
    trace = load_trace("azure-conv")
    inp, out = trace.input_tokens[:3000], trace.output_tokens[:3000]
    types = fit_types(inp[:600], out[:600], k=4, seed=0)
    with_hints = replay_misclassification(OnlineTypes(types, learn_regressor=False), inp, out, output_hints=out)
    assert with_hints.rate == 0.0 and with_hints.requests == 3000
    learned = replay_misclassification(OnlineTypes(types), inp, out, completion_lag_requests=20)
    prior = replay_misclassification(OnlineTypes(types, learn_regressor=False), inp, out,
                                     completion_lag_requests=20)
    assert 0 < learned.rate < 0.5 and 0 < prior.rate < 0.5
    assert sum(map(sum, learned.confusion)) == 3000
    d = learned.as_dict(types.names)
    assert set(d["per_type_rate"]) == set(types.names)


def test_the_regressor_stays_shallow_and_fast_however_long_it_learns():
    """Unbounded, River's Hoeffding tree splits the input length into a chain that slows every learn and
    prediction and ends in a RecursionError; `max_depth` keeps it bounded."""
    trace = load_trace("azure-conv")
    types = fit_types(trace.input_tokens, trace.output_tokens)
    online = OnlineTypes(types, max_depth=6, grace_period=50)
    rng = np.random.default_rng(0)
    for i in rng.integers(0, len(trace), 20_000):
        online.learn_one(int(trace.input_tokens[i]), int(trace.output_tokens[i]))
    assert online._regressor.height <= 7
