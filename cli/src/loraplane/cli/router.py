"""``loraplane router``: the adapter-affinity router in front of the replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from loraplane.cli.options import admin_token_option, listen_options, metrics_port_option, tenants_option
from loraplane.cli.usage import make_metering, usage_options


@click.command()
@click.option("--replica", "replicas", multiple=True, metavar="URL", help="A serving replica (repeatable).")
@click.option("--service", help="Discover replicas from this Service's EndpointSlices instead (in a cluster).")
@click.option("--namespace", default="default", help="The Service's namespace.")
@click.option("--policy", default="affinity", type=click.Choice(["affinity", "round-robin"]))
@click.option("--epsilon", default=0.25, type=click.FloatRange(min=0), help="No replica above (1+epsilon) x the mean load.")
@click.option("--stats-interval", default=1.0, type=click.FloatRange(min=0, min_open=True), help="Seconds between stats reads.")
@listen_options("0.0.0.0")
@admin_token_option("Guards /router/replicas; reads the replicas' stats.")
@tenants_option("The servers' tenants file: keys and quotas are checked here too.")
@metrics_port_option
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

    from loraplane.serving.http.tenants import Tenants, load_tenants
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
        from loraplane.serving.http.metrics_port import serve_metrics

        serve_metrics(app.state.metrics, host, metrics_port)
    uvicorn.run(app, host=host, port=port, log_level="info")
