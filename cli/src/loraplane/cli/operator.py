"""``loraplane crds`` and ``loraplane operator``: the CRDs (and the chart's values schema) from the typed models, and the
kopf operator."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from loraplane.cli.options import F


def _path(flag: str, dest: str, default: str, help: str, *, folder: bool = False) -> Callable[[F], F]:
    """One of ``crds``' outputs: a file, or a folder of files, with where it lies by default."""
    kind = click.Path(file_okay=not folder, dir_okay=folder, path_type=Path)
    return click.option(flag, dest, default=default, type=kind, show_default=True, help=help)


@click.command()
@_path("--out", "folder", "crds", "The CustomResourceDefinitions.", folder=True)
@_path("--doc", "doc_path", "docs/crd-reference.md", "The Markdown reference rendered from the same models.")
@_path(
    "--values-schema", "values_path", "charts/loraplane/values.schema.json",
    "The Helm chart's values schema, from the chart's values model (its baseModel.spec is the CRD's).",
)  # fmt: skip
@_path(
    "--chart-copies", "copies_folder", "charts/loraplane/files/crds",
    "The chart's copies of every file in --out (Helm reads only files inside the chart); '' for none.", folder=True,
)  # fmt: skip
@click.option(
    "--check",
    is_flag=True,
    help="Fail if the files in --out, --doc, --values-schema or --chart-copies differ from the models instead of writing them.",
)
def crds(folder: Path, doc_path: Path, values_path: Path, copies_folder: Path, check: bool) -> None:
    """Generate the CustomResourceDefinitions, their Markdown reference and the chart's values.schema.json from the
    operator's pydantic models."""
    from loraplane.operator.schema.chart_values import values_schema_drifted, write_values_schema
    from loraplane.operator.schema.crd_docs import doc_drifted, write_doc
    from loraplane.operator.schema.crdgen import drifted, write_crds

    if check:
        stale = [f"{name} in {folder}" for name in drifted(folder)]
        if doc_drifted(doc_path):
            stale.append(str(doc_path))
        if values_schema_drifted(values_path):
            stale.append(str(values_path))
        stale += [str(copy) for copy, source in _chart_copies(folder, copies_folder) if not _same(copy, source)]
        if stale:
            raise click.ClickException(f"out of date: {', '.join(stale)}; run `loraplane crds`")
        click.echo(f"{folder}, {doc_path}, {values_path}: up to date")
        return
    for path in [*write_crds(folder), write_doc(doc_path), write_values_schema(values_path)]:
        click.echo(f"wrote {path}")
    for copy, source in _chart_copies(folder, copies_folder):
        copy.write_bytes(source.read_bytes())
        click.echo(f"wrote {copy}")


def _chart_copies(folder: Path, copies_folder: Path) -> list[tuple[Path, Path]]:
    """(copy, source) for every YAML file in ``folder``: a regenerated CRD whose chart copy was left behind ships the
    old schema with the next chart, which only a test comparing the two used to notice."""
    if str(copies_folder) == ".":  # '' (click makes it Path("."))
        return []
    return [(copies_folder / source.name, source) for source in sorted(folder.glob("*.yaml"))]


def _same(copy: Path, source: Path) -> bool:
    return copy.is_file() and copy.read_bytes() == source.read_bytes()


@click.command()
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
        import loraplane.operator.runtime.webhook
    import loraplane.operator.runtime.handlers  # noqa: F401  (registers the handlers)

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
