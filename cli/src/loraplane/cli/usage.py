"""``loraplane usage report`` and the usage-record options ``serve`` and ``router`` share."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def usage_options(fn: F) -> F:
    """``--usage-dir``, ``--usage-export``, ``--usage-fsync-interval``, ``--replica-name``."""
    options = [
        click.option(
            "--usage-dir",
            type=click.Path(file_okay=False, path_type=Path),
            help="Spool one usage record per request here (append-only JSONL segments, fsynced, rotated).",
        ),
        click.option(
            "--usage-export",
            metavar="s3://BUCKET/PREFIX",
            envvar="LORAPLANE_USAGE_EXPORT",
            help="Upload closed segments there (the AWS_* settings apply), then delete them locally.",
        ),
        click.option(
            "--usage-fsync-interval",
            default=1.0,
            type=click.FloatRange(min=0),
            help="Seconds between fsyncs of the open segment: the most a machine crash can lose.",
        ),
        click.option(
            "--usage-segment-age",
            default=60.0,
            type=click.FloatRange(min=0, min_open=True),
            help="Close (and export) a segment after this many seconds.",
        ),
        click.option(
            "--replica-name",
            envvar="POD_NAME",
            default=socket.gethostname,
            show_default="$POD_NAME or the host name",
            help="Names this process in its records and export keys.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def make_metering(flags: dict[str, Any]) -> Any:
    """The ``Metering`` for the options ``usage_options`` added (popped from ``flags``)."""
    from loraplane.usage import Metering

    folder, export_to = flags.pop("usage_dir"), flags.pop("usage_export")
    fsync, age, replica = flags.pop("usage_fsync_interval"), flags.pop("usage_segment_age"), flags.pop("replica_name")
    try:
        return Metering.create(replica, folder, export_to, fsync_interval=fsync, max_segment_age=age)
    except ValueError as err:
        raise click.ClickException(str(err)) from None


@click.group()
def usage() -> None:
    """Per-request usage records: totals for billing."""


@usage.command()
@click.argument("source")
@click.option("--since", help="From this date (YYYY-MM-DD) or ISO 8601 time, UTC unless it says otherwise.")
@click.option("--until", help="Up to this date (the whole day) or time, exclusive.")
@click.option("--format", "fmt", default="table", type=click.Choice(["table", "csv", "json"]))
@click.option("--no-progress", is_flag=True, help="No progress bar (it goes to stderr).")
def report(source: str, since: str | None, until: str | None, fmt: str, no_progress: bool) -> None:
    """Totals per tenant, adapter and day of the records under SOURCE: s3://BUCKET/PREFIX (the
    AWS_* settings apply) or a folder. Records are counted once per request id."""
    from loraplane.usage.report import build_report, iter_blobs, parse_time, render

    try:
        start, end = parse_time(since), parse_time(until, end_of_day=True)
        blobs = iter_blobs(source, None, start, end, progress=not no_progress and sys.stderr.isatty())
        result = build_report(blobs, start, end)
    except (ValueError, FileNotFoundError) as err:
        raise click.ClickException(str(err)) from None
    click.echo(render(result, fmt))


__all__ = ["make_metering", "usage", "usage_options"]
