"""Running one OpenAI request on the engine, shared by completions and chat: its sampling
parameters, its prompts as token ids, its admission (load shedding, then quotas, then one engine
sequence per choice), and its outputs once finished.

A refusal at any stage is an ``APIError`` before a response has started, so a client gets a 4xx
or 503 status rather than a 200 stream that fails; a refusal releases what admission took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence

from loraplane.serving.api.deps import ServerState
from loraplane.serving.api.metering import RequestMeter
from loraplane.serving.api.openai.completions.choices import Choice, Choices
from loraplane.serving.api.openai.tools.parsers import AutoAnswer
from loraplane.serving.engine.async_engine import AsyncEngine
from loraplane.serving.engine.llm_engine import ContextLengthExceeded, RequestError
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.engine.sampling_params import SamplingError, SamplingParams
from loraplane.serving.engine.sequence import FinishReason
from loraplane.serving.engine.structured import GrammarError, Guide
from loraplane.serving.http.errors import APIError
from loraplane.serving.http.protocol.chat import ChatCompletionRequest, ChatTemplating
from loraplane.serving.http.protocol.completions import CompletionRequest
from loraplane.serving.http.tenants import TenantConfig
from loraplane.serving.lora.entries import AdapterNotFound, AdapterUnavailable
from loraplane.serving.tokenizer import PromptTooLong, Side, TemplateVariableError, kept

Request = CompletionRequest | ChatCompletionRequest
COMPILE_DEADLINE_SECONDS = 10.0  # a response_format schema's compile, queueing included


async def sampling(
    engine: AsyncEngine, req: Request, max_tokens: int, logprobs: int | None, *, prompt_logprobs: int | None = None
) -> SamplingParams:
    guide = await guide_for(engine, req)
    bad_words = await bad_words_ids(engine, req.bad_words or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=req.ignore_eos,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            repetition_penalty=req.repetition_penalty,
            min_tokens=req.min_tokens,
            logit_bias=req.bias_list(),
            allowed_token_ids=tuple(req.allowed_token_ids or ()),
            bad_words_token_ids=bad_words,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            guide=guide,
        )
    except SamplingError as err:
        raise APIError(400, str(err), param=err.param) from None


async def bad_words_ids(engine: AsyncEngine, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as the token sequences the engine rules out, encoded off the event
    loop; a word that spells no token is a 400 naming the field (one of too many tokens is
    ``SamplingParams``' to refuse)."""
    if not words:
        return ()
    try:
        return await asyncio.to_thread(engine.engine.tokenizer.bad_words_ids, words)
    except ValueError as err:
        raise APIError(400, str(err), param="bad_words") from None


async def guide_for(engine: AsyncEngine, req: Request) -> Guide | None:
    """The structured-output guide for ``response_format`` or vLLM's ``structured_outputs`` (None
    for plain text), compiled on the grammar compiler's own threads, so a flood of heavy grammars
    never delays another request's tokenisation; one the grammar library cannot compile, or not
    within ``COMPILE_DEADLINE_SECONDS``, is a 400 naming the field, with the reason."""
    constraint = req.output_constraint()
    if constraint is None:
        return None
    param, kind, spec = constraint
    grammars = engine.engine.grammars
    work = asyncio.get_running_loop().run_in_executor(grammars.pool, grammars.compile, spec, kind)
    try:  # asyncio.timeout, not wait_for: wait_for may swallow a cancel that lands as the compile ends
        async with asyncio.timeout(COMPILE_DEADLINE_SECONDS):
            return await work
    except GrammarError as err:
        raise APIError(400, f"{param}: {err}", param=param) from None
    except TimeoutError:  # a compile already running finishes within llguidance's own fuel bounds
        raise APIError(
            400, f"{param}: it did not compile within {COMPILE_DEADLINE_SECONDS:g} s; simplify it", param=param
        ) from None


def auto_tools(server: ServerState, req: ChatCompletionRequest) -> AutoAnswer | None:
    """How the answers of a request that leaves the choice between text and calls to the model
    are read (None when it does not); without the server's tool-call parser, a 400 as vLLM's."""
    if not req.auto_tools():
        return None
    if server.tool_parser is None:
        raise APIError(
            400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set (this '
            'server reads no model\'s own tool-call format); ask for "required", a named function, or "none"',
            param="tool_choice",
        )  # fmt: skip
    return AutoAnswer(server.tool_parser)


def kept_tokens(truncate: int | None, limit: int) -> int | None:
    """How many of a prompt's last tokens vLLM's ``truncate_prompt_tokens`` keeps (-1: the
    context); more than the context is a 400, as vLLM answers."""
    if truncate is None:
        return None
    if truncate > limit:
        raise APIError(
            400, f"truncate_prompt_tokens: {truncate} is more than max_model_len ({limit})", param="truncate_prompt_tokens"
        )
    return limit if truncate == -1 else truncate


async def tokenised(
    engine: AsyncEngine, prompts: list[str | list[int]], *, add_special_tokens: bool = True, truncate: int | None = None,
    side: Side = "left",
) -> list[list[int]]:  # fmt: skip
    """Each prompt as token ids, encoded off the event loop and the engine thread; one longer
    than the context is a 400 before most of it is encoded, unless ``truncate`` keeps ``side``'s
    tokens of it (then it is encoded whole, which the body's size bounds)."""
    tokenizer, limit = engine.engine.tokenizer, engine.engine.max_model_len
    keep = kept_tokens(truncate, limit)

    def encode(p: str | list[int]) -> list[int]:
        if isinstance(p, list):
            return kept(p, keep, side)
        if keep is not None:
            return tokenizer.encode_kept(p, keep, side=side, add_special_tokens=add_special_tokens)
        return tokenizer.encode_within(p, limit, add_special_tokens=add_special_tokens)

    try:
        return await asyncio.to_thread(lambda: [encode(p) for p in prompts])
    except PromptTooLong as err:
        raise APIError(400, str(err), param="prompt", code="context_length_exceeded") from None


async def templated(
    engine: AsyncEngine, req: ChatTemplating, *, limit: int | None = None, truncate: int | None = None, side: Side = "left"
) -> list[int]:
    """The conversation through the chat template, as token ids, templated and encoded off the
    event loop and the engine thread; one beyond ``limit`` tokens (unless ``truncate`` keeps
    ``side``'s tokens of it), a template variable that is not one, or a conversation the template
    refuses is a 400."""
    keep = kept_tokens(truncate, engine.engine.max_model_len)
    try:
        ids = await asyncio.to_thread(engine.engine.tokenizer.chat, **req.template_input(), limit=None if keep else limit)
    except PromptTooLong as err:
        raise APIError(400, str(err), param="messages", code="context_length_exceeded") from None
    except TemplateVariableError as err:
        raise APIError(400, str(err), param="chat_template_kwargs") from None
    except ValueError as err:  # no chat template, or one that refuses these turns
        raise APIError(400, str(err), param="messages") from None
    return kept(ids, keep, side)


def meter_for(
    server: ServerState, request_id: str, endpoint: str, model: str, adapter: str | None, tenant: TenantConfig | None
) -> RequestMeter:
    engine = server.ready().engine
    base = engine.base.shape.name
    meter = RequestMeter(server.metering, request_id, endpoint, model, adapter, tenant.name if tenant else None, base)
    if engine.base.merged and adapter is None:  # a dedicated replica: billed as the adapter it serves
        meter.billed_as = base
    return meter


async def first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Start the request so that refusals (unknown adapter, too long) become 4xx before any
    streaming response has been committed."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except ContextLengthExceeded as err:
        raise APIError(400, str(err), code="context_length_exceeded") from None  # the prompt or max_tokens
    except SamplingError as err:
        raise APIError(400, str(err), param=err.param) from None
    except RequestError as err:
        raise APIError(400, str(err)) from None
    except AdapterNotFound as err:
        raise APIError(404, str(err), code="model_not_found", param="model") from None
    except AdapterUnavailable as err:
        raise APIError(503, str(err), type_="server_error", code="adapter_load_failed") from None


def failure(out: RequestOutput) -> APIError | None:
    """The OpenAI error a request that failed in the engine ends in: 400 when its own settings
    left no token to draw, 503 when its adapter could not load (retrying elsewhere may help), 500
    otherwise."""
    if out.finish_reason is not FinishReason.ERROR:
        return None
    code = out.error_code or "engine_error"
    if code == "no_token_allowed":
        return APIError(400, out.error or "no token is allowed", code=code)
    return APIError(503 if code == "adapter_load_failed" else 500, out.error or "the request failed",
                    type_="server_error", code=code)  # fmt: skip


async def admit(
    server: ServerState, prompts: Sequence[str | list[int]], params: SamplingParams, n: int, meter: RequestMeter,
    tenant: TenantConfig | None,
) -> Choices:  # fmt: skip
    """Admit the request: the server's bound on pending requests, then the tenant's and the
    adapter's quotas. Returns its (empty) choices, which release it once (its pending count, its
    quota reservation, its tokens) however it ends."""
    # Counted here on the event loop (not read from the engine thread), so a burst of
    # handlers cannot all pass the check before any of them reaches the engine.
    adapter, tenants = meter.billed_as or meter.adapter, server.tenants  # a dedicated replica's quotas are its adapter's
    total = len(prompts) * n
    if not server.pending.admit(meter.tenant, total):
        raise APIError(503, "the server is at capacity; retry shortly", type_="server_error", code="overloaded", retry_after=1)
    # The most it can use, reserved against a token quota until it ends: the prompts (each
    # once, as usage counts them) and max_tokens for every choice.
    most = sum(len(p) for p in prompts if isinstance(p, list)) + params.max_tokens * total
    try:
        reservation = tenants.admit(tenant, adapter, most)
    except APIError as err:  # a quota refusal: billed nothing, recorded once as refused
        server.pending.release(meter.tenant, total)
        await server.metering.refuse(meter.request_id, err.status, tenant=meter.tenant, model=meter.model, adapter=adapter,
                                     base=meter.base, endpoint=meter.endpoint)  # fmt: skip
        raise
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            server.pending.release(meter.tenant, total)
            prompt_tokens, _, completion_tokens = meter.tokens()
            usage: dict[str, object] = {
                "adapter": adapter,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
            }
            tenants.finish(tenant, usage, reservation)

    return Choices([], meter, release)


def cache_scope(tenant: str | None, cache_salt: str | None) -> str | None:
    """Whose cached prompt blocks a request may reuse: its tenant's, narrowed by vLLM's
    ``cache_salt``. A shared prefix cache would let one tenant learn another's prompts from the
    cached token count or the time to first token; with no tenants and no salt, everyone shares."""
    if tenant is None and cache_salt is None:
        return None
    return json.dumps([tenant, cache_salt])  # unambiguous whatever either string holds


async def run(
    server: ServerState, engine: AsyncEngine, prompts: Sequence[str | list[int]], params: SamplingParams, n: int,
    meter: RequestMeter, tenant: TenantConfig | None, cache_salt: str | None = None,
) -> Choices:  # fmt: skip
    """Admit the request and start one engine sequence per choice. A choice refused at its start
    refuses the request, and the others are aborted."""
    request = await admit(server, prompts, params, n, meter, tenant)
    scope = cache_scope(meter.tenant, cache_salt)
    total = len(prompts) * n
    for i, prompt in enumerate(prompts):
        leader: str | None = None
        for j in range(n):
            index = i * n + j
            rid = meter.request_id if total == 1 else f"{meter.request_id}-{index}"
            meter.expect(rid, i, index)
            # As vLLM: the samples of a seeded request differ from each other and are each reproducible.
            p = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
            stream = engine.generate(prompt, p, meter.adapter, rid, tenant=meter.tenant, after=leader, cache_scope=scope)
            request.choices.append(Choice(index, rid, stream))
            leader = leader or rid
    try:
        firsts = await asyncio.gather(*(first_output(c.stream) for c in request.choices), return_exceptions=True)
    except BaseException:  # cancelled (the client left, the server stops): nothing stays held
        request.close()
        raise
    error = next((f for f in firsts if isinstance(f, BaseException)), None)
    for c, first in zip(request.choices, firsts, strict=True):
        if isinstance(first, RequestOutput):
            c.first = first
            meter.seen(first)
            error = error or failure(first)  # failed at its first token: an error status, not a 200 stream
    if error is not None:
        request.close()
        raise error
    return request


async def final(request: Choices) -> list[RequestOutput]:
    """Drain a non-streamed request: every choice's last output (its usage record written),
    or the OpenAI error one of them ended in."""
    outs = await request.drain()
    for out in outs:
        if (err := failure(out)) is not None:
            raise err
    return outs
