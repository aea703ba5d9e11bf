"""The ``loraplane`` command: one module per subcommand. Each imports its part lazily, so
``loraplane operator`` never pulls in torch and ``--help`` answers at once."""

from __future__ import annotations

import click

from loraplane.cli.bench import bench
from loraplane.cli.demo import demo
from loraplane.cli.digest import digest
from loraplane.cli.generate import generate
from loraplane.cli.merge import merge
from loraplane.cli.node_agent import node_agent
from loraplane.cli.operator import crds, operator
from loraplane.cli.router import router
from loraplane.cli.serve import serve
from loraplane.cli.simulate import plan, sim
from loraplane.cli.usage import usage


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
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


for command in (sim, plan, generate, serve, demo, bench, router, crds, operator, usage, digest, merge, node_agent):
    main.add_command(command)
