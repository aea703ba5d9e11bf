"""Options more than one command takes, and the engine's flags.

The engine's flags are built from its settings model (``EngineConfig``): a flag's range, choices
and help are the field's, so ``serve --help``, a ``--config`` file and the BaseModel CRD cannot
disagree about a knob. They default to unset, so a ``--config`` file's value (or the model's
default) stands unless the flag is given.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import annotated_types
import click
from pydantic.fields import FieldInfo

F = TypeVar("F", bound=Callable[..., Any])


def _param_type(field: FieldInfo) -> click.Choice[str] | click.IntRange | click.FloatRange | click.Path:
    ann = field.annotation
    if get_origin(ann) in (Union, types.UnionType):
        ann = next(a for a in get_args(ann) if a is not type(None))
    if get_origin(ann) is Literal:
        return click.Choice([str(a) for a in get_args(ann)])
    if ann is Path:
        return click.Path(dir_okay=False, path_type=Path)
    if ann not in (int, float):
        raise TypeError(f"no flag type for {ann!r}")  # a new kind of knob needs a line here
    low: Any = None
    high: Any = None
    low_open = False
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Ge):
            low = bound.ge
        elif isinstance(bound, annotated_types.Gt):
            low, low_open = bound.gt, True
        elif isinstance(bound, annotated_types.Le):
            high = bound.le
    if ann is float:
        return click.FloatRange(low, high, min_open=low_open)
    if low is not None and low_open:
        low = int(low) + 1
    return click.IntRange(low, high)


def engine_flags(*names: str) -> Callable[[F], F]:
    """``--max-loras`` and the like for these ``EngineConfig`` fields, in the order given."""
    from loraplane.serving.config import EngineConfig  # torch-free: pydantic models only

    fields = EngineConfig.model_fields

    def decorate(f: F) -> F:
        for name in reversed(names):
            field = fields[name]
            text = field.description or ""
            flag = f"--{name.replace('_', '-')}"
            help = text[:1].upper() + text[1:] + "." if text else None
            if field.annotation in (bool, bool | None):  # --x / --no-x; absent leaves the config's value
                f = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help)(f)
            else:
                f = click.option(flag, name, type=_param_type(field), help=help)(f)
        return f

    return decorate


def listen_options(default_host: str, default_port: int = 8000) -> Callable[[F], F]:
    """``--host`` and ``--port`` of a command that serves HTTP."""

    def decorate(f: F) -> F:
        f = click.option("--port", default=default_port, type=click.IntRange(1, 65535))(f)
        return click.option("--host", default=default_host)(f)

    return decorate


def admin_token_option(help: str) -> Callable[[F], F]:
    return click.option("--admin-token", envvar="LORAPLANE_ADMIN_TOKEN", help=help)


admin_hosts_option = click.option(
    "--admin-host", "admin_hosts", multiple=True, envvar="LORAPLANE_ADMIN_HOSTS",
    callback=lambda _ctx, _param, hosts: frozenset(h.lower() for h in hosts),  # a Host header's case does not count
    help="This server's own address (the operator passes the pod's IP); a signed admin call made for any other "
    "address is refused, so a call captured elsewhere cannot be replayed here. Repeatable; unset: any address.",
)  # fmt: skip


def tenants_option(help: str) -> Callable[[F], F]:
    return click.option("--tenants", "tenants_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help=help)


metrics_port_option = click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    help="Also serve /metrics, and nothing else, on this port (for Prometheus; with --tenants the API port's /metrics "
    "needs the admin token).",
)
