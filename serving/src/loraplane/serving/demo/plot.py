"""The demo's picture: each request's time to first token over the run, and where each adapter was found."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loraplane.serving.bench.driver import Outcome
from loraplane.serving.bench.report import AdapterTiers


def plot_demo(outcomes: Sequence[Outcome], tiers: dict[str, AdapterTiers], labels: dict[str, str], path: Path) -> None:
    """``labels`` maps each model the requests named to what the picture calls it."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers or in CI
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for model, label in labels.items():
        done = [o for o in outcomes if o.request.model == model and o.ttft is not None]
        left.scatter([o.request.at for o in done], [1e3 * (o.ttft or 0) for o in done], label=label, s=18)
    left.set(xlabel="arrival (s)", ylabel="time to first token (ms)", title="Time to first token, per request")
    left.legend()
    adapters = [m for m in labels if m in tiers]
    bottom = [0] * len(adapters)
    for tier, colour in (("device_hits", "tab:green"), ("host_hits", "tab:orange"), ("cold_loads", "tab:red")):
        counts = [getattr(tiers[a], tier) for a in adapters]
        right.bar([labels[a] for a in adapters], counts, bottom=bottom, color=colour, label=tier.replace("_", " "))
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    right.set(ylabel="requests", title="Where each adapter was when its requests arrived")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
