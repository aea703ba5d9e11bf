"""The chat template as the server applies it: variables a request may set, and a template's own
refusals, each an error the server answers with a 400 rather than a 500."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from loraplane.serving.http.protocol.chat import ChatCompletionRequest
from loraplane.serving.tokenizer import TemplateVariableError, Tokenizer

TURNS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer(tiny_llama)


def test_variables_reach_the_template(tokenizer: Tokenizer) -> None:
    tokenizer.hf.chat_template = "{% if greeting %}{{ greeting }} {% endif %}{{ messages[0]['content'] }}"
    assert tokenizer.hf.decode(tokenizer.chat(TURNS, add_generation_prompt=False, variables={"greeting": "hello"})) == "hello hi"


def test_documents_and_reasoning_effort_reach_the_template_as_vllm_hands_them_over(tokenizer: Tokenizer) -> None:
    """vLLM's chat ``documents`` (Hugging Face's argument of that name) and ``reasoning_effort``
    (as itself, and as ``enable_thinking``, off for "none", unless ``chat_template_kwargs`` set
    it), from a request body to the rendered prompt."""
    tokenizer.hf.chat_template = (
        "{% for d in documents or [] %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
        "{{ reasoning_effort | default('-') }} {{ enable_thinking | default('-') }} {{ messages[0]['content'] }}"
    )

    def rendered(**body: object) -> str:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": TURNS, "add_generation_prompt": False, **body})
        return str(tokenizer.hf.decode(tokenizer.chat(**req.template_input())))

    assert rendered() == "- - hi"
    docs = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    assert rendered(documents=docs, reasoning_effort="low") == "[a: one][b: two]low True hi"
    assert rendered(reasoning_effort="none") == "none False hi"
    assert rendered(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) == "high False hi"
    for bad in ({"reasoning_effort": "extreme"}, {"documents": [{"title": 1}]}, {"chat_template_kwargs": {"documents": []}}):
        with pytest.raises((pydantic.ValidationError, TemplateVariableError)):
            rendered(**bad)


@pytest.mark.parametrize("name", ["messages", "tokenize", "chat_template", "tools", "add_generation_prompt"])
def test_a_variable_may_not_set_the_templating_calls_own_arguments(tokenizer: Tokenizer, name: str) -> None:
    with pytest.raises(TemplateVariableError, match=name):
        tokenizer.chat(TURNS, variables={name: "{{ 1 }}"})


def test_a_template_that_refuses_the_turns_is_a_value_error(tokenizer: Tokenizer) -> None:
    tokenizer.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.chat(TURNS)
    with pytest.raises(ValueError, match="refused"):  # a variable shadowing the template's own function
        tokenizer.chat(TURNS, variables={"raise_exception": 1})


def test_the_tokenizers_own_bos_only_when_asked(tokenizer: Tokenizer) -> None:
    """vLLM's chat ``add_special_tokens``: the template writes the BOS itself, so a templated
    conversation gets the tokenizer's (here a post-processor that prepends ``<s>``, as Llama's
    tokenizers do) only when asked; a plain prompt gets it by default."""
    from tokenizers.processors import TemplateProcessing

    bos = tokenizer.hf.convert_tokens_to_ids("<s>")
    tokenizer.hf._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.hf.chat_template = "{{ messages[0]['content'] }}"
    plain = tokenizer.chat(TURNS, add_generation_prompt=False)
    assert bos not in plain and tokenizer.encode("hi") == [bos, *plain]
    assert tokenizer.chat(TURNS, add_generation_prompt=False, add_special_tokens=True) == [bos, *plain]
    assert tokenizer.chat(TURNS, add_generation_prompt=False, add_special_tokens=True, limit=8) == [bos, *plain]


def test_truncation_keeps_the_bos_as_vllms_does(tokenizer: Tokenizer) -> None:
    """vLLM's ``truncate_prompt_tokens`` (Hugging Face's truncation from the left): the last k
    tokens counting the tokenizer's BOS, which stays first; without special tokens, the plain last
    k; a prompt shorter than k whole."""
    from tokenizers.processors import TemplateProcessing

    bos = tokenizer.hf.convert_tokens_to_ids("<s>")
    tokenizer.hf._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    text = "the quick brown fox jumps over the lazy dog"
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert len(plain) > 6
    assert tokenizer.encode_kept(text, 5) == [bos, *plain[-4:]]
    assert tokenizer.encode_kept(text, 5, add_special_tokens=False) == plain[-5:]
    assert tokenizer.encode_kept(text, 100) == tokenizer.encode(text) == [bos, *plain]
    # vLLM's truncation_side "right": the first k, the BOS still first and counted.
    assert tokenizer.encode_kept(text, 5, side="right") == [bos, *plain[:4]]
    assert tokenizer.encode_kept(text, 5, side="right", add_special_tokens=False) == plain[:5]
