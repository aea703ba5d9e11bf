"""``loraplane demo``: the main job on the embedded defaults."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
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
