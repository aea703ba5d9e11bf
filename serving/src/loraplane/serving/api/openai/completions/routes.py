"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, streamed or not, with vLLM's extra
sampling fields (see ``http.protocol``). A tenant calls only what ``Tenants.may_use`` allows
(``models_routes.resolve_model``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraplane.serving.api.deps import Caller, Engine, Server
from loraplane.serving.api.openai.completions.generation import auto_tools, final, meter_for, run, sampling, templated, tokenised
from loraplane.serving.api.openai.completions.logprobs import (
    CompletionLogprobs,
    prompt_logprobs_field,
    token_entries,
    token_namer,
)
from loraplane.serving.api.openai.completions.streaming import NOTHING_SENT, Sent, finish_reason, streamed, usage
from loraplane.serving.api.openai.models_routes import resolve_model
from loraplane.serving.api.openai.tools.calls import tool_answer
from loraplane.serving.engine.outputs import RequestOutput
from loraplane.serving.http.disconnect import cancel_on_disconnect
from loraplane.serving.http.protocol.chat import ChatCompletionRequest
from loraplane.serving.http.protocol.common import new_id, now
from loraplane.serving.http.protocol.completions import DEFAULT_COMPLETION_TOKENS, CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
@cancel_on_disconnect
async def completions(req: CompletionRequest, engine: Engine, tenant: Caller, server: Server, raw_request: Request) -> Any:
    adapter = resolve_model(engine, req.model, tenant)
    # echo with max_tokens 0 returns the prompt alone (how evaluation harnesses score a text): one
    # token is generated, as vLLM does, and left out of the answer.
    generated = not (req.echo and req.max_tokens == 0)
    max_tokens = (req.max_tokens or DEFAULT_COMPLETION_TOKENS) if generated else 1
    # The prompt's entries serve echo with logprobs and vLLM's prompt_logprobs: the engine keeps
    # as many alternatives as the larger asks, and each shows its own.
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    params = await sampling(engine, req, max_tokens, req.logprobs, prompt_logprobs=max(asked, default=None))
    rid, created = new_id("cmpl"), now()
    meter = meter_for(server, rid, "/v1/completions", req.model, adapter, tenant)
    prompts = await tokenised(
        engine,
        req.prompts(),
        add_special_tokens=req.add_special_tokens,
        truncate=req.truncate_prompt_tokens,
        side=req.truncation_side or "left",
    )
    request = await run(server, engine, prompts, params, req.n, meter, tenant, req.cache_salt)
    shown = token_namer(engine, req.return_tokens_as_token_ids)
    logprobs = CompletionLogprobs(shown, req.logprobs or 0, generated=generated)
    tok = engine.engine.tokenizer
    # What is echoed is what the model was given: a token-id or truncated prompt, decoded.
    given = zip(req.prompts(), prompts, strict=True)
    prompt_texts = [
        p if isinstance(p, str) and req.truncate_prompt_tokens is None else tok.decode(ids) for p, ids in given if req.echo
    ]

    def choice(index: int, out: RequestOutput, new: str, sent: Sent) -> dict[str, Any]:
        """Choice ``index``'s chunk: its ``new`` text, after its prompt when echoed and first."""
        echoed = req.echo and sent.first
        text = new if generated else ""
        if echoed:
            text = prompt_texts[index // req.n] + text
        lp = logprobs.of(index, out, sent, with_prompt=echoed) if req.logprobs is not None else None
        body = {"index": index, "text": text, "finish_reason": finish_reason(out), "logprobs": lp}
        if req.return_token_ids:  # vLLM's: the prompt's ids in a choice's first chunk, each chunk its new ids
            if sent.first:
                body["prompt_token_ids"] = out.prompt_token_ids
            body["token_ids"] = out.token_ids[sent.tokens :] if generated else []
        if req.prompt_logprobs is not None:  # never streamed (see protocol)
            body["prompt_logprobs"] = prompt_logprobs_field(engine, out, req.prompt_logprobs)
        return body

    base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
    if not req.stream:
        outs = await final(request)
        choices = [choice(c.index, out, out.text, NOTHING_SENT) for c, out in zip(request.choices, outs, strict=True)]
        return JSONResponse({**base, "usage": usage(meter), "choices": choices})

    return streamed(req, base, request, choice)


@router.post("/v1/chat/completions")
@cancel_on_disconnect
async def chat(req: ChatCompletionRequest, engine: Engine, tenant: Caller, server: Server, raw_request: Request) -> Any:
    adapter = resolve_model(engine, req.model, tenant)
    auto = auto_tools(server, req)
    prompt = await templated(
        engine, req, limit=engine.engine.max_model_len, truncate=req.truncate_prompt_tokens, side=req.truncation_side or "left"
    )
    limit = req.max_completion_tokens or req.max_tokens or max(1, engine.engine.max_model_len - len(prompt))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = await sampling(engine, req, limit, logprobs, prompt_logprobs=req.prompt_logprobs)
    rid, created = new_id("chatcmpl"), now()
    meter = meter_for(server, rid, "/v1/chat/completions", req.model, adapter, tenant)
    request = await run(server, engine, [prompt], params, req.n, meter, tenant, req.cache_salt)

    entries = token_entries(engine, req.return_tokens_as_token_ids)

    def logprobs_of(out: RequestOutput, start: int = 0) -> dict[str, Any] | None:
        return {"content": entries(out.logprobs[start:])} if req.logprobs else None

    def token_ids(out: RequestOutput, start: int = 0) -> dict[str, Any]:
        return {"token_ids": out.token_ids[start:]} if req.return_token_ids else {}

    def prompt_ids(out: RequestOutput) -> dict[str, Any]:
        return {"prompt_token_ids": out.prompt_token_ids} if req.return_token_ids else {}

    tools = tool_answer(req)

    def message(out: RequestOutput) -> dict[str, Any]:
        """A whole answer's message: its text, or the calls it made (content null, as OpenAI's)."""
        if auto is not None:
            return auto.message(out.text, req.echoed())
        if tools is None:
            return {"role": "assistant", "content": req.echoed() + out.text}
        return {"role": "assistant", "content": req.echoed() or None, "tool_calls": tools.calls(out.text)}

    def finished(out: RequestOutput) -> str | None:
        reason = finish_reason(out)
        if auto is not None:
            return auto.finish_reason(out.text, reason)
        return reason if tools is None else tools.finish_reason(out.text, reason)

    base = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
    if not req.stream:
        outs = await final(request)
        body = {**base, "usage": usage(meter), "choices": [
            {"index": c.index, "message": message(out), "finish_reason": finished(out), "logprobs": logprobs_of(out),
             **token_ids(out)}
            for c, out in zip(request.choices, outs, strict=True)
        ]}  # fmt: skip
        # vLLM's: once per response, as the choices share the prompt.
        body.update(prompt_ids(outs[0]))
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_field(engine, outs[0], req.prompt_logprobs)
        return JSONResponse(body)

    def delta_of(index: int, out: RequestOutput, delta: str, sent: Sent) -> dict[str, Any]:
        """A chunk's ``delta``: its new text, or the calls it adds to; a choice's first carries its
        role (and what ``echo`` puts first)."""
        if auto is not None:  # the text that cannot be a call yet, then the calls whole at the end
            text, made = auto.delta(index, out.text, out.finished)
            head: dict[str, Any] = {"content": text} if text else {}
            if sent.first:
                head = {"role": "assistant", "content": req.echoed() + text}
            return {**head, "tool_calls": made} if made else head
        if tools is not None:
            calls = tools.delta_calls(index, delta, sent.first)
            head = {"role": "assistant", "content": req.echoed() or None} if sent.first else {}
            return {**head, "tool_calls": calls} if calls else head
        if sent.first:
            return {"role": "assistant", "content": req.echoed() + delta}
        return {"content": delta} if delta else {}

    def event(index: int, out: RequestOutput, delta: str, sent: Sent) -> dict[str, Any]:
        return {"index": index, "delta": delta_of(index, out, delta, sent), "finish_reason": finished(out),
                "logprobs": logprobs_of(out, sent.logprobs), **token_ids(out, sent.tokens)}  # fmt: skip

    return streamed(req, {**base, "object": "chat.completion.chunk"}, request, event, first=prompt_ids)
