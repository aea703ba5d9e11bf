"""The demo end to end: base, adapters, the real server on loopback, the showcase questions, then a
mixed workload sized to what the showcase measured, the report."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

import click

from loraplane.serving.bench.deployment import spawn_server
from loraplane.serving.bench.driver import Outcome, replay
from loraplane.serving.bench.report import AdapterTiers, BenchReport, Latency, format_report, summarize
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
MIXED_TOKENS = 32  # each mixed request's max_tokens
DEFAULT_LOAD = 0.5  # the Zipf traffic's share of the capacity the showcase measured (the probes come on top)


def showcase_requests(base_name: str) -> list[BenchRequest]:
    """Every showcase question under the base and each adapter, all at once: the answers the
    report prints. Each tenant asks the base one question, so no tenant carries the base's share."""
    tenants = [s.tenant for s in STYLES]
    return [
        req
        for i, q in enumerate(SHOWCASE)
        for req in (
            BenchRequest(at=0.0, model=base_name, tenant=tenants[i % len(tenants)], prompt=q, max_tokens=48, chat=True),
            *(BenchRequest(at=0.0, model=s.name, tenant=s.tenant, prompt=q, max_tokens=48, chat=True) for s in STYLES),
        )
    ]


def mixed_requests(base_name: str, rate: float, num_requests: int) -> list[BenchRequest]:
    """Zipf traffic over the adapters and the base, hottest first, Poisson at ``rate`` per second,
    with the base's probes (``base_probes``) beside it."""
    models = [s.name for s in STYLES] + [base_name]
    owners: list[str | None] = [*(s.tenant for s in STYLES), STYLES[1].tenant]
    zipf = zipf_requests(models, owners, num_requests, rate=rate, max_tokens=MIXED_TOKENS, prompts=QUESTIONS, chat=True)
    return sorted(zipf + base_probes(base_name, zipf), key=lambda r: r.at)


def base_probes(base_name: str, zipf: list[BenchRequest], seed: int = 12) -> list[BenchRequest]:
    """Requests to the bare base, as many as the hot adapter has in ``zipf``, Poisson over the
    same time at its rate, one tenant after another: the reference the demo's last line sets the
    hot customer's tail beside. The Zipf share alone gives the base 3 of 48 requests, and the
    largest of 3 against the largest of 27 drawn from one distribution exceeded 1.5x in 37 to 68%
    of draws (``benchmarks/demo_tail_noise.py`` on five demo runs; docs/benchmarks.md, "The
    demo"): the line measured the sample sizes, not the placement.
    Spread over the tenants, not billed to one, so fair admission neither favours the probes nor
    serves them last; the hot customer's owner carries a third of them, which can only slow it."""
    hot = [r for r in zipf if r.model == STYLES[0].name]
    if not hot:
        return []
    span = max(r.at for r in zipf)
    rng = random.Random(seed)
    at, probes = 0.0, []
    for i in range(len(hot)):
        at += rng.expovariate(len(hot) / span) if span > 0 else 0.0
        tenant = STYLES[i % len(STYLES)].tenant
        prompt = QUESTIONS[(i * 7 + 3) % len(QUESTIONS)]  # not in step with the Zipf traffic's turn
        probes.append(BenchRequest(at=at, model=base_name, tenant=tenant, prompt=prompt, max_tokens=MIXED_TOKENS, chat=True))
    return probes


def offered_rate(showcase: list[Outcome], wall_seconds: float, load: float = DEFAULT_LOAD) -> float:
    """Requests per second for the mixed traffic: ``load`` times what this machine served during the
    showcase (its generated tokens per second over the mixed requests' length). The demo shows
    placement, not overload: past capacity every request queues, and fair admission then serves
    the heaviest tenant (the hot customer's owner) last, whatever the adapters' placement."""
    tokens = sum(o.completion_tokens for o in showcase)
    return max(load * tokens / wall_seconds / MIXED_TOKENS, 0.05)


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


def hot_versus_base(mixed: list[Outcome], hot: str, base_name: str) -> str:
    """The line the demo exists to show: under the mixed traffic, the hot customer's tail latency
    beside the bare base's (within 1.5x when the hot adapter never pays for cold starts). The
    base's side includes its probes, so both sides are tails of about as many requests."""
    h, b = (
        Latency.of([o for o in mixed if o.request.model == hot]),
        Latency.of([o for o in mixed if o.request.model == base_name]),
    )
    ratio = h.ttft_p99_ms / b.ttft_p99_ms if b.ttft_p99_ms else float("nan")
    return (
        f"mixed traffic ({len(mixed)} requests): hot customer ({hot}, {h.requests} requests) TTFT p99 "
        f"{h.ttft_p99_ms:.0f} ms against the base's ({b.requests} requests) {b.ttft_p99_ms:.0f} ms: {ratio:.2f}x"
    )


def run_demo(
    out_dir: Path,
    *,
    model: str = "embedded",
    num_requests: int = 48,
    rate: float | None = None,
    adapters_dir: Path | None = None,
) -> tuple[BenchReport, list[Outcome]]:
    """``rate`` None offers the mixed traffic at half the capacity the showcase measured."""
    trace = out_dir.resolve() / "steps.jsonl"  # where the server's time went (benchmarks/step_trace_report.py)
    config = EngineConfig(model=model, max_loras=2, max_lora_rank=16, max_num_seqs=16, step_trace=trace)
    click.echo("preparing the base model (the first run converts and caches it)...")
    base_name = resolve_base(model, config.cache_dir).shape.name
    click.echo("demo adapters (trained with PEFT on the first run, about a minute each; cached afterwards)...")
    folders = demo_adapters(model, config.cache_dir, adapters_dir)
    adapters = {s.name: (folders[s.name], s.tenant) for s in STYLES}
    click.echo("starting the server on loopback: 3 adapters, 2 device slots, one tenant per adapter...")
    with spawn_server(config, adapters, [s.tenant for s in STYLES]) as deployment:
        before = deployment.stats()
        shown, shown_wall = asyncio.run(replay(deployment.url, showcase_requests(base_name), deployment.keys))
        offered = rate if rate is not None else offered_rate(shown, shown_wall)
        click.echo(
            f"showcase: {len(shown)} requests at once in {shown_wall:.1f} s; mixed traffic: {num_requests} requests "
            f"at {offered:.2f}/s" + ("" if rate is not None else f" ({DEFAULT_LOAD:.0%} of what the showcase served)")
        )
        traffic = mixed_requests(base_name, offered, num_requests)
        click.echo(f"  and {len(traffic) - num_requests} probes of the base beside them, at the hot customer's rate")
        mixed, mixed_wall = asyncio.run(replay(deployment.url, traffic, deployment.keys))
        after = deployment.stats()
    for o in mixed:  # arrivals on one clock: the mixed phase starts when the showcase has finished
        o.request = replace(o.request, at=o.request.at + shown_wall)
    outcomes = shown + mixed
    report = summarize(outcomes, shown_wall + mixed_wall, before, after)
    models = [s.name for s in STYLES] + [base_name]
    click.echo("\nThe same question under the base and each adapter:")
    for q in SHOWCASE[:2]:
        click.echo(f"\nQ: {q}")
        for o in shown:
            if o.request.prompt == q:
                name = "base" if o.request.model == base_name else o.request.model
                answer = o.text.strip() if o.ok else f"(error {o.status}: {o.error})"
                lines = answer.splitlines() or [""]
                click.echo(f"  [{name}] {lines[0]}")
                for line in lines[1:]:
                    click.echo(" " * (len(name) + 5) + line)
    click.echo(f"\nPer adapter, showcase and mixed traffic ({report.wall_seconds:.1f} s, {len(outcomes)} requests):")
    click.echo(adapter_table(report, outcomes, models))
    click.echo(hot_versus_base(mixed, STYLES[0].name, base_name))
    click.echo("\nOverall:")
    click.echo(format_report(report))
    for o in [o for o in outcomes if not o.ok and o.status not in (429, 503)]:  # a failure says why
        click.echo(f"failed: {o.request.model} ({o.request.tenant}): {f'HTTP {o.status}: ' if o.status else ''}{o.error}")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_demo(outcomes, report.per_adapter, {m: "base" if m == base_name else m for m in models}, out_dir / "demo.png")
    answers = [
        {
            "phase": "showcase" if i < len(shown) else "mixed",
            "model": o.request.model,
            "tenant": o.request.tenant,
            "question": o.request.prompt,
            "answer": o.text,
            "error": o.error,
            "arrival_s": round(o.request.at, 3),
            "ttft_ms": None if o.ttft is None else round(1e3 * o.ttft, 1),
        }
        for i, o in enumerate(outcomes)
    ]
    (out_dir / "report.json").write_text(json.dumps({"report": report.model_dump(), "answers": answers}, indent=2))
    click.echo(f"\nwrote {out_dir / 'demo.png'}, {out_dir / 'report.json'} and the server's step trace {out_dir / 'steps.jsonl'}")
    return report, outcomes
