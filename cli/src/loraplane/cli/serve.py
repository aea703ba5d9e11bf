"""``loraplane serve``: the OpenAI-compatible server with the admin API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from loraplane.cli.options import (
    admin_hosts_option,
    admin_token_option,
    engine_flags,
    listen_options,
    metrics_port_option,
    tenants_option,
)
from loraplane.cli.usage import make_metering, usage_options
from loraplane.serving.api.openai.responses.store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES
from loraplane.serving.api.openai.tools.parsers import TOOL_PARSERS


@click.command()
@click.option("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct), a .gguf file or a checkpoint folder.")
@listen_options("127.0.0.1")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML file of engine settings (the flags' names with underscores); flags override it.",
)
@click.option(
    "--served-model-name",
    "base_name",
    help="The base's model id (vLLM's flag): what /v1/models lists and what adapters must declare as "
    "base_model_name_or_path [default: the embedded model's id, the .gguf's or the folder's name].",
)
@click.option("--base-revision", help="The base's revision; adapters that declare another are refused.")
@click.option(
    "--lora-modules", multiple=True, metavar="NAME=SOURCE",
    help="Adapter to load at start (folder, file:// or s3://); or vLLM's JSON form, "
    '\'{"name": ..., "path": ..., "base_model_name": ...}\'.',
)  # fmt: skip
@click.option("--enable-lora", is_flag=True, help="vLLM's flag, accepted: adapters are always served here.")
@click.option(
    "--enable-auto-tool-choice", is_flag=True,
    help='vLLM\'s flag: requests with tools may leave the choice between text and calls to the model '
    '(tool_choice "auto", OpenAI\'s default); needs --tool-call-parser.',
)  # fmt: skip
@click.option(
    "--tool-call-parser", type=click.Choice(sorted(TOOL_PARSERS)),
    help="The model's own tool-call format (vLLM's names): hermes for Hermes and Qwen, llama3_json for Llama 3.1 and 3.2, "
    "pythonic for Llama 3.2 and 4's Python-style calls.",
)  # fmt: skip
@click.option(
    "--api-key", envvar=["LORAPLANE_API_KEY", "VLLM_API_KEY"],
    help="vLLM's single key: every API call must send it as a bearer token, and so must the admin calls unless "
    "--admin-token gives them their own. For several tenants and their quotas, --tenants instead.",
)  # fmt: skip
@engine_flags(
    "device", "gpu_memory_utilization", "enforce_eager", "async_scheduling", "max_cudagraph_capture_size", "max_loras",
    "max_lora_rank", "max_cpu_loras", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "dtype", "quantization", "lora_memory", "eviction_policy",
    "require_adapter_digest", "fair_scheduling", "fair_prefill_chunk", "fair_interjection", "step_trace",
)  # fmt: skip
@admin_token_option("Bearer token the admin calls require.")
@click.option(
    "--stats-token", envvar="LORAPLANE_STATS_TOKEN",
    help="A second bearer token that may only read /admin/stats: the router's, so that it can change nothing.",
)  # fmt: skip
@admin_hosts_option
@tenants_option("YAML/JSON of tenants, their API keys and quotas (e.g. a mounted Secret); without it the API is open.")
@metrics_port_option
@usage_options
@click.option(
    "--max-pending-requests", default=256, type=click.IntRange(min=1),
    help="Beyond this, answer 503 (shed load) to the tenants over their share of it.",
)  # fmt: skip
@click.option(
    "--max-stored-responses", default=DEFAULT_MAX_RESPONSES, show_default=True, type=click.IntRange(min=0),
    help="Responses API: at most this many responses kept in memory (and at most --stored-responses-mib), least "
    "recently used out, for previous_response_id and GET /v1/responses/{id}; 0 keeps none (store is then false).",
)  # fmt: skip
@click.option(
    "--stored-responses-mib", default=DEFAULT_MAX_BYTES >> 20, show_default=True, type=click.IntRange(min=0),
    help="Responses API: the stored responses' bound in MiB of JSON.",
)  # fmt: skip
def serve(
    model: str,
    host: str,
    port: int,
    config_path: Path | None,
    lora_modules: tuple[str, ...],
    enable_lora: bool,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    api_key: str | None,
    admin_token: str | None,
    stats_token: str | None,
    admin_hosts: frozenset[str],
    tenants_path: Path | None,
    max_pending_requests: int,
    max_stored_responses: int,
    stored_responses_mib: int,
    metrics_port: int | None,
    **flags: Any,
) -> None:
    """Serve the OpenAI-compatible API (completions, chat, models) plus adapter admin calls."""
    import uvicorn
    import yaml
    from pydantic import ValidationError

    from loraplane.serving.api.app import create_app
    from loraplane.serving.api.openai.responses.store import ResponseStore
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.builder import build_engine
    from loraplane.serving.http.tenants import TenantConfig, Tenants, load_tenants

    if enable_auto_tool_choice and tool_call_parser is None:  # as vLLM refuses it
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser: the format to read calls back from")
    if api_key is not None and tenants_path is not None:
        raise click.UsageError("--api-key and --tenants: give one (--api-key is one key for everything)")
    if api_key is not None and not api_key:
        raise click.UsageError("--api-key: an empty key would let every caller in")
    if api_key:
        # vLLM's --api-key guards every route, its adapter loading included: one key for both here too.
        admin_token = admin_token or api_key
    if tenants_path is not None and not admin_token:
        # With tenants the API is closed to callers without a key; an open admin API would let
        # any of them register, pin or unload every tenant's adapters.
        raise click.UsageError(
            "--tenants needs --admin-token (or LORAPLANE_ADMIN_TOKEN): the admin calls would be open to every tenant"
        )
    metering = make_metering(flags)
    settings: dict[str, object] = yaml.safe_load(config_path.read_text()) or {} if config_path else {}
    settings["model"] = model if model != "embedded" or "model" not in settings else settings["model"]
    settings.update({k: v for k, v in flags.items() if v is not None})
    modules = dict(settings.get("lora_modules") or {})  # type: ignore[call-overload]
    for item in lora_modules:
        name, source = _lora_module(item)
        modules[name] = source
    settings["lora_modules"] = modules
    try:
        config = EngineConfig.model_validate(settings)
    except ValidationError as err:
        raise click.ClickException(str(err)) from None
    try:
        keyed = [TenantConfig(name=API_KEY_TENANT, api_keys=[api_key])] if api_key else None
        tenants = Tenants(load_tenants(tenants_path) if tenants_path else keyed)
    except (ValidationError, yaml.YAMLError) as err:
        raise click.ClickException(f"{tenants_path}: {err}") from None
    app = create_app(
        lambda: build_engine(config), admin_token=admin_token, stats_token=stats_token or None, tenants=tenants,
        max_pending_requests=max_pending_requests, metering=metering,
        admin_hosts=admin_hosts, tool_call_parser=tool_call_parser if enable_auto_tool_choice else None,
        responses=ResponseStore(max_stored_responses, stored_responses_mib << 20),
    )  # fmt: skip
    if metrics_port is not None:
        from loraplane.serving.http.metrics_port import serve_metrics

        serve_metrics(app.state.metrics, host, metrics_port)
    uvicorn.run(app, host=host, port=port, log_level="info")


API_KEY_TENANT = "api-key"  # who the callers of --api-key are, in usage records and metrics


def _lora_module(item: str) -> tuple[str, str]:
    """``NAME=SOURCE``, or vLLM's JSON form of an entry (``base_model_name`` is what vLLM shows as
    the adapter's parent; here the parent is the served base, and adapters are checked against
    it on load)."""
    import json

    if not item.lstrip().startswith("{"):
        name, sep, source = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=SOURCE", param_hint="--lora-modules")
        return name, source
    try:
        entry = json.loads(item)
    except ValueError as err:
        raise click.BadParameter(f"{item!r} is not JSON: {err}", param_hint="--lora-modules") from None
    unknown = set(entry) - {"name", "path", "base_model_name"} if isinstance(entry, dict) else set()
    if not isinstance(entry, dict) or unknown or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
        raise click.BadParameter(
            f'{item!r}: vLLM\'s form is {{"name": ..., "path": ..., "base_model_name": ...}}', param_hint="--lora-modules"
        )
    return entry["name"], entry["path"]
