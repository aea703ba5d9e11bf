"""``loraplane digest``: the digest to declare for an adapter folder."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--base", is_flag=True, help="FOLDER is a base checkpoint: print its folder digest for a BaseModel's source.digest."
)
def digest(folder: Path, base: bool) -> None:
    """Print FOLDER's adapter digest: the sha256 over adapter_config.json, adapter_model.safetensors
    and golden_outputs.json (if any), to declare as a LoraAdapter's spec.source.digest or a load's
    digest. The weights file's own digest (the earlier form) follows on stderr. With --base, the
    digest of every file in a base checkpoint's folder, which the node agent checks its copy against."""
    from loraplane.adapter_format.digest import WEIGHTS_FILE, adapter_digest, file_digests

    if base:
        from loraplane.node_cache.base_copy import folder_digest

        click.echo(folder_digest(folder))
        return

    if not (folder / WEIGHTS_FILE).is_file():
        raise click.UsageError(f"{folder} has no {WEIGHTS_FILE}")
    digests = file_digests(folder)
    click.echo(adapter_digest(folder, digests))
    click.echo(f"{WEIGHTS_FILE}: {digests[WEIGHTS_FILE]} (weights only; the earlier form)", err=True)
