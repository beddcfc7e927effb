"""`oserve simulate`, `oserve bench e2e`, `bench ceiling`, `bench tune` and `oserve demo`: JSON shape, plots,
one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SHARED_DATA, run_cli


def test_simulate_json_and_plots(monkeypatch, capsys, tmp_path: Path) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "simulate", "--trace", "S1", "--minutes", "1", "--history-minutes",
                             "2", "--policy", "oserve,vllm-static,perfect-forecast", "--json", "--out", str(tmp_path))
    assert code == 0, err
    summary = json.loads(out)
    assert set(summary["policies"]) == {"oserve", "vllm-static", "perfect-forecast"}
    for s in summary["policies"].values():
        assert s["finished"] + s["dropped"] + s["refused"] == s["requests"] == summary["requests"]
        assert s["p50_e2e_s"] <= s["p99_e2e_s"]
    assert set(summary["speedup_p99"]) == {"vllm-static", "perfect-forecast"}
    assert 0 < summary["bound_p99_s"] <= min(s["p99_e2e_s"] for s in summary["policies"].values())
    assert summary["history_requests"] > 0 and set(summary["static_tried_on_history_p99_s"])
    for png in ("latency_cdf.png", "deployment_oserve.png", "rates_oserve.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text())["scenario"] == "S1"


def test_bench_ceiling_json_and_plot(monkeypatch, capsys, tmp_path: Path) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "bench", "ceiling", "--trace", "S1", "--minutes", "1", "--gpus",
                             "8", "--max-replicas", "2", "--slice-minutes", "0.5", "--json", "--out", str(tmp_path))
    assert code == 0, err
    result = json.loads(out)
    rows = result["outcomes"]
    assert result["deployments"] == len(rows) > 1 and result["best"] == rows[0]
    assert [r["p99_e2e_s"] for r in rows if not r["dropped"]] == sorted(r["p99_e2e_s"] for r in rows if not r["dropped"])
    assert all(r["replicas"] <= 2 for r in rows)
    assert set(result["p99"]) == {"oserve", "vllm-static", "perfect-forecast"}
    assert (tmp_path / "fixed_deployments.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "ceiling.json").read_text())["scenario"] == "S1"
    # the switching bound: a deployment per 30-second slice, never worse than the best single one run the same way
    sw = result["switching"]
    assert len(sw["per_slice"]) == 2 and set(sw["per_slice"]) <= set(sw["slice_p99_e2e_s"])
    assert sw["p99_e2e_s"] <= sw["constant_p99_e2e_s"] and sw["gain"] >= 1.0
    assert all(len(v) == 2 for v in sw["slice_p99_e2e_s"].values())
    assert (tmp_path / "switching.png").stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (("simulate", "--policy", "vllm-magic", "--minutes", "1"), "unknown policy 'vllm-magic'"),
    (("simulate", "--model", "gpt-9", "--minutes", "1"), "unknown model 'gpt-9'"),
    (("simulate", "--trace", "/no/such/file.csv"), "/no/such/file.csv"),
    (("simulate", "--forecaster", "crystal-ball", "--minutes", "1"), "unknown forecaster 'crystal-ball'"),
    (("demo", "--model", "gpt-9"), "unknown model 'gpt-9'"),
    (("simulate", "--load", "-1"), "--load must be > 0"),
    (("simulate", "--minutes", "0"), "--minutes must be > 0"),
    (("bench", "ceiling", "--max-replicas", "0"), "--max-replicas must be >= 1"),
    (("bench", "ceiling", "--top", "0"), "--top must be >= 1"),
    (("bench", "ceiling", "--slice-minutes", "-1"), "--slice-minutes must be >= 0"),
    (("bench", "e2e", "--set", "mine"), "--set must be one of"),
    (("bench", "levers", "--set", "mine"), "--set must be one of"),
    (("bench", "levers", "--jobs", "-1"), "--jobs must be >= 0"),
    (("bench", "robustness", "--jobs", "-1"), "--jobs must be >= 0"),
    (("bench", "robustness", "--perturbations", "gpu-x3"), "gpu-x3"),
    (("bench", "robustness", "--model", "llama-9000", "--jobs", "2"), "unknown model 'llama-9000'"),
    (("bench", "uncertainty", "--accuracies", "1,high"), "--accuracies must be numbers"),
    (("bench", "uncertainty", "--accuracies", "1.5"), "--accuracies must each be in [0, 1]"),
    (("simulate", "--trace", "S1", "--history-minutes", "0"), "history_minutes must be > 0"),
    (("replay", "--minutes", "0"), "--minutes and --history-minutes must be > 0"),
    (("demo", "--static-first", "--no-static"), "--static-first orders the live demo's two replays"),
    (("demo", "--static-first", "--simulated"), "--static-first orders the live demo's two replays"),
    (("demo", "--static-first", "--engine", "vllm"), "--static-first orders the live demo's two replays"),
    (("up", "--span-s", "-1"), "span_s"),
    (("up", "--speedup", "-1"), "speedup"),
    (("up", "--tracing", "jaeger"), "TracingConfig.exporter"),
])
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, args, message) -> None:
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0]


@pytest.mark.parametrize("mode, flags", [("live", []), ("live", ["--static-first"]),
                                         ("live", ["--no-measure", "--planner-thread"]),
                                         ("simulated", ["--simulated"])])
def test_demo_writes_a_report(monkeypatch, capsys, tmp_path: Path, mode: str, flags: list[str]) -> None:
    args = ["demo", "--minutes", "2", "--history-minutes", "3", "--out", str(tmp_path), "--json", *flags]
    static_first = "--static-first" in flags
    measure = "--no-measure" not in flags
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["mode"] == mode
    assert summary["p99_s"] > 0
    if mode == "live":
        assert summary["answered"] + summary["errors"] == summary["requests"] > 0
        assert summary["lost"] == 0
        # the scheduler decides in a child process unless told to use a thread, and the child made every decision
        in_child = "--planner-thread" not in flags
        assert summary["planner_process"] == in_child and summary["planner_fallbacks"] == 0
        assert summary["planner_children"] == (1 if in_child else 0)
        # only requests beyond the model's context window are refused (llama2-70b: 4096 tokens)
        assert set(summary["error_codes"]) <= {"invalid"}
        # the same replay against the static deployment, in the same run
        static = summary["static"]
        assert static["requests"] == summary["requests"] and static["lost"] == 0 and static["switches"] == 0
        assert summary["p99_ratio_static_over_oserve"] == pytest.approx(static["p99_s"] / summary["p99_s"])
        assert summary["order"] == (["static", "oserve"] if static_first else ["oserve", "static"])
        assert summary["forecaster_in_force"] in ("last_value", "lstm", "last_span")
        assert summary["spans"] and all(sp["forecaster"] for sp in summary["spans"])
        # the live planner is seeded as the simulator's OServe is: the static candidates' runs on the history
        # (the static run's choice among them) and OServe's trial there
        measured, tried = summary["measured_on_history"], static["chosen_on_history_p99_s"]
        assert len(tried) >= 1 and summary["decide_wall_s"]["budget"] > 0
        if measure:
            assert measured["runs"] == len(tried)
            trial = measured["trial"]
            assert trial["p99_s"] > 0 and trial["measured_best_p99_s"] in tried.values()
            assert trial["deferred"] == (trial["lost"] and trial["switches"] == 0)
            first = {"deferred"} if trial["deferred"] else {"initial", "initial-measured"}
        else:  # nothing measured: the planner plans from its model alone, and nothing makes it defer
            assert measured is None
            first = {"initial"}
            assert not {"deferred", "initial-measured"} & set(summary["decisions"])
        assert first & set(summary["decisions"])
        # the scheduler's learned capacity for the final deployment's shapes (the model's where nothing taught it)
        learned = summary["learned_capacity"]
        assert learned and all(row["learned_rps"] > 0 and row["scale"] > 0 for row in learned)
        assert summary["learned_windows"] >= 0 and summary["learned_max_scale_dev"] >= 0
        assert (tmp_path / "learned_capacity.png").stat().st_size > 10_000
        spans = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
        services = {a["value"]["stringValue"] for line in spans for rs in line["resourceSpans"]
                    for a in rs["resource"]["attributes"] if a["key"] == "service.name"}
        # one service per worker, the static run's under its own stem
        assert {f"{stem}-{worker}" for stem in ("oserve", "oserve-static") for worker in ("gateway", "engine")} \
            <= services <= {f"{stem}-{worker}" for stem in ("oserve", "oserve-static")
                            for worker in ("gateway", "engine", "forecaster", "scheduler", "switch-planner")}
    else:
        assert summary["answered"] + summary["refused"] + summary["unfinished"] == summary["requests"] > 0
    for name in ("latency_cdf.png", "deployment.png", "rates.png", "summary.json"):
        assert (tmp_path / name).exists()


def test_bench_e2e_json(monkeypatch, capsys, tmp_path: Path) -> None:
    # --no-trial: a trial is three more 10-minute histories on 16 GPUs here (the robustness test checks the trial)
    code, out, err = run_cli(monkeypatch, capsys, "bench", "e2e", "--scenarios", "S5,S1,servegen-m-mid", "--minutes",
                             "1", "--no-extra-32", "--no-trial", "--json", "--out", str(tmp_path))
    from oserve.evaluation.registry import BASELINES, POLICY_NAMES

    assert code == 0, err
    result = json.loads(out)
    s5, s1 = result["scenarios"][:2]
    assert s5["name"] == "S5@16" and s5["cv"] > 0.5 and s1["cv"] < s5["cv"]
    if (SHARED_DATA / "traces" / "servegen_m-mid.csv").is_file():
        sg = result["scenarios"][2]
        assert sg["name"] == "servegen-m-mid@16" and sg["requests"] > 0 and not result["skipped"]
    else:
        assert [s["name"] for s in result["skipped"]] == ["servegen-m-mid"]
    for row in result["scenarios"]:
        assert set(row["p99"]) == set(POLICY_NAMES)
        for k, v in row["speedup_p99"].items():
            ratio = row["p99"][k] / row["p99"]["oserve"]
            fewer = row["finished"]["oserve"] < row["finished"][k]
            assert v == pytest.approx(min(ratio, 1.0) if fewer else ratio)
        assert row["oserve_decide_s"]["count"] >= 1 and row["bound_p99_s"] <= row["p99"]["oserve"]
        assert row["oserve_trial"] is None and not row["oserve_deferred"]  # --no-trial: none ran, none deferred
        # the noise of the ratio to static: on the whole window it is the P99 ratio (uncapped)
        noise = row["static_noise"]
        assert noise["ratio"] == pytest.approx(row["p99"]["vllm-static"] / row["p99"]["oserve"])
        assert noise["low"] <= noise["high"] and noise["num_blocks"] >= 1
        # and against every other policy, the same way
        assert set(row["noise"]) == set(POLICY_NAMES) - {"oserve"} and row["noise"]["vllm-static"] == noise
        for k, n in row["noise"].items():
            assert n["ratio"] == pytest.approx(row["p99"][k] / row["p99"]["oserve"]) and n["low"] <= n["high"]
    assert result["worse_than_static_beyond_noise"] == [r["name"] for r in result["scenarios"]
                                                        if r["static_noise"]["high"] < 1]
    assert set(result["beyond_noise"]) == {*BASELINES, "perfect-forecast"}
    for k, v in result["beyond_noise"].items():
        assert v["better"] == [r["name"] for r in result["scenarios"] if r["noise"][k]["low"] > 1]
        assert v["worse"] == [r["name"] for r in result["scenarios"] if r["noise"][k]["high"] < 1]
    assert result["beyond_noise"]["vllm-static"]["worse"] == result["worse_than_static_beyond_noise"]
    assert result["oserve_decide_s"]["count"] == sum(r["oserve_decide_s"]["count"] for r in result["scenarios"])
    assert set(result["mean_speedup_p99"]) == {*BASELINES, "perfect-forecast"}
    assert set(result["cv_rank_correlation"]) == set(BASELINES)
    assert result["seconds"] > 0
    assert json.loads((tmp_path / "e2e.json").read_text())["scenarios"] == result["scenarios"]
    assert (tmp_path / "speedups.png").stat().st_size > 10_000


def test_demo_ctrl_c_drains_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole foreground process group, as a terminal sends it: the embedded NATS
    server must survive it (own session) so the workers can drain through it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", "from oserve.cli import main; main()", "demo", "--minutes", "30",
                             "--no-view", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while "Ctrl-C" not in seen and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
        time.sleep(2.0)  # replaying by now
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "draining" in err and "Traceback" not in err


def test_bench_peeking_json_and_plot(monkeypatch, capsys, tmp_path: Path) -> None:
    from oserve.evaluation.peeking import STEPS

    code, out, err = run_cli(monkeypatch, capsys, "bench", "peeking", "--scenarios", "S5", "--minutes", "1", "--gpus",
                             "8", "--json", "--out", str(tmp_path))
    assert code == 0, err
    result = json.loads(out)
    (row,) = result["scenarios"]
    assert row["scenario"] == "S5" and [s["step"] for s in row["steps"]] == list(STEPS)
    for s in row["steps"]:
        assert s["oserve_p99_s"] > 0 and s["static_p99_s"] > 0
        assert s["speedup"] == pytest.approx(s["static_p99_s"] / s["oserve_p99_s"]) or s["speedup"] <= 1.0
    assert (tmp_path / "peeking.png").stat().st_size > 10_000


def test_bench_uncertainty_json_and_plot(monkeypatch, capsys, tmp_path: Path) -> None:
    code, out, err = run_cli(monkeypatch, capsys, "bench", "uncertainty", "--scenarios", "S5", "--minutes", "1",
                             "--gpus", "8", "--accuracies", "1,0.6", "--json", "--out", str(tmp_path))
    assert code == 0, err
    result = json.loads(out)
    (row,) = result["scenarios"]
    assert row["scenario"] == "S5" and [p["label"] for p in row["points"]] == ["100%", "60%", "estimator"]
    exact, noisy, estimator = row["points"]
    assert exact["accuracy"] == 1.0 and abs(noisy["accuracy"] - 0.6) < 0.1 and 0 < estimator["accuracy"] <= 1
    for p in row["points"]:
        assert p["oserve_p99_s"] > 0
        assert p["speedup"] == pytest.approx(row["static_p99_s"] / p["oserve_p99_s"]) or p["speedup"] <= 1.0
    assert (tmp_path / "uncertainty.png").stat().st_size > 10_000


def test_bench_levers_json_and_plot(monkeypatch, capsys, tmp_path: Path) -> None:
    from oserve.evaluation.uncertainty import LEVERS

    code, out, err = run_cli(monkeypatch, capsys, "bench", "levers", "--scenarios", "S5", "--minutes", "1", "--gpus",
                             "8", "--jobs", "1", "--no-trial", "--json", "--out", str(tmp_path))
    assert code == 0, err
    result = json.loads(out)
    (row,) = result["scenarios"]
    assert row["scenario"] == "S5" and [p["label"] for p in row["points"]] == [label for label, _, _ in LEVERS]
    for p in row["points"]:
        assert p["oserve_p99_s"] > 0 and 0 < p["accuracy"] <= 1 and p["migrations"] >= 0
        assert p["speedup"] == pytest.approx(row["static_p99_s"] / p["oserve_p99_s"]) or p["speedup"] <= 1.0
    assert set(result["geomean_speedup_p99"]) == {label for label, _, _ in LEVERS}
    assert json.loads((tmp_path / "levers.json").read_text())["scenarios"][0]["scenario"] == "S5"
    assert (tmp_path / "levers.png").stat().st_size > 10_000


def test_bench_robustness_json_gives_the_speedup_over_static_with_its_interval(monkeypatch, capsys,
                                                                               tmp_path: Path) -> None:
    """Two injected errors in two processes: each row's speedup is static's P99 over OServe's, and the runs
    listed worse than static beyond noise are exactly those whose interval is wholly below 1."""
    code, out, err = run_cli(monkeypatch, capsys, "bench", "robustness", "--scenarios", "S5", "--perturbations",
                             "none,pp-x0.5", "--minutes", "2", "--gpus", "8", "--jobs", "2", "--json",
                             "--out", str(tmp_path))
    assert code == 0, err
    result = json.loads(out)
    assert result["processes"] == 2
    assert [(r["scenario"], r["perturbation"]) for r in result["rows"]] == [("S5", "none"), ("S5", "pp-x0.5")]
    for r in result["rows"]:
        res, n = r["results"], r["static_noise"]
        if res["oserve"]["finished"] == res["oserve"]["admitted"] == res["vllm-static"]["finished"]:
            assert n["ratio"] == pytest.approx(res["vllm-static"]["p99_e2e_s"] / res["oserve"]["p99_e2e_s"])
        assert n["low"] <= n["high"] and n["worse_beyond_noise"] == (n["high"] < 1.0)
        # OServe's trial on the history: it defers exactly when it lost there without switching
        t = r["trial"]
        assert t["deferred"] == (t["lost"] and t["switches"] == 0)
        if t["dropped"] == t["measured_best_dropped"] and None not in (t["p99_s"], t["measured_best_p99_s"]):
            assert t["lost"] == (t["p99_s"] > t["measured_best_p99_s"])  # (JSON writes inf as null)
        # the learned table's error through the window (every 10 minutes; a 2-minute window has its end only)
        assert [e["pairs"] for e in r["error_by_time"]] == [r["pairs"]]
    assert result["worse_than_static_beyond_noise"] == [
        f"S5/{r['perturbation']}" for r in result["rows"] if r["static_noise"]["high"] < 1.0]
    assert result["oserve_finishes_at_least_static"] == all(
        r["results"]["oserve"]["finished"] >= r["results"]["vllm-static"]["finished"] for r in result["rows"])
    assert json.loads((tmp_path / "robustness.json").read_text())["rows"][1]["perturbation"] == "pp-x0.5"
    assert (tmp_path / "robustness.png").stat().st_size > 10_000


def test_a_library_error_logged_with_its_traceback_reaches_the_user_as_one_line(monkeypatch) -> None:
    """Seen in CI: nats-py's read loop logged asyncio's InvalidStateError with a traceback while `oserve demo` drained
    after Ctrl-C. The command turns such a record into one line (its type and message)."""
    import asyncio
    import io
    import logging
    import sys

    from oserve import cli

    monkeypatch.setattr(sys, "argv", ["oserve", "--version"])
    for _ in range(2):
        try:
            cli.main()  # prints the version
        except SystemExit as exc:
            assert not exc.code
    log = logging.getLogger("nats.aio.client")
    assert sum(isinstance(f, cli._OneLineErrors) for f in log.filters) == 1
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        try:
            raise asyncio.InvalidStateError("invalid state")
        except asyncio.InvalidStateError as exc:
            log.error("nats: encountered error", exc_info=exc)
    finally:
        log.removeHandler(handler)
    assert stream.getvalue() == "nats: encountered error: InvalidStateError: invalid state\n"


def test_the_trial_s_verdict_reads_as_what_it_was_judged_on():
    """`trial_words`: nothing without a trial; a switching trial judged on the requests its switches left
    alone names them, both P99s there and the verdict; one judged on the whole history does not."""
    from oserve.cli.demo_cmd import trial_words

    assert trial_words({}) == ""
    base = {"p99_s": 29.34, "measured_best_p99_s": 16.62, "switches": 2, "deferred": True}
    untouched = {"requests": 8535, "p99_s": 26.24, "static_p99_s": 15.5, "ratio_low": 0.55, "ratio_high": 0.62,
                 "worse_beyond_noise": True}
    words = trial_words({**base, "judged_on": "untouched", "untouched": untouched})
    assert "P99 29.3 s against 16.6 s" in words and "2 switches" in words
    assert "on the 8,535 requests its switches did not touch 26.2 s against 15.5 s, slower beyond noise" in words
    assert words.endswith(", so it defers to that deployment")
    kept = trial_words({**base, "deferred": False, "judged_on": "untouched",
                        "untouched": {**untouched, "ratio_high": 1.2, "worse_beyond_noise": False}})
    assert "within noise or faster" in kept and "defers" not in kept
    assert "did not touch" not in trial_words({**base, "judged_on": "all", "untouched": untouched})
    # not judged (no tolerance, or too few untouched requests): no verdict read into the comparison
    assert "did not touch" not in trial_words({**base, "deferred": False, "judged_on": None, "untouched": untouched})
