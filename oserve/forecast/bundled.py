"""Forecasters shipped in `oserve.data`, trained on the bundled traces (see ATTRIBUTION.md there)."""

from __future__ import annotations

from oserve.data import data_path
from oserve.errors import ConfigError
from oserve.forecast.base import Forecaster
from oserve.forecast.registry import load_forecaster

# bundled trace name -> forecaster file in oserve.data; `meta` in the file gives the span and types
BUNDLED_FORECASTERS: dict[str, str] = {
    "azure-conv": "forecaster_lstm_azure_conv.json",
}


def load_bundled_forecaster(trace: str) -> Forecaster:
    """The LSTM trained on a bundled trace (reads that one shipped file).

    azure-conv: 10-s spans, the four types of `fit_types(trace, k=4, seed=0)` on the whole trace,
    trained on its first 90 % of spans with the history running to the end of the trace. Rebuilt by
    `oserve forecast --trace azure-conv --span 10 --model lstm --save-model oserve/data/<file>`.
    """
    if trace not in BUNDLED_FORECASTERS:
        raise ConfigError(f"no bundled forecaster for {trace!r}; bundled: {', '.join(BUNDLED_FORECASTERS)}")
    return load_forecaster(data_path(BUNDLED_FORECASTERS[trace]))
