"""``loraplane merge``: an adapter folded into its base, as a checkpoint folder of its own, and
(``--publish``) written once to object storage, where a dedicated deployment's node agents copy it
as they copy an s3:// base. The operator's merge Job runs exactly this command."""

from __future__ import annotations

import tempfile
from pathlib import Path
from urllib.parse import urlparse

import click


def publish(folder: Path, uri: str) -> int:
    """Every file of ``folder`` under the ``s3://bucket/prefix`` ``uri``, the credentials and
    endpoint from the environment (as every loraplane process reads them); the files written. A
    rerun (a Job's retry after a partial upload) writes the same objects again."""
    from loraplane.adapter_format.sources import S3Settings

    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc or not parsed.path.strip("/"):
        raise click.BadParameter(f"{uri!r} is not s3://bucket/prefix", param_hint="--publish")
    client = S3Settings.from_env().client()
    prefix = parsed.path.strip("/")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        client.fput_object(parsed.netloc, f"{prefix}/{path.relative_to(folder).as_posix()}", str(path))
    return len(files)


@click.command()
@click.argument("adapter")
@click.option("--base", "model", default="embedded", help="The base: 'embedded', a .gguf file or a checkpoint folder.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="The merged checkpoint's folder (must not exist); with --publish, a scratch folder by default.",
)
@click.option("--digest", "expected_digest", help="The adapter digest to merge (refused if the folder's differs).")
@click.option("--publish", "publish_to", help="s3://bucket/prefix: upload the merged checkpoint there, once merged.")
@click.option(
    "--digest-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the folder's digest here (a Job's /dev/termination-log, which the operator reads).",
)
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    default=Path.home() / ".cache" / "loraplane",
    help="Where a GGUF base is converted and an adapter given by URI is fetched.",
)
def merge(
    adapter: str, model: str, out: Path | None, expected_digest: str | None, publish_to: str | None,
    digest_file: Path | None, cache_dir: Path,
) -> None:  # fmt: skip
    """Fold ADAPTER (a PEFT folder, or a source URI fetched and checked as a load would: s3://,
    file://) into the base: W + scale * B A for every module it targets, read as the engine reads
    it for serving, written as a checkpoint folder that serves as a base (a dedicated deployment's
    model: no adapter overhead, no slot). Prints the folder's digest (as `loraplane digest --base`
    would) for a BaseModel's source.digest."""
    from loraplane.adapter_format import AdapterValidationError
    from loraplane.adapter_format.sources import S3Settings
    from loraplane.node_cache.base_copy import folder_digest
    from loraplane.serving.config import default_cache_dir
    from loraplane.serving.lora.adapter_files import OwnCache
    from loraplane.serving.lora.merge import merge_adapter
    from loraplane.serving.weights.base import resolve_base

    if out is None and publish_to is None:
        raise click.UsageError("--out is needed unless --publish names where the checkpoint goes")
    base = resolve_base(model, default_cache_dir())  # where the engine converts a GGUF base, once
    with tempfile.TemporaryDirectory(prefix="loraplane-merge-", dir=cache_dir if cache_dir.is_dir() else None) as scratch:
        local = Path(adapter)
        if not local.is_dir():  # a source URI: fetched as a replica fetches it, digest checked (into scratch, gone after)
            files = OwnCache(Path(scratch) / "adapters", max_bytes=None, policy="demand", s3=S3Settings.from_env())
            try:
                local = files.acquire(adapter, expected_digest).folder
            except (AdapterValidationError, ValueError, OSError) as exc:
                raise click.ClickException(f"{adapter}: {exc}") from None
        target = out or Path(scratch) / "merged"
        try:
            merged = merge_adapter(base, local, target, expected_digest=expected_digest)
        except (AdapterValidationError, FileExistsError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"merged {merged.modules} modules of {merged.adapter_digest} into {base.shape.name}: {target}", err=True)
        digest = folder_digest(target)
        if publish_to is not None:
            written = publish(target, publish_to)
            click.echo(f"published {written} files to {publish_to}", err=True)
    if digest_file is not None:
        digest_file.write_text(digest)
    click.echo(digest)
