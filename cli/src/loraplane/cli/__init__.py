"""The ``loraplane`` command: one module per subcommand. Each imports its part lazily, so
``loraplane operator`` never pulls in torch and ``--help`` answers at once."""

from __future__ import annotations

import importlib
from typing import Any

import click

# name -> (module, attribute): imported only when that command runs, so that each image carries only
# the parts its own commands need (the operator image has no serving part, hence no torch).
COMMANDS = {
    "sim": ("loraplane.cli.simulate", "sim"),
    "plan": ("loraplane.cli.simulate", "plan"),
    "generate": ("loraplane.cli.generate", "generate"),
    "serve": ("loraplane.cli.serve", "serve"),
    "demo": ("loraplane.cli.demo", "demo"),
    "bench": ("loraplane.cli.bench", "bench"),
    "router": ("loraplane.cli.router", "router"),
    "crds": ("loraplane.cli.operator", "crds"),
    "operator": ("loraplane.cli.operator", "operator"),
    "usage": ("loraplane.cli.usage", "usage"),
    "digest": ("loraplane.cli.digest", "digest"),
    "merge": ("loraplane.cli.merge", "merge"),
    "node-agent": ("loraplane.cli.node_agent", "node_agent"),
}


class LazyGroup(click.Group):
    """Subcommands imported on first use (click's documented lazy-loading pattern). A command whose
    part is not installed is listed as such and fails with the part's name, not a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*COMMANDS, *super().list_commands(ctx)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        module, attribute = COMMANDS[cmd_name]
        try:
            command: click.Command = getattr(importlib.import_module(module), attribute)
        except ModuleNotFoundError as err:
            if not (err.name or "").startswith("loraplane."):
                raise
            return _missing(cmd_name, err.name or "")
        return command


def _missing(name: str, module: str) -> click.Command:
    distribution = "loraplane-" + module.split(".")[1].replace("_", "-")

    def fail(**_: Any) -> None:
        raise click.ClickException(f"`loraplane {name}` needs {distribution}, which this installation lacks")

    return click.Command(name, callback=fail, help=f"(not installed here: needs {distribution})",
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})  # fmt: skip


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="loraplane", prog_name="loraplane")
def main() -> None:
    """Serve many LoRA fine-tunes of one base model on a fixed GPU budget.

    \b
    Start with:
      loraplane sim              replay the default Zipf trace through adapter tiers
      loraplane sim --compare    compare eviction policies against Belady's optimum
      loraplane plan examples/plan-500-finetunes-8b/plan.yaml
                                 size slots, rank cap and replicas for a fleet
      loraplane generate "Say hello" [--adapter DIR]
                                 one completion from the engine
    """
