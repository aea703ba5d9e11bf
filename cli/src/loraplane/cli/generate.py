"""``loraplane generate``: one completion from the engine, from the shell."""

from __future__ import annotations

import click


@click.command()
@click.argument("prompt")
@click.option("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct), a .gguf file or a checkpoint folder.")
@click.option("--adapter", default=None, help="PEFT adapter folder to apply (omit for the bare base).")
@click.option("--max-tokens", default=64, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, type=click.FloatRange(0, 2), help="0 is greedy.")
@click.option("--top-p", default=1.0, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, type=click.IntRange(min=0))
@click.option("--seed", default=None, type=int)
@click.option("--raw", is_flag=True, help="Send PROMPT as is instead of wrapping it in the chat template.")
@click.option("--fp8", is_flag=True, help="Run the base in float8_e4m3fn (adapters stay full precision).")
def generate(
    prompt: str,
    model: str,
    adapter: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    raw: bool,
    fp8: bool,
) -> None:
    """Complete PROMPT with the engine, optionally under a LoRA adapter: a quick look from the shell."""
    from loraplane.adapter_format import AdapterValidationError
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.builder import build_engine
    from loraplane.serving.engine.llm_engine import RequestError
    from loraplane.serving.engine.sampling_params import SamplingError, SamplingParams

    click.echo("loading the base model (the first start converts and caches it)...", err=True)
    engine = build_engine(EngineConfig(model=model, quantization="fp8" if fp8 else None, max_loras=1, max_lora_rank=64))
    name = None
    try:
        if adapter:
            name = "cli"
            engine.load_lora(name, adapter)
        ids = engine.tokenizer.encode(prompt) if raw else engine.tokenizer.chat([{"role": "user", "content": prompt}])
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        out = engine.generate([ids], params, [name])[0]
    except (AdapterValidationError, RequestError, SamplingError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(out.text)
    click.echo(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}]", err=True)
