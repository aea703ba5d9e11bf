"""``loraplane node-agent``: the node cache's agent (run as a DaemonSet), and the serving pods'
init step that waits for the base on the node."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import click

from loraplane.cli.options import admin_hosts_option, admin_token_option, listen_options, metrics_port_option


def _bytes(value: str | None) -> int | None:
    """A byte count as Kubernetes writes quantities (20Gi, 500M) or a plain number."""
    if value is None:
        return None
    from kubernetes.utils import parse_quantity

    try:
        return int(parse_quantity(value))  # type: ignore[no-untyped-call]
    except ValueError as err:
        raise click.BadParameter(f"{value!r} is not a byte quantity ({err})") from None


@click.group("node-agent", invoke_without_command=True)
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), required=True, help="The node cache's folder.")
@click.option("--max-bytes", help="Bytes of adapter files kept (a quantity, e.g. 50Gi); unset: unbounded.")
@click.option(
    "--node", default=lambda: os.environ.get("NODE_NAME") or socket.gethostname(), help="This node's name, in state and series."
)
@click.option("--base-source", help="A base to copy to the node once (s3://bucket/prefix or file:///path).")
@click.option("--base-digest", help="The base folder's digest (loraplane digest --base); a copy that differs is refused.")
@click.option("--policy", default="demand", type=click.Choice(["demand", "lru", "lfu", "tinylfu"]), help="Eviction order.")
@listen_options("0.0.0.0", default_port=8090)
@admin_token_option("Guards the serving pods' calls: the BaseModel's admin token.")
@click.option(
    "--operator-token", envvar="LORAPLANE_NODE_CACHE_TOKEN", help="Guards staging and state (default: the admin token)."
)
@admin_hosts_option
@click.option("--allowed-source", "allowed_sources", multiple=True, metavar="PREFIX",
              help="A URI prefix pods may have fetched (repeatable); none: any.")  # fmt: skip
@metrics_port_option
@click.pass_context
def node_agent(ctx: click.Context, cache_dir: Path, max_bytes: str | None, node: str, base_source: str | None,
               base_digest: str | None, policy: str, host: str, port: int, admin_token: str | None,
               operator_token: str | None, admin_hosts: frozenset[str], allowed_sources: tuple[str, ...],
               metrics_port: int | None) -> None:  # fmt: skip
    """Own a node's adapter cache: fetch for the serving pods on the node, stage what the operator asks."""
    if ctx.invoked_subcommand is not None:
        return
    import uvicorn
    from prometheus_client import CollectorRegistry, start_http_server

    from loraplane.adapter_format.sources import S3Settings
    from loraplane.node_cache.agent import NodeAgent
    from loraplane.node_cache.app import create_agent_app

    agent = NodeAgent(
        cache_dir, node, max_bytes=_bytes(max_bytes), s3=S3Settings.from_env(), policy=policy,
        base_source=base_source, base_digest=base_digest, allowed_sources=list(allowed_sources),
    )  # fmt: skip
    registry = CollectorRegistry()
    app = create_agent_app(agent, admin_token, registry, operator_token, admin_hosts)
    if metrics_port is not None:  # the series alone, for a NetworkPolicy that opens it to the scraper only
        start_http_server(metrics_port, addr=host, registry=registry)
    agent.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        agent.close()


@node_agent.command("wait-base")
@click.option("--source", required=True, help="The BaseModel's source URI.")
@click.option("--digest", help="Wait for the copy with this folder digest (the BaseModel's source.digest).")
@click.option("--timeout", default=3600.0, type=click.FloatRange(min=0), help="Seconds before giving up.")
@click.pass_context
def wait_base(ctx: click.Context, source: str, digest: str | None, timeout: float) -> None:
    """Wait until the base's verified copy is published in the node cache; print its path."""
    from loraplane.node_cache.base_copy import wait_for_base

    try:
        click.echo(wait_for_base(ctx.parent.params["cache_dir"] if ctx.parent else Path("."), source, timeout, digest))
    except TimeoutError as err:
        raise click.ClickException(str(err)) from None
