"""``loraplane merge``: an adapter folded into its base, as a checkpoint folder of its own."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("adapter", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--base", "model", default="embedded", help="The base: 'embedded', a .gguf file or a checkpoint folder.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The merged checkpoint's folder (must not exist).")
@click.option("--digest", "expected_digest", help="The adapter digest to merge (refused if the folder's differs).")
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    default=Path.home() / ".cache" / "loraplane",
    help="Where a GGUF base is converted.",
)
def merge(adapter: Path, model: str, out: Path, expected_digest: str | None, cache_dir: Path) -> None:
    """Fold ADAPTER (a PEFT folder) into the base: W + scale * B A for every module it targets,
    read as the engine reads it for serving, written as a checkpoint folder that serves as a base
    (a dedicated deployment's model: no adapter overhead, no slot). Prints the folder's digest
    (as `loraplane digest --base` would) for a BaseModel's source.digest."""
    from loraplane.adapter_format import AdapterValidationError
    from loraplane.node_cache.base_copy import folder_digest
    from loraplane.serving.config import default_cache_dir
    from loraplane.serving.lora.merge import merge_adapter
    from loraplane.serving.weights.base import resolve_base

    base = resolve_base(model, default_cache_dir())  # where the engine converts a GGUF base, once
    try:
        merged = merge_adapter(base, adapter, out, expected_digest=expected_digest)
    except (AdapterValidationError, FileExistsError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"merged {merged.modules} modules of {merged.adapter_digest} into {base.shape.name}: {out}", err=True)
    click.echo(folder_digest(out))
