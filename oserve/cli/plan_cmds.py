"""`oserve plan` and `oserve bench scheduler`: the deployment search from the command line."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import typer

from oserve.cli import app, bench_app
from oserve.errors import ConfigError

DEFAULT_TRACE = "azure-conv"


def parse_rates(text: str) -> dict[str, float]:
    """`NAME=RATE,NAME=RATE` -> {name: requests/s}. Pure; ConfigError says which item is wrong."""
    rates: dict[str, float] = {}
    if not text or not text.strip():
        raise ConfigError("--rates is empty; expected NAME=RATE pairs such as SISO=30,SILO=5,LISO=12,LILO=3")
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ConfigError(f"--rates: cannot parse {item.strip()!r}; expected NAME=RATE (requests/s), "
                              f"comma-separated")
        try:
            rate = float(value)
        except ValueError:
            raise ConfigError(f"--rates: rate of {name} is not a number: {value!r}") from None
        if not math.isfinite(rate) or rate < 0:
            raise ConfigError(f"--rates: rate of {name} must be a finite number >= 0 requests/s, got {value!r}")
        if name in rates:
            raise ConfigError(f"--rates: type {name} is given twice")
        rates[name] = rate
    return rates


def capacity_table(model_name: str, gpu_name: str, trace: str, gpus_per_node: int = 8) -> Any:
    """The capacity table for a model and GPU, with workload types fitted on a trace (reads the trace)."""
    from oserve.capacity import CapacityTable
    from oserve.specs import gpu_preset, model_preset
    from oserve.workload_types import fit_types
    from oserve.traces import load_trace

    model = model_preset(model_name)
    gpu = gpu_preset(gpu_name)
    loaded = load_trace(trace)
    types = fit_types(loaded.input_tokens, loaded.output_tokens)
    return CapacityTable(model, gpu, types, gpus_per_node=gpus_per_node)


def plan_to_json(plan: Any, model_name: str, num_gpus: int) -> dict[str, Any]:
    """The plan as plain data (what `oserve plan --json` prints). Pure."""
    a = plan.assignment
    util = dict(zip(a.replica_ids, a.utilisation))
    return {
        "model": model_name,
        "gpus": num_gpus,
        "search": plan.search,
        "types": list(a.type_names),
        "demand_rps": dict(zip(a.type_names, a.demand_rps)),
        "replicas": [{"replica_id": r.replica_id, "num_gpus": r.shape.num_gpus, "tp": r.shape.tp, "pp": r.shape.pp,
                      "gpu_ids": list(r.gpu_ids), "utilisation": util[r.replica_id]}
                     for r in plan.deployment.replicas],
        "assignment_rps": {rid: dict(zip(a.type_names, row)) for rid, row in zip(a.replica_ids, a.rates_rps)},
        "fractions": {rid: dict(zip(a.type_names, row)) for rid, row in zip(a.replica_ids, a.fractions)},
        "served_by_type_rps": dict(zip(a.type_names, a.served_by_type_rps)),
        "throughput_rps": plan.throughput_rps,
        "total_demand_rps": plan.demand_rps,
        "served_frac": plan.served_frac,
        "peak_utilisation": plan.peak_utilisation,
        "solve_s": plan.solve_s,
    }


@app.command("plan")
def plan_cmd(
    rates: str = typer.Option(..., "--rates", help="Requests/s per workload type: SISO=30,SILO=5,LISO=12,LILO=3."),
    model: str = typer.Option("llama2-70b", "--model", help="Model preset."),
    gpus: int = typer.Option(16, "--gpus", help="GPUs in the cluster (whole 8-GPU nodes above 8)."),
    search_name: str = typer.Option("milp", "--search", help="Deployment search: milp, paper or exhaustive."),
    gpu: str = typer.Option("h100", "--gpu", help="GPU preset."),
    trace: str = typer.Option(DEFAULT_TRACE, "--trace", help="Trace the workload types are fitted on "
                                                             "(bundled name or file)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Choose the deployment (replicas, TP/PP, GPUs) and the assignment for per-type request rates."""
    from oserve.scheduler import search
    from oserve.scheduler.search import check_search_fits, check_search_name
    from oserve.specs import cluster_for_gpus, model_preset

    # Cheap checks first, so bad input fails before the trace is read.
    check_search_name(search_name)
    model_spec = model_preset(model)
    cluster = cluster_for_gpus(gpus, gpu)
    check_search_fits(search_name, cluster.num_gpus)
    wanted = parse_rates(rates)
    table = capacity_table(model_spec.name, gpu, trace, cluster.gpus_per_node)
    plan = search(search_name, model_spec, cluster, wanted, table)
    if as_json:
        typer.echo(json.dumps(plan_to_json(plan, model_spec.name, cluster.num_gpus), indent=2))
        return
    _print_plan(plan, model_spec.name, cluster)


def _print_plan(plan: Any, model_name: str, cluster: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from oserve.cli.tables import compact

    console = Console()
    a = plan.assignment
    util = dict(zip(a.replica_ids, a.utilisation))
    deployment = Table(title=f"{model_name} on {cluster.num_gpus} x {cluster.gpu.name}: {plan.search} search")
    for col in ("replica", "GPUs", "TP", "PP", "GPU ids", "utilisation"):
        deployment.add_column(col, justify="left" if col in ("replica", "GPU ids") else "right")
    for r in plan.deployment.replicas:
        stages = " | ".join(",".join(str(g) for g in r.stage_gpus(s)) for s in range(r.shape.pp))
        deployment.add_row(r.replica_id, str(r.shape.num_gpus), str(r.shape.tp), str(r.shape.pp), stages,
                           f"{util[r.replica_id]:.1%}")
    console.print(compact(deployment))
    matrix = Table(title="Assignment (requests/s)")
    matrix.add_column("replica")
    for name in a.type_names:
        matrix.add_column(name, justify="right")
    for rid, row in zip(a.replica_ids, a.rates_rps):
        matrix.add_row(rid, *(f"{x:.3f}" for x in row))
    matrix.add_row("served", *(f"{x:.3f}" for x in a.served_by_type_rps), style="bold")
    matrix.add_row("demand", *(f"{x:.3f}" for x in a.demand_rps))
    console.print(compact(matrix))
    console.print(f"served {plan.throughput_rps:.3f} of {plan.demand_rps:.3f} requests/s "
                  f"({plan.served_frac:.1%}); peak utilisation {plan.peak_utilisation:.1%}; "
                  f"solved in {plan.solve_s * 1e3:.1f} ms")


@bench_app.command("scheduler")
def bench_scheduler(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    model: str = typer.Option("llama2-70b", "--model", help="Model preset."),
    gpu_counts: str = typer.Option("8,16,32,64,128", "--gpus", help="Comma-separated cluster sizes."),
    mixes: str = typer.Option("S1,S2,S3,S4,S5", "--mixes", help="Type mixes of the paper's Table 1."),
    searches: str = typer.Option("milp,paper,exhaustive", "--searches", help="Searches to run."),
    load: float = typer.Option(1.2, "--load", help="Demand as a multiple of the best homogeneous "
                                                   "deployment's saturation rate."),
    trace: str = typer.Option(DEFAULT_TRACE, "--trace", help="Trace the workload types are fitted on."),
) -> None:
    """Every deployment search on the paper's type mixes S1-S5 and cluster sizes: time, throughput,
    and throughput relative to the exhaustive search (where it runs, up to 16 GPUs)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from oserve.errors import UnknownNameError
    from oserve.scheduler.bench import PAPER_MIXES, bench_cases, num_bench_cases
    from oserve.scheduler.search import check_search_name
    from oserve.specs import model_preset

    model_spec = model_preset(model)
    try:
        counts = [int(g) for g in gpu_counts.split(",")]
    except ValueError:
        raise ConfigError(f"--gpus: expected comma-separated integers, got {gpu_counts!r}") from None
    mix_names = [m.strip() for m in mixes.split(",") if m.strip()]
    for m in mix_names:
        if m not in PAPER_MIXES:
            raise UnknownNameError("mix", m, tuple(PAPER_MIXES))
    search_names = [check_search_name(s.strip()) for s in searches.split(",") if s.strip()]
    table = capacity_table(model_spec.name, "h100", trace)
    total = num_bench_cases(counts, len(mix_names), search_names)
    err = Console(stderr=True)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("bench scheduler", total=total)

        def on_case(case: dict) -> None:
            bar.update(task, advance=1, description=f"{case['gpus']} GPUs {case['mix']} {case['search']}")

        cases = bench_cases(model_spec, table, gpu_counts=counts, mixes={m: PAPER_MIXES[m] for m in mix_names},
                            searches=search_names, load=load, on_case=on_case)
    if as_json:
        typer.echo(json.dumps({"model": model_spec.name, "load": load, "cases": cases}, indent=2))
        return
    _print_bench(cases)


def _print_bench(cases: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    from oserve.cli.tables import compact

    table = Table(title="Deployment searches (throughput in requests/s)")
    for col in ("GPUs", "mix", "search", "seconds", "throughput", "demand", "vs exhaustive", "vs milp", "peak util",
                "replicas"):
        table.add_column(col, justify="left" if col in ("mix", "search") else "right")
    for c in cases:
        ratios = ["" if c[key] is None else f"{c[key]:.4f}" for key in ("ratio_to_exhaustive", "ratio_to_milp")]
        table.add_row(str(c["gpus"]), c["mix"], c["search"], f"{c['seconds']:.3f}", f"{c['throughput']:.2f}",
                      f"{c['demand_rps']:.2f}", *ratios, f"{c['peak_utilisation']:.3f}", str(len(c["replicas"])))
    Console().print(compact(table))
    sys.stdout.flush()
