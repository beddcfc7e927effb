"""LSTM forecaster (torch) over the last `lookback_spans` spans of every type's counts.

Pure core: no clock, no threads, no global seeding (initialisation runs under `torch.random.fork_rng`
with the forecaster's seed; shuffling uses its own `torch.Generator`); files only in `save`/`load`.

The network (an LSTNet-style hybrid, Lai et al., SIGIR 2018):
- input at each of the last `lookback_spans` spans: every type's count divided by that type's scale
  (its mean count in the training data, at least 1), plus the time of day as sin/cos when
  `season_spans` is set;
- an LSTM over that window; a linear head maps its last hidden state to a correction per type;
- in parallel, a linear autoregressive "highway" over the window, shared by the types and started at
  the last value (weight 1 on the last span), so the untrained network forecasts like last value and
  training learns how far to move from it (smoothing where counts are noisy, corrections where the
  other types or the time of day tell something);
- forecast = scale x (highway + correction), clipped at 0.

Training minimises the squared error in counts (each type weighted by its scale squared, so the loss is
the pooled MSE the metric reads), with Adam, a chronological validation slice for early stopping, and
the best validation weights kept.

Retraining never blocks forecasting. The caller schedules it (the core has no threads and no clock):
`needs_retrain()` says when; `prepare_retrain()` snapshots the history (cheap, on the owning thread);
the returned job's `run()` trains on that snapshot alone and can run anywhere (a worker's thread
executor, or inline in the simulator) while `forecast()` and `learn_one()` go on with the current
network; `install(result)` swaps the new network in with one assignment. `retrain()` does all three
inline.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster


class _Net(nn.Module):
    """LSTM over every type's log-scaled counts (+ time of day), a linear head giving a correction per
    type, and in parallel a linear autoregressive highway shared by the types, started at last value."""

    def __init__(self, k: int, num_time: int, hidden_size: int, lookback: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(k + num_time, hidden_size, batch_first=True)
        self.head = nn.Linear(hidden_size, k)
        self.ar = nn.Linear(lookback, 1)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.zero_()
            self.ar.weight.zero_()
            self.ar.weight[0, -1] = 1.0  # start at the last value
            self.ar.bias.zero_()

    def forward(self, z: torch.Tensor, tfeat: torch.Tensor) -> torch.Tensor:
        """z: (batch, lookback, k) scaled counts; tfeat: (batch, lookback, num_time). Returns (batch, k)."""
        zin = torch.log1p(torch.clamp(z, min=0.0))
        x = torch.cat([zin, tfeat], dim=2) if tfeat.shape[2] else zin
        out, _ = self.lstm(x)
        correction = self.head(out[:, -1])
        highway = self.ar(z.transpose(1, 2)).squeeze(-1)
        return highway + correction


@dataclass(frozen=True, slots=True, eq=False)
class TrainedLSTM:
    """A trained network with the scale it was trained for; what `install` swaps in."""

    net: _Net
    scale: np.ndarray  # (k,) counts per unit of network input/output
    trained_at_spans: int  # num_spans of the forecaster when the snapshot was taken
    validation_loss: float  # best validation loss (NaN without a validation slice)
    epochs_run: int


@dataclass(frozen=True, slots=True, eq=False)
class RetrainJob:
    """A snapshot to train on; `run()` touches nothing but the snapshot, so it may run on any thread."""

    history: np.ndarray  # (n, k) float64, filled, oldest first
    first_span: int  # absolute span index of history[0] (for the time of day)
    config: dict[str, Any]  # the forecaster's params()
    init_state: dict[str, torch.Tensor] | None  # fine-tune from these weights, or None: from scratch
    scale: np.ndarray | None  # keep this scale when fine-tuning
    epochs: int
    seed: int
    trained_at_spans: int

    def run(self) -> TrainedLSTM:
        """Train and return the result (seconds to minutes, CPU-bound). Pure apart from torch's threads."""
        return _train(self)


def _time_features(span_index: np.ndarray, season_spans: int | None, offset: int) -> np.ndarray:
    """(n, 2) sin/cos of the phase of each span in the season, or (n, 0) without a season. Pure."""
    if not season_spans:
        return np.zeros((len(span_index), 0))
    phase = 2 * math.pi * ((span_index + offset) % season_spans) / season_spans
    return np.column_stack([np.sin(phase), np.cos(phase)])


def _windows(history: np.ndarray, scale: np.ndarray, first_span: int, lookback: int,
             season_spans: int | None, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training windows: inputs (m, L, k), time features (m, L, t), targets (m, k), scaled. Pure."""
    z = history / scale
    tf = _time_features(np.arange(first_span, first_span + len(history)), season_spans, offset)
    idx = np.arange(lookback, len(history))
    gather = idx[:, None] + np.arange(-lookback, 0)[None, :]
    return z[gather], tf[gather], z[idx]


def _train(job: RetrainJob) -> TrainedLSTM:
    c = job.config
    k, lookback = c["k"], c["lookback_spans"]
    history = job.history
    scale = job.scale if job.scale is not None else np.maximum(history.mean(axis=0), 1.0)
    x, tf, y = _windows(history, scale, job.first_span, lookback, c["season_spans"], c["season_offset_spans"])
    m = len(y)
    num_val = int(round(m * c["validation_fraction"])) if m >= 20 else 0
    num_train = m - num_val
    weight = torch.tensor(scale ** 2 / np.mean(scale ** 2), dtype=torch.float32)
    xt, tft, yt = (torch.tensor(a, dtype=torch.float32) for a in (x, tf, y))
    num_time = tf.shape[2]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        net = _Net(k, num_time, c["hidden_size"], lookback)
    if job.init_state is not None:
        net.load_state_dict(job.init_state)
    # weight decay on the LSTM and its head only: decaying the highway would pull the level to 0
    highway = [p for n, p in net.named_parameters() if n.startswith("ar.")]
    others = [p for n, p in net.named_parameters() if not n.startswith("ar.")]
    opt = torch.optim.Adam([{"params": others, "weight_decay": c["weight_decay"]},
                            {"params": highway, "weight_decay": 0.0}], lr=c["learning_rate"])
    gen = torch.Generator().manual_seed(job.seed)

    def loss_of(sl: slice | torch.Tensor) -> torch.Tensor:
        pred = net(xt[sl], tft[sl])
        return (((pred - yt[sl]) ** 2) * weight).mean()

    best_state = copy.deepcopy(net.state_dict())
    best_val = math.inf
    if num_val:
        with torch.no_grad():
            best_val = float(loss_of(slice(num_train, m)))
    stale = 0
    epochs_run = 0
    for _ in range(job.epochs):
        net.train()
        order = torch.randperm(num_train, generator=gen)
        for start in range(0, num_train, c["batch_size"]):
            batch = order[start:start + c["batch_size"]]
            opt.zero_grad()
            loss = loss_of(batch)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        epochs_run += 1
        if num_val:
            net.eval()
            with torch.no_grad():
                val = float(loss_of(slice(num_train, m)))
            if val < best_val - 1e-9:
                best_val, best_state, stale = val, copy.deepcopy(net.state_dict()), 0
            else:
                stale += 1
                if stale >= c["patience_epochs"]:
                    break
    if num_val:
        net.load_state_dict(best_state)
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return TrainedLSTM(net=net, scale=np.asarray(scale, dtype=np.float64).copy(),
                       trained_at_spans=job.trained_at_spans,
                       validation_loss=best_val if num_val else float("nan"), epochs_run=epochs_run)


class LSTMForecaster(Forecaster):
    """Per-type next-span counts from an LSTM over the last `lookback_spans` spans (module doc).

    Ready once trained: `fit(history)` trains when the history holds at least `min_train_spans` spans
    (default lookback_spans + 16); an empty forecaster fed by `learn_one` becomes ready after the
    caller runs `retrain()` (or the prepare/run/install steps) when `needs_retrain()` says so.
    """

    kind = "lstm"
    _params = ("lookback_spans", "hidden_size", "season_spans", "season_offset_spans", "epochs",
               "batch_size", "learning_rate", "weight_decay", "validation_fraction", "patience_epochs",
               "min_train_spans", "max_train_spans", "retrain_every_spans", "finetune_epochs")

    @classmethod
    def _unit_test_params(cls) -> list[dict[str, Any]]:
        return [{"seed": 3, "lookback_spans": 8, "hidden_size": 8, "epochs": 4, "batch_size": 16},
                {"lookback_spans": 8, "hidden_size": 8, "epochs": 2, "season_spans": 12}]

    def __init__(self, k: int, seed: int = 0, *, lookback_spans: int = 50, hidden_size: int = 32,
                 season_spans: int | None = None, season_offset_spans: int = 0, epochs: int = 60,
                 batch_size: int = 64, learning_rate: float = 3e-3, weight_decay: float = 1e-3,
                 validation_fraction: float = 0.1, patience_epochs: int = 10,
                 min_train_spans: int | None = None, max_train_spans: int = 5000,
                 retrain_every_spans: int = 12, finetune_epochs: int = 5) -> None:
        super().__init__(k, seed)
        name = "LSTMForecaster"

        def pos_int(field: str, v: Any, minimum: int = 1) -> int:
            if not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= minimum):
                raise ConfigError(f"{name}: {field} must be an int >= {minimum}; got {v!r}")
            return int(v)

        self.lookback_spans = pos_int("lookback_spans", lookback_spans)
        self.hidden_size = pos_int("hidden_size", hidden_size)
        self.season_spans = None if season_spans is None else pos_int("season_spans", season_spans, 2)
        self.season_offset_spans = pos_int("season_offset_spans", season_offset_spans, 0)
        self.epochs = pos_int("epochs", epochs, 0)
        self.batch_size = pos_int("batch_size", batch_size)
        self.patience_epochs = pos_int("patience_epochs", patience_epochs)
        self.max_train_spans = pos_int("max_train_spans", max_train_spans)
        self.retrain_every_spans = pos_int("retrain_every_spans", retrain_every_spans, 0)
        self.finetune_epochs = pos_int("finetune_epochs", finetune_epochs, 0)
        self.min_train_spans = (self.lookback_spans + 16 if min_train_spans is None
                                else pos_int("min_train_spans", min_train_spans, self.lookback_spans + 1))
        if self.max_train_spans < self.min_train_spans:
            raise ConfigError(f"{name}: max_train_spans ({max_train_spans}) must be >= min_train_spans "
                              f"({self.min_train_spans})")
        for field, v in (("learning_rate", learning_rate), ("weight_decay", weight_decay)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name}: {field} must be a finite number >= 0; got {v!r}")
        if not (isinstance(validation_fraction, (int, float)) and 0 <= validation_fraction < 1):
            raise ConfigError(f"{name}: validation_fraction must be in [0, 1); got {validation_fraction!r}")
        self.learning_rate = float(learning_rate)
        self.weight_decay = float(weight_decay)
        self.validation_fraction = float(validation_fraction)
        self._reset()

    # ------------------------------------------------------------------------------ retraining

    def needs_retrain(self) -> bool:
        """Whether the caller should retrain now: untrained with enough history, or `retrain_every_spans`
        spans learned since the last training snapshot. Pure."""
        if self._model is None:
            return len(self._history) >= self.min_train_spans
        return bool(self.retrain_every_spans) and \
            self._num_spans - self._model.trained_at_spans >= self.retrain_every_spans

    def prepare_retrain(self, *, from_scratch: bool = False) -> RetrainJob:
        """Snapshot the history into a job (cheap). Fine-tunes the current network for
        `finetune_epochs` (keeping its scale) unless untrained or `from_scratch`. Pure."""
        if len(self._history) < self.min_train_spans:
            raise ConfigError(f"LSTMForecaster: training needs {self.min_train_spans} spans of history; "
                              f"has {len(self._history)}")
        history = np.array(self._history, dtype=np.float64)
        scratch = from_scratch or self._model is None
        return RetrainJob(
            history=history, first_span=self._num_spans - len(history), config=self.params(),
            init_state=None if scratch else copy.deepcopy(self._model.net.state_dict()),
            scale=None if scratch else self._model.scale.copy(),
            epochs=self.epochs if scratch else self.finetune_epochs,
            seed=self.seed + (0 if scratch else self._num_spans), trained_at_spans=self._num_spans)

    def install(self, trained: TrainedLSTM) -> None:
        """Swap in a trained network (one assignment; forecasts use it from the next call)."""
        if trained.scale.shape != (self.k,):
            raise ConfigError(f"LSTMForecaster: trained network is for {trained.scale.shape} types, not {self.k}")
        self._model = trained

    def retrain(self, *, from_scratch: bool = False) -> TrainedLSTM:
        """prepare_retrain + run + install, inline; returns what was installed."""
        trained = self.prepare_retrain(from_scratch=from_scratch).run()
        self.install(trained)
        return trained

    @property
    def trained(self) -> TrainedLSTM | None:
        """The network in use (None before training). Pure."""
        return self._model

    # ------------------------------------------------------------------------------ Forecaster

    def _reset(self) -> None:
        self._history: deque[np.ndarray] = deque(maxlen=max(self.max_train_spans, self.lookback_spans))
        self._model: TrainedLSTM | None = None

    def _fit_filled(self, rows: np.ndarray) -> None:
        for row in rows:
            self._history.append(row.copy())
        self._num_spans = len(rows)
        if len(self._history) >= self.min_train_spans:
            self.retrain(from_scratch=True)

    def _learn(self, row: np.ndarray) -> None:
        self._history.append(row.copy())

    def _ready(self) -> bool:
        return self._model is not None

    def _not_ready_reason(self) -> str:
        return (f"not trained yet: training needs {self.min_train_spans} spans, has {len(self._history)}; "
                f"call retrain() when needs_retrain() is true")

    def _forecast(self) -> np.ndarray:
        model = self._model  # read once: an install() between lines cannot mix two networks
        assert model is not None
        L = self.lookback_spans
        n = len(self._history)
        rows = [self._history[i] for i in range(max(0, n - L), n)]
        window = np.array(rows, dtype=np.float64)
        if len(window) < L:  # shorter than the lookback (only after a reset of history): pad at the front
            window = np.concatenate([np.repeat(window[:1], L - len(window), axis=0), window])
        span_index = np.arange(self._num_spans - L, self._num_spans)
        tf = _time_features(span_index, self.season_spans, self.season_offset_spans)
        with torch.no_grad():
            z = torch.tensor(window / model.scale, dtype=torch.float32).unsqueeze(0)
            t = torch.tensor(tf, dtype=torch.float32).unsqueeze(0)
            out = model.net(z, t)[0].double().numpy()
        return out * model.scale

    def _get_state(self) -> dict[str, Any]:
        model = self._model
        net_state = None
        if model is not None:
            net_state = {name: {"shape": list(t.shape), "data": t.detach().reshape(-1).tolist()}
                         for name, t in model.net.state_dict().items()}
        return {"history": [r.tolist() for r in self._history],
                "model": None if model is None else {
                    "scale": model.scale.tolist(), "trained_at_spans": model.trained_at_spans,
                    "validation_loss": None if math.isnan(model.validation_loss) else model.validation_loss,
                    "epochs_run": model.epochs_run, "net": net_state}}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._reset()
        for r in state["history"]:
            self._history.append(np.array(r, dtype=np.float64))
        m = state["model"]
        if m is None:
            return
        num_time = 2 if self.season_spans else 0
        with torch.random.fork_rng(devices=[]):  # the weights are overwritten: keep the global RNG as is
            net = _Net(self.k, num_time, self.hidden_size, self.lookback_spans)
        sd = {name: torch.tensor(v["data"], dtype=torch.float32).reshape(v["shape"])
              for name, v in m["net"].items()}
        net.load_state_dict(sd)
        net.eval()
        for p in net.parameters():
            p.requires_grad_(False)
        self._model = TrainedLSTM(net=net, scale=np.array(m["scale"], dtype=np.float64),
                                  trained_at_spans=int(m["trained_at_spans"]),
                                  validation_loss=float("nan") if m["validation_loss"] is None
                                  else float(m["validation_loss"]), epochs_run=int(m["epochs_run"]))
