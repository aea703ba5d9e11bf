"""``loraplane bench``: a load generator against a server, or one it starts."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
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
    from loraplane.serving.bench.deployment import Deployment, remote
    from loraplane.serving.bench.report import format_report
    from loraplane.serving.bench.run import bench_in_process, run_bench
    from loraplane.serving.bench.workload import BenchRequest, zipf_requests
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.http.tenants import load_tenants

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
