"""The ``loraplane`` command. Subcommands import their part lazily, so ``loraplane operator`` never
pulls in torch and ``--help`` answers at once."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from loraplane import __version__
from loraplane.cli_usage import make_metering, usage, usage_options
from loraplane.eviction import ONLINE_POLICY_NAMES, POLICY_NAMES


def _parse_config(values: tuple[str, ...]) -> list[tuple[int, int]]:
    configs = []
    for value in values:
        gpu, sep, host = value.partition(":")
        if not sep or not gpu.isdigit() or not host.isdigit():
            raise click.BadParameter(f"{value!r} is not GPU:HOST, for example 32:100", param_hint="--config")
        configs.append((int(gpu), int(host)))
    return configs


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="loraplane")
def main() -> None:
    """Serve many LoRA fine-tunes of one base model on a fixed GPU budget.

    \b
    Start with:
      loraplane sim              replay the default Zipf trace through adapter tiers
      loraplane sim --compare    compare eviction policies against Belady's optimum
      loraplane plan examples/plan-500-finetunes-8b/plan.yaml
                                 size slots, rank cap and replicas for a fleet
      loraplane generate "Say hello" [--adapter DIR]
                                 one completion from the engine
    """


@main.command()
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
    request. With no options it reproduces the seed lesson's table exactly.
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


@main.command()
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


@main.command()
@click.argument("prompt")
@click.option("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct), a .gguf file or a checkpoint folder.")
@click.option("--adapter", default=None, help="PEFT adapter folder to apply (omit for the bare base).")
@click.option("--max-tokens", default=64, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, type=click.FloatRange(0, 2), help="0 is greedy.")
@click.option("--top-p", default=1.0, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, type=click.IntRange(min=0))
@click.option("--seed", default=None, type=int)
@click.option("--raw", is_flag=True, help="Send PROMPT as is instead of wrapping it in the chat template.")
@click.option("--fp8", is_flag=True, help="Run the base in float8_e4m3fn (adapters stay full precision).")
def generate(
    prompt: str,
    model: str,
    adapter: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    raw: bool,
    fp8: bool,
) -> None:
    """Complete PROMPT with the engine, optionally under a LoRA adapter: a quick look from the shell."""
    from loraplane.adapter_format import AdapterValidationError
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.llm_engine import LLMEngine, RequestError
    from loraplane.serving.engine.sampling_params import SamplingError, SamplingParams

    click.echo("loading the base model (the first start converts and caches it)...", err=True)
    engine = LLMEngine(EngineConfig(model=model, quantization="fp8" if fp8 else None, max_loras=1, max_lora_rank=64))
    name = None
    try:
        if adapter:
            name = "cli"
            engine.load_lora(name, adapter)
        ids = engine.tokenizer.encode(prompt) if raw else engine.tokenizer.chat([{"role": "user", "content": prompt}])
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        out = engine.generate([ids], params, [name])[0]
    except (AdapterValidationError, RequestError, SamplingError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(out.text)
    click.echo(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}]", err=True)


@main.command()
@click.option("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct), a .gguf file or a checkpoint folder.")
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=8000, type=click.IntRange(1, 65535))
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML file of engine settings (the flags' names with underscores); flags override it.",
)
@click.option(
    "--served-model-name",
    "base_name",
    help="The base's model id (vLLM's flag): what /v1/models lists and what adapters must declare as "
    "base_model_name_or_path [default: the embedded model's id, the .gguf's or the folder's name].",
)
@click.option("--base-revision", help="The base's revision; adapters that declare another are refused.")
@click.option("--lora-modules", multiple=True, metavar="NAME=SOURCE", help="Adapter to load at start (folder, file:// or s3://).")
@click.option("--max-loras", type=click.IntRange(min=1), help="Adapters resident in device slots at once.")
@click.option("--max-lora-rank", type=click.IntRange(min=1))
@click.option("--max-cpu-loras", type=click.IntRange(min=1), help="Adapters kept in host memory.")
@click.option("--max-num-seqs", type=click.IntRange(min=1))
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1))
@click.option("--max-model-len", type=click.IntRange(min=1))
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--quantization", type=click.Choice(["fp8"]))
@click.option("--lora-memory", type=click.Choice(["static", "unified"]))
@click.option("--eviction-policy", type=click.Choice(ONLINE_POLICY_NAMES))
@click.option("--admin-token", envvar="LORAPLANE_ADMIN_TOKEN", help="Bearer token the admin calls require.")
@click.option(
    "--tenants",
    "tenants_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML/JSON of tenants, their API keys and quotas (e.g. a mounted Secret); without it the API is open.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    help="Also serve /metrics, and nothing else, on this port (for Prometheus; with --tenants the API port's /metrics "
    "needs the admin token).",
)
@usage_options
@click.option(
    "--max-pending-requests", default=256, type=click.IntRange(min=1),
    help="Beyond this, answer 503 (shed load) to the tenants over their share of it.",
)  # fmt: skip
def serve(
    model: str,
    host: str,
    port: int,
    config_path: Path | None,
    lora_modules: tuple[str, ...],
    admin_token: str | None,
    tenants_path: Path | None,
    max_pending_requests: int,
    metrics_port: int | None,
    **flags: Any,
) -> None:
    """Serve the OpenAI-compatible API (completions, chat, models) plus adapter admin calls."""
    import uvicorn
    import yaml
    from pydantic import ValidationError

    from loraplane.serving.api.app import create_app
    from loraplane.serving.api.tenants import Tenants, load_tenants
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.llm_engine import LLMEngine

    if tenants_path is not None and not admin_token:
        # With tenants the API is closed to callers without a key; an open admin API would let
        # any of them register, pin or unload every tenant's adapters.
        raise click.UsageError(
            "--tenants needs --admin-token (or LORAPLANE_ADMIN_TOKEN): the admin calls would be open to every tenant"
        )
    metering = make_metering(flags)
    settings: dict[str, object] = yaml.safe_load(config_path.read_text()) or {} if config_path else {}
    settings["model"] = model if model != "embedded" or "model" not in settings else settings["model"]
    settings.update({k: v for k, v in flags.items() if v is not None})
    modules = dict(settings.get("lora_modules") or {})  # type: ignore[call-overload]
    for item in lora_modules:
        name, sep, source = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=SOURCE", param_hint="--lora-modules")
        modules[name] = source
    settings["lora_modules"] = modules
    try:
        config = EngineConfig.model_validate(settings)
    except ValidationError as err:
        raise click.ClickException(str(err)) from None
    try:
        tenants = Tenants(load_tenants(tenants_path) if tenants_path else None)
    except (ValidationError, yaml.YAMLError) as err:
        raise click.ClickException(f"{tenants_path}: {err}") from None
    app = create_app(
        lambda: LLMEngine(config), admin_token=admin_token, tenants=tenants, max_pending_requests=max_pending_requests,
        metering=metering,
    )  # fmt: skip
    if metrics_port is not None:
        from loraplane.serving.api.metrics_port import serve_metrics

        serve_metrics(app.state.metrics, host, metrics_port)
    uvicorn.run(app, host=host, port=port, log_level="info")


@main.command()
@click.option("--model", default="embedded", help="The base: 'embedded' (SmolLM2-135M-Instruct), a .gguf file or a folder.")
@click.option(
    "--out", "out_dir", default="loraplane-demo", type=click.Path(file_okay=False, path_type=Path), help="Plot and report."
)
@click.option("--requests", "num_requests", default=48, type=click.IntRange(min=1), help="Requests of mixed traffic.")
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    help="Their Poisson arrivals per second [default: half of what the showcase measured on this machine].",
)
def demo(model: str, out_dir: Path, num_requests: int, rate: float | None) -> None:
    """The main job on embedded defaults: train three style adapters (cached), serve them with the
    base on loopback, send mixed traffic as three tenants, print the answers and a per-adapter report."""
    from loraplane.serving.demo.run import run_demo

    run_demo(out_dir, model=model, num_requests=num_requests, rate=rate)


@main.command()
@click.option("--url", help="A running server (e.g. http://127.0.0.1:8000); omit to start one here with a synthetic fleet.")
@click.option(
    "--tenants",
    "tenants_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --url: the server's tenants file; each tenant calls its own adapters with its first key.",
)
@click.option("--api-key", envvar="OPENAI_API_KEY", help="With --url and no --tenants: the one key to call with.")
@click.option("--admin-token", envvar="LORAPLANE_ADMIN_TOKEN", help="With --url: lets the report read per-tier figures.")
@click.option("--model", default="embedded", help="In-process: the base ('embedded', a .gguf file or a checkpoint folder).")
@click.option("--num-adapters", default=50, type=click.IntRange(min=1), help="In-process: synthetic adapters to serve.")
@click.option("--num-tenants", default=4, type=click.IntRange(min=1), help="In-process: tenants owning them round-robin.")
@click.option("--max-loras", default=8, type=click.IntRange(min=1), help="In-process: device slots.")
@click.option("--max-cpu-loras", default=32, type=click.IntRange(min=1), help="In-process: host slots.")
@click.option("--max-lora-rank", default=64, type=click.IntRange(min=1), help="In-process: the fleet's ranks go up to 64.")
@click.option("--max-num-seqs", default=16, type=click.IntRange(min=1), help="In-process: running sequences at most.")
@click.option("--requests", "num_requests", default=200, type=click.IntRange(min=1))
@click.option("--rate", default=4.0, type=click.FloatRange(min=0, min_open=True), help="Poisson arrivals per second.")
@click.option("--zipf", "exponent", default=1.1, type=click.FloatRange(min=0), help="Zipf exponent of adapter popularity.")
@click.option("--prompt-words", default=32, type=click.IntRange(min=1))
@click.option("--max-tokens", default=16, type=click.IntRange(min=1), help="Output tokens per request (ignore_eos).")
@click.option("--seed", default=11, type=int)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the report as JSON.")
def bench(
    url: str | None,
    tenants_path: Path | None,
    api_key: str | None,
    admin_token: str | None,
    model: str,
    num_adapters: int,
    num_tenants: int,
    max_loras: int,
    max_cpu_loras: int,
    max_lora_rank: int,
    max_num_seqs: int,
    num_requests: int,
    rate: float,
    exponent: float,
    prompt_words: int,
    max_tokens: int,
    seed: int,
    json_path: Path | None,
) -> None:
    """Drive a server with a Zipf trace over adapters and tenants through the official openai client;
    report throughput, time to first token and inter-token latency, tier hit rates and per-tenant figures."""
    from loraplane.serving.api.tenants import load_tenants
    from loraplane.serving.bench.deployment import Deployment, remote
    from loraplane.serving.bench.report import format_report
    from loraplane.serving.bench.run import bench_in_process, run_bench
    from loraplane.serving.bench.workload import BenchRequest, zipf_requests
    from loraplane.serving.config import EngineConfig

    def requests_for(d: Deployment) -> list[BenchRequest]:
        return zipf_requests(
            d.models, d.owners, num_requests, rate=rate, exponent=exponent, prompt_words=prompt_words,
            max_tokens=max_tokens, seed=seed,
        )  # fmt: skip

    if url:
        deployment = remote(url.rstrip("/"), load_tenants(tenants_path) if tenants_path else None, api_key, admin_token)
        report, _ = run_bench(deployment, requests_for(deployment))
    else:
        click.echo("starting a server for the run (the first start converts and caches the base)...", err=True)
        config = EngineConfig(
            model=model, max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank, max_num_seqs=max_num_seqs
        )
        report = bench_in_process(config, num_adapters, num_tenants, requests_for)
        click.echo(
            f"server: {model}, {num_adapters} adapters over {num_tenants} tenants, "
            f"{max_loras} device slots, {max_cpu_loras} host slots, max_num_seqs {max_num_seqs}"
        )
    shape = f"~{prompt_words} prompt words, {max_tokens} output tokens"
    click.echo(f"workload: {num_requests} requests, Poisson {rate:g}/s, Zipf {exponent:g}, {shape}")
    click.echo(format_report(report))
    if json_path:
        json_path.write_text(report.model_dump_json(indent=2))


@main.command()
@click.option("--replica", "replicas", multiple=True, metavar="URL", help="A serving replica (repeatable).")
@click.option("--service", help="Discover replicas from this Service's EndpointSlices instead (in a cluster).")
@click.option("--namespace", default="default", help="The Service's namespace.")
@click.option("--policy", default="affinity", type=click.Choice(["affinity", "round-robin"]))
@click.option("--epsilon", default=0.25, type=click.FloatRange(min=0), help="No replica above (1+epsilon) x the mean load.")
@click.option("--stats-interval", default=1.0, type=click.FloatRange(min=0, min_open=True), help="Seconds between stats reads.")
@click.option("--host", default="0.0.0.0")
@click.option("--port", default=8000, type=click.IntRange(1, 65535))
@click.option("--admin-token", envvar="LORAPLANE_ADMIN_TOKEN", help="Guards /router/replicas; reads the replicas' stats.")
@click.option(
    "--tenants",
    "tenants_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The servers' tenants file: keys and quotas are checked here too.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    help="Also serve /metrics, and nothing else, on this port (for Prometheus; with --tenants the API port's /metrics "
    "needs the admin token).",
)
@usage_options
def router(
    replicas: tuple[str, ...],
    service: str | None,
    namespace: str,
    policy: str,
    epsilon: float,
    stats_interval: float,
    host: str,
    port: int,
    admin_token: str | None,
    tenants_path: Path | None,
    metrics_port: int | None,
    **usage_flags: Any,
) -> None:
    """One OpenAI endpoint in front of many replicas: each adapter goes where it is warm, within a load bound."""
    import uvicorn
    import yaml
    from pydantic import ValidationError

    from loraplane.serving.api.tenants import Tenants, load_tenants
    from loraplane.serving.router.app import create_router_app
    from loraplane.serving.router.config import RouterConfig

    if tenants_path is not None and not admin_token:
        # As `serve`: with tenants the edge is closed to callers without a key, and an open
        # /router/replicas or /metrics would show every tenant's adapters to any of them.
        raise click.UsageError("--tenants needs --admin-token (or LORAPLANE_ADMIN_TOKEN): its admin views would be open")
    try:
        config = RouterConfig(
            replicas=list(replicas), service=service, namespace=namespace, policy=policy,
            epsilon=epsilon, stats_interval=stats_interval,
        )  # fmt: skip
        tenants = Tenants(load_tenants(tenants_path) if tenants_path else None)
        app = create_router_app(config, tenants=tenants, admin_token=admin_token, metering=make_metering(usage_flags))
    except (ValidationError, ValueError, yaml.YAMLError) as err:
        raise click.ClickException(str(err)) from None
    if metrics_port is not None:
        from loraplane.serving.api.metrics_port import serve_metrics

        serve_metrics(app.state.metrics, host, metrics_port)
    uvicorn.run(app, host=host, port=port, log_level="info")


@main.command()
@click.option("--out", "folder", default="crds", type=click.Path(file_okay=False, path_type=Path), show_default=True)
@click.option(
    "--doc",
    "doc_path",
    default="docs/crd-reference.md",
    type=click.Path(dir_okay=False, path_type=Path),
    show_default=True,
    help="The Markdown reference rendered from the same models.",
)
@click.option("--check", is_flag=True, help="Fail if the files in --out or --doc differ from the models instead of writing them.")
def crds(folder: Path, doc_path: Path, check: bool) -> None:
    """Generate the CustomResourceDefinitions and their Markdown reference from the operator's pydantic models."""
    from loraplane.operator.crd_docs import doc_drifted, write_doc
    from loraplane.operator.crdgen import drifted, write_crds

    if check:
        stale = [f"{name} in {folder}" for name in drifted(folder)]
        if doc_drifted(doc_path):
            stale.append(str(doc_path))
        if stale:
            raise click.ClickException(f"out of date: {', '.join(stale)}; run `loraplane crds`")
        click.echo(f"{folder}, {doc_path}: up to date")
        return
    for path in [*write_crds(folder), write_doc(doc_path)]:
        click.echo(f"wrote {path}")


@main.command()
@click.option("--namespace", "-n", "namespaces", multiple=True, help="Watch these namespaces (repeatable); default: all.")
@click.option("--standalone", is_flag=True, help="No peering: for a single replica or tests.")
@click.option("--peering", "peering_name", default="loraplane", show_default=True, help="Peering object for HA.")
@click.option("--liveness", "liveness_endpoint", default="http://0.0.0.0:8080/healthz", show_default=True)
@click.option(
    "--webhook-port", type=click.IntRange(1, 65535), envvar="LORAPLANE_WEBHOOK_PORT", help="Serve the validating webhook."
)
@click.option(
    "--priority",
    type=int,
    help="Peering priority. The operator with the highest runs; the others stand by and take over when it leaves. "
    "[default: random, so that two replicas never tie: kopf pauses every operator that sees a peer of equal priority]",
)
def operator(
    namespaces: tuple[str, ...],
    standalone: bool,
    peering_name: str,
    liveness_endpoint: str,
    webhook_port: int | None,
    priority: int | None,
) -> None:
    """Run the kopf operator reconciling BaseModel and LoraAdapter resources (no torch imported)."""
    import logging
    import os

    import kopf

    if webhook_port is not None:
        os.environ["LORAPLANE_WEBHOOK_PORT"] = str(webhook_port)  # read by the operator's settings
        import loraplane.operator.webhook
    import loraplane.operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=False)  # kopf's log format and levels, as `kopf run` sets them
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin call drowns the reconcile log
    import secrets

    kopf.run(
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        standalone=standalone,
        peering_name=None if standalone else peering_name,
        priority=priority if priority is not None else 1 + secrets.randbelow(1_000_000),
        liveness_endpoint=liveness_endpoint,
    )


main.add_command(usage)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
