"""``loraplane sim`` (the tier simulator) and ``loraplane plan`` (the capacity planner)."""

from __future__ import annotations

from pathlib import Path

import click

from loraplane.eviction import POLICY_NAMES


def _parse_config(values: tuple[str, ...]) -> list[tuple[int, int]]:
    configs = []
    for value in values:
        gpu, sep, host = value.partition(":")
        if not sep or not gpu.isdigit() or not host.isdigit():
            raise click.BadParameter(f"{value!r} is not GPU:HOST, for example 32:100", param_hint="--config")
        configs.append((int(gpu), int(host)))
    return configs


@click.command()
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Recorded trace (.csv or .jsonl with timestamp,adapter,tenant,tokens) instead of the generator.",
)
@click.option("--adapters", "num_adapters", default=500, type=click.IntRange(min=1), help="Generator: number of adapters.")
@click.option("--requests", "num_requests", default=50_000, type=click.IntRange(min=1), help="Generator: number of requests.")
@click.option(
    "--zipf", "exponent", default=1.1, type=click.FloatRange(min=0), help="Generator: Zipf exponent of adapter popularity."
)
@click.option("--seed", default=11, type=int, help="Generator: LCG seed (11 reproduces the published table).")
@click.option(
    "--config",
    "configs",
    multiple=True,
    metavar="GPU:HOST",
    help="Tier sizes to simulate, repeatable. [default: 8:100 32:100 32:500 128:500]",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(list(POLICY_NAMES)),
    help="Eviction policy, repeatable. [default: lru]",
)
@click.option("--pin-top", default=0, type=click.IntRange(min=0), help="Pin the K most requested adapters in device slots.")
@click.option("--host-ms", default=3.0, type=click.FloatRange(min=0), help="Latency of a host-to-device load.")
@click.option("--cold-ms", default=120.0, type=click.FloatRange(min=0), help="Latency of a load from disk or object storage.")
@click.option("--compare", is_flag=True, help="Compare every policy (and pinning) at the first config, against LRU and Belady.")
@click.option(
    "--replicas",
    default=0,
    type=click.IntRange(min=0),
    help="Also simulate R replicas: round-robin against adapter-affinity routing.",
)
@click.option(
    "--epsilon",
    default=0.25,
    type=click.FloatRange(min=0),
    help="Affinity routing's load bound: no replica above (1+epsilon) x mean.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write hit rate vs GPU slots and wait vs host slots per policy to a PNG.",
)
def sim(
    trace_path: Path | None,
    num_adapters: int,
    num_requests: int,
    exponent: float,
    seed: int,
    configs: tuple[str, ...],
    policies: tuple[str, ...],
    pin_top: int,
    host_ms: float,
    cold_ms: float,
    compare: bool,
    replicas: int,
    epsilon: float,
    plot_path: Path | None,
) -> None:
    """Replay a request trace through GPU slots, host slots and cold storage.

    Prints, per tier configuration, GPU hit %, host hit %, cold loads and mean load wait per
    request. With no options it reproduces the seed lesson's table exactly. Long because it is
    the command: each option's branch of the report, read in the order it prints.
    """
    from loraplane.sim.replicas import simulate_replicas
    from loraplane.sim.report import comparison_table, replica_table, tier_table
    from loraplane.sim.tiers import Costs, lower_bound_wait_ms, simulate_tiers
    from loraplane.sim.trace import TraceFormatError, load_trace, zipf_trace

    try:
        trace = load_trace(trace_path) if trace_path else zipf_trace(num_adapters, num_requests, exponent, seed=seed)
    except TraceFormatError as exc:
        raise click.ClickException(str(exc)) from None
    sizes = _parse_config(configs) or [(8, 100), (32, 100), (32, 500), (128, 500)]
    chosen = list(policies) or ["lru"]
    costs = Costs(host_ms, cold_ms)
    pinned = trace.hottest(pin_top) if pin_top else []
    results = [simulate_tiers(trace.adapters, g, h, p, costs=costs, pinned=pinned) for p in chosen for g, h in sizes]
    click.echo(tier_table(results, show_policy=len(chosen) > 1 or bool(pinned)))

    if compare:
        g, h = sizes[0] if configs else (32, 100)
        pin_k = pin_top or g // 2
        rows = [simulate_tiers(trace.adapters, g, h, p, costs=costs) for p in ("lru", "lfu", "tinylfu", "demand")]
        rows.append(simulate_tiers(trace.adapters, g, h, "lru", costs=costs, pinned=trace.hottest(pin_k)))
        rows.append(simulate_tiers(trace.adapters, g, h, "tinylfu", costs=costs, pinned=trace.hottest(pin_k)))
        belady = simulate_tiers(trace.adapters, g, h, "belady", costs=costs)
        bound = lower_bound_wait_ms(trace.adapters, g, h, costs)
        click.echo(f"\npolicies at {g} GPU slots, {h} host slots ({len(trace)} requests over {len(trace.names)} adapters)")
        click.echo(comparison_table([*rows, belady], rows[0], belady, bound))

    if replicas:
        g, h = sizes[0] if configs else (32, 100)
        policy = chosen[0] if chosen[0] != "belady" else "lru"
        rr = [
            simulate_replicas(trace, replicas, g, h, routing, policy=policy, epsilon=epsilon, costs=costs)
            for routing in ("round-robin", "affinity")
        ]
        click.echo(f"\n{replicas} replicas, each {g} GPU / {h} host slots, {policy}; affinity bound (1+{epsilon:g}) x mean load")
        click.echo(replica_table(rr))

    if plot_path:
        from loraplane.sim.plot import plot_policies

        plot_policies(
            trace.adapters,
            list(POLICY_NAMES),
            plot_path,
            costs=costs,
            title=f"{len(trace)} requests over {len(trace.names)} adapters",
        )
        click.echo(f"\nwrote {plot_path}", err=True)


@click.command()
@click.argument("spec_path", metavar="PLAN.yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--no-simulate", is_flag=True, help="Only decide; skip the simulator's prediction.")
def plan(spec_path: Path, no_simulate: bool) -> None:
    """Size a fleet: merged deployments, rank cap, GPU and host slots, replicas.

    PLAN.yaml names the base (hidden size, layers, heads, target modules), the budget (adapter
    memory per replica, host memory, replicas, requests/s per replica) and the fine-tunes (inline
    or a CSV of name, share or rps, rank, size_mb). Each decision is printed with its reason,
    then the hit rates and load wait the simulator predicts for the plan.
    """
    from loraplane.sim.plan_input import PlanInputError, load_plan_input
    from loraplane.sim.planner import make_plan, predict

    try:
        spec = load_plan_input(spec_path)
    except PlanInputError as exc:
        raise click.ClickException(str(exc)) from None
    result = make_plan(spec)
    click.echo(f"plan for {len(spec.fine_tunes())} fine-tunes of {spec.base.name}")
    for line in result.reasons:
        click.echo(f"- {line}")
    if no_simulate:
        return
    predicted = predict(result, spec)
    if predicted is None:
        return
    click.echo(
        f"\npredicted on a {predicted.requests}-request trace with this traffic mix ({spec.knobs.policy}, affinity routing):\n"
        f"  GPU hit {100 * predicted.gpu_hit_rate:.1f}%  host hit {100 * predicted.host_hit_rate:.1f}%  "
        f"cold loads {predicted.cold_loads}  mean load wait {predicted.mean_wait_ms:.2f} ms/request  "
        f"busiest replica {predicted.max_share:.2f}x its even share"
    )
