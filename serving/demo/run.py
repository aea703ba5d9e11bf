"""The demo end to end: base, adapters, the real server on loopback, a mixed workload, the report."""

from __future__ import annotations

import json
from pathlib import Path

import click

from loraplane.serving.bench.deployment import spawn_server
from loraplane.serving.bench.driver import Outcome
from loraplane.serving.bench.report import AdapterTiers, BenchReport, Latency, format_report
from loraplane.serving.bench.run import run_bench
from loraplane.serving.bench.workload import BenchRequest, zipf_requests
from loraplane.serving.config import EngineConfig
from loraplane.serving.demo.plot import plot_demo
from loraplane.serving.demo.styles import SHOWCASE, STYLES
from loraplane.serving.demo.train import demo_adapters
from loraplane.serving.weights.base import resolve_base

# The mixed workload's questions: none of them is among the training questions.
QUESTIONS = (
    "What is a good breakfast?", "Why is the sky blue?", "Tell me about elephants.", "What makes a good friend?",
    "Describe a thunderstorm.", "What is special about jazz?", "Tell me about the desert at night.",
    "How do plants grow?", "What is fun about board games?", "Describe an old castle.",
)  # fmt: skip


def workload(base_name: str, rate: float, num_requests: int) -> list[BenchRequest]:
    """First every showcase question under the base and each adapter (the answers the report
    prints), then Zipf traffic over the adapters and the base, hottest first."""
    tenants = [s.tenant for s in STYLES]
    showcase = [
        BenchRequest(at=0.0, model=model, tenant=tenant, prompt=q, max_tokens=48, chat=True)
        for q in SHOWCASE
        for model, tenant in [(base_name, tenants[0]), *((s.name, s.tenant) for s in STYLES)]
    ]
    models = [s.name for s in STYLES] + [base_name]
    owners: list[str | None] = [*tenants, tenants[1]]
    mixed = zipf_requests(models, owners, num_requests, rate=rate, max_tokens=32, prompts=QUESTIONS, chat=True)
    return showcase + [BenchRequest(r.at + 2.0, r.model, r.tenant, r.prompt, r.max_tokens, r.chat) for r in mixed]


def adapter_table(report: BenchReport, outcomes: list[Outcome], models: list[str]) -> str:
    rows = ["model     tenant   requests  tokens  tokens/s  TTFT p50 ms  TTFT p99 ms  device  host  cold  mean load ms"]
    owners = {s.name: s.tenant for s in STYLES}
    for model in models:
        mine = [o for o in outcomes if o.request.model == model]
        lat, t = Latency.of(mine), report.per_adapter.get(model, AdapterTiers())
        label = "base" if model not in owners else model
        rows.append(
            f"{label:<9} {owners.get(model, '-'):<8} {lat.requests:>8}  {lat.completion_tokens:>6}  "
            f"{lat.completion_tokens / report.wall_seconds:>8.1f}  {lat.ttft_p50_ms:>11.0f}  {lat.ttft_p99_ms:>11.0f}  "
            f"{t.device_hits:>6}  {t.host_hits:>4}  {t.cold_loads:>4}  {t.mean_load_ms:>12.1f}"
        )
    return "\n".join(rows)


def hot_versus_base(outcomes: list[Outcome], hot: str, base_name: str) -> str:
    """The line the demo exists to show: the hot customer's tail latency beside the bare base's
    (the issue's goal is within 1.5x: the hot adapter never pays for cold starts)."""
    mixed = [o for o in outcomes if o.request.at > 0.0]  # the Zipf traffic, not the showcase burst
    h, b = (
        Latency.of([o for o in mixed if o.request.model == hot]),
        Latency.of([o for o in mixed if o.request.model == base_name]),
    )
    ratio = h.ttft_p99_ms / b.ttft_p99_ms if b.ttft_p99_ms else float("nan")
    return f"hot customer ({hot}) TTFT p99 {h.ttft_p99_ms:.0f} ms against the base's {b.ttft_p99_ms:.0f} ms: {ratio:.2f}x"


def run_demo(
    out_dir: Path, *, model: str = "embedded", num_requests: int = 48, rate: float = 2.0, adapters_dir: Path | None = None
) -> tuple[BenchReport, list[Outcome]]:
    config = EngineConfig(model=model, max_loras=2, max_lora_rank=16, max_num_seqs=16)
    click.echo("preparing the base model (the first run converts and caches it)...")
    base_name = resolve_base(model, config.cache_dir).shape.name
    click.echo("demo adapters (trained with PEFT on the first run, about a minute each; cached afterwards)...")
    folders = demo_adapters(model, config.cache_dir, adapters_dir)
    adapters = {s.name: (folders[s.name], s.tenant) for s in STYLES}
    click.echo("starting the server on loopback: 3 adapters, 2 device slots, one tenant per adapter...")
    with spawn_server(config, adapters, [s.tenant for s in STYLES]) as deployment:
        requests = workload(base_name, rate, num_requests)
        report, outcomes = run_bench(deployment, requests)
    models = [s.name for s in STYLES] + [base_name]
    click.echo("\nThe same question under the base and each adapter:")
    for q in SHOWCASE[:2]:
        click.echo(f"\nQ: {q}")
        for o in outcomes:
            if o.request.prompt == q and o.request.at == 0.0:
                name = "base" if o.request.model == base_name else o.request.model
                answer = o.text.strip() if o.ok else f"(error {o.status}: {o.error})"
                lines = answer.splitlines() or [""]
                click.echo(f"  [{name}] {lines[0]}")
                for line in lines[1:]:
                    click.echo(" " * (len(name) + 5) + line)
    click.echo(f"\nPer adapter ({report.wall_seconds:.1f} s, {len(outcomes)} requests):")
    click.echo(adapter_table(report, outcomes, models))
    click.echo(hot_versus_base(outcomes, STYLES[0].name, base_name))
    click.echo("\nOverall:")
    click.echo(format_report(report))
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_demo(outcomes, report.per_adapter, {m: "base" if m == base_name else m for m in models}, out_dir / "demo.png")
    answers = [
        {"model": o.request.model, "tenant": o.request.tenant, "question": o.request.prompt, "answer": o.text, "error": o.error}
        for o in outcomes
    ]
    (out_dir / "report.json").write_text(json.dumps({"report": report.model_dump(), "answers": answers}, indent=2))
    click.echo(f"\nwrote {out_dir / 'demo.png'} and {out_dir / 'report.json'}")
    return report, outcomes
