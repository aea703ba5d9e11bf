"""Logits and greedy continuations of mixed-adapter batches against transformers + PEFT.

Tolerances (fp32 on both sides; they differ only in summation order): the tiny model's logits
agree to 1e-4 absolute, the embedded SmolLM2's (30 layers, logits of magnitude ~20) to 2e-3. A
bfloat16 engine is held to bfloat16's error and to a fraction of what each adapter changes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from engine_helpers import engine_greedy, tiny_engine
from peft_reference import hf_greedy
from tiny_models import make_peft_adapter

STEPS = 32
MIX = ["qv4", "all8", None, "mlp16", "ku2", "all8", None, "qv4", "mlp16", "ku2"]


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 23))] for _ in range(n)]


def test_tiny_mixed_batch_matches_peft(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    requests = list(zip(_prompts(len(MIX), 320, seed=5), MIX, strict=True))
    ref_tokens, ref_logits = hf_greedy(tiny_llama, tiny_adapters, requests, STEPS)
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters)
    tokens, logits = engine_greedy(engine, requests, STEPS, eos_id=2)
    for i, (adapter, ours, ref) in enumerate(zip(MIX, logits, ref_logits, strict=True)):
        assert ours.shape == ref.shape == (STEPS, 320)
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"request {i} ({adapter}): max logit error {err:.2e}"
    assert tokens == ref_tokens
    # The adapters matter: without them the same prompts continue differently.
    bare, _ = engine_greedy(engine, [(p, None) for p, _ in requests], STEPS, eos_id=2)
    assert sum(b != t for b, t, a in zip(bare, tokens, MIX, strict=True) if a) >= 6


def test_neighbours_on_one_adapter_match_peft(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    """Adjacent rows that share an adapter form runs: in a decode step the CPU path takes them by
    the rows the engine built, in a prefill step by segments. Either way each row gets its own
    adapter's update, here with runs of three, two and one beside bare-base rows."""
    mix = ["all8", "all8", "all8", None, "qv4", "qv4", None, "ku2"]
    requests = list(zip(_prompts(len(mix), 320, seed=9), mix, strict=True))
    ref_tokens, ref_logits = hf_greedy(tiny_llama, tiny_adapters, requests, STEPS)
    tokens, logits = engine_greedy(tiny_engine(tiny_llama, tmp_path, tiny_adapters), requests, STEPS, eos_id=2)
    for i, (adapter, ours, ref) in enumerate(zip(mix, logits, ref_logits, strict=True)):
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"request {i} ({adapter}): max logit error {err:.2e}"
    assert tokens == ref_tokens


@pytest.mark.parametrize("rslora", [False, True])
def test_per_module_ranks_and_alphas_match_peft(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path, rslora: bool
) -> None:
    """PEFT's ``rank_pattern`` and ``alpha_pattern`` (regular expressions matched against the end
    of each module's name, the first match winning): modules at ranks 2, 4 and 8 and four
    scalings, in a batch beside a uniform adapter and the bare base."""
    patterned = make_peft_adapter(
        tiny_llama, tmp_path / "patterned", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], rslora, seed=7,
        rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 8, "k_proj": 8},
        alpha_pattern={"v_proj": 32, r"layers\.0\..*o_proj": 3, "k_proj": 4},
    )  # fmt: skip
    adapters = {"patterned": patterned, "qv4": tiny_adapters["qv4"]}
    mix = ["patterned", None, "qv4", "patterned", "patterned", "qv4"]
    requests = list(zip(_prompts(len(mix), 320, seed=13), mix, strict=True))
    ref_tokens, ref_logits = hf_greedy(tiny_llama, adapters, requests, STEPS)
    engine = tiny_engine(tiny_llama, tmp_path / "cache", adapters)
    tokens, logits = engine_greedy(engine, requests, STEPS, eos_id=2)
    for i, (adapter, ours, ref) in enumerate(zip(mix, logits, ref_logits, strict=True)):
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"request {i} ({adapter}): max logit error {err:.2e}"
    assert tokens == ref_tokens


def test_a_pissa_adapter_is_served_once_peft_made_it_a_plain_lora(tiny_llama: Path, tmp_path: Path) -> None:
    """PiSSA (``init_lora_weights="pissa"``) trains against a base PEFT changes, and changes again
    when it loads the adapter: saved as trained, it is refused by name. Saved as PEFT converts it
    (``path_initial_model_for_weight_conversion``: a plain LoRA of twice the rank on the original
    base), it is served and matches PEFT's logits on that base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraplane.adapter_format.errors import AdapterValidationError

    torch.manual_seed(3)
    untouched = tmp_path / "initial"
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_llama)),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa"),
    )
    model.peft_config["default"].init_lora_weights = True  # the starting point, as PEFT's docs save it
    model.save_pretrained(str(untouched))
    model.peft_config["default"].init_lora_weights = "pissa"
    with torch.no_grad():  # "training": the adapter moves away from its start
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(tmp_path / "trained"))
    model.save_pretrained(str(tmp_path / "converted"), path_initial_model_for_weight_conversion=str(untouched))
    with pytest.raises(AdapterValidationError, match="path_initial_model_for_weight_conversion"):
        tiny_engine(tiny_llama, tmp_path / "cache0", {"pissa": tmp_path / "trained"})
    adapters = {"pissa": tmp_path / "converted"}
    requests = list(zip(_prompts(3, 320, seed=5), ["pissa", None, "pissa"], strict=True))
    ref_tokens, ref_logits = hf_greedy(tiny_llama, adapters, requests, STEPS)
    tokens, logits = engine_greedy(tiny_engine(tiny_llama, tmp_path / "cache", adapters), requests, STEPS, eos_id=2)
    assert max((ours - ref).abs().max().item() for ours, ref in zip(logits, ref_logits, strict=True)) < 1e-4
    assert tokens == ref_tokens


@pytest.mark.slow
def test_embedded_smollm2_mixed_batch_matches_peft(tmp_path: Path) -> None:
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine.builder import build_engine
    from loraplane.serving.weights.embedded import EMBEDDED_NAME

    engine = build_engine(EngineConfig(dtype="float32", max_loras=4, max_lora_rank=16))
    folder = engine.base.folder
    specs = {
        "qv4": (4, 8, ["q_proj", "v_proj"], False),
        "all8": (8, 16, None, False),
        "mlp16": (16, 16, ["gate_proj", "down_proj", "o_proj"], False),
        "ku2": (2, 4, ["k_proj", "up_proj"], True),
    }
    adapters = {}
    for i, (name, (r, a, t, rs)) in enumerate(specs.items()):
        targets = t or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapters[name] = make_peft_adapter(
            folder, tmp_path / name, r, a, targets, rs, seed=i + 1, std=0.02, base_name=EMBEDDED_NAME
        )
        engine.load_lora(name, str(adapters[name]))
    tok = engine.tokenizer
    questions = [
        "What is 2+2?",
        "Name a colour.",
        "Say hello.",
        "Why is the sky blue?",
        "Count to five.",
        "Write a haiku.",
        "What is Kubernetes?",
        "Define LoRA.",
    ]
    mix = ["qv4", "all8", None, "mlp16", "ku2", "all8", None, "qv4"]
    requests = [(tok.chat([{"role": "user", "content": q}]), a) for q, a in zip(questions, mix, strict=True)]
    eos = tok.eos_token_id
    ref_tokens, ref_logits = hf_greedy(folder, adapters, requests, STEPS, pad_id=eos or 0)
    tokens, logits = engine_greedy(engine, requests, STEPS, eos_id=eos)
    for i, (ours, ref) in enumerate(zip(logits, ref_logits, strict=True)):
        err = (ours - ref).abs().max().item()
        assert err < 2e-3, f"request {i} ({mix[i]}): max logit error {err:.2e}"
    assert tokens == ref_tokens
    assert torch.isfinite(torch.stack(logits)).all()


def test_prompt_log_probabilities_match_peft_chunked_and_beside_cached_prompts(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's prompt_logprobs (what echo with logprobs returns): each prompt token's log-probability
    under the adapter, as transformers + PEFT compute it over the whole prompt, though the prompt
    is computed in chunks (a small token budget) and the same prompt's blocks were cached by an
    earlier request (which must not be reused: their rows would be missing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplane.serving.engine.sampling_params import SamplingParams

    prompt = _prompts(1, 320, seed=11)[0] * 3  # about 30 to 60 tokens: several chunks of 16
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(model, str(tiny_adapters["all8"])).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, max_num_batched_tokens=16)
    engine.generate([prompt], SamplingParams(max_tokens=1), ["all8"])  # its blocks are cached now
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), ["all8"])
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None  # nothing predicts the first token
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and entry.token_id == prompt[i]
        assert abs(entry.logprob - float(ref[i - 1, prompt[i]])) < 1e-4, f"position {i}"
        assert [t for t, _ in entry.top] == torch.topk(ref[i - 1], 3).indices.tolist()
        # vLLM's rank: 1 + the tokens more likely than the prompt's (tokens within the float error
        # of it may count either way).
        chosen = ref[i - 1, prompt[i]]
        assert entry.rank is not None
        assert int((ref[i - 1] > chosen + 1e-4).sum()) + 1 <= entry.rank <= int((ref[i - 1] > chosen - 1e-4).sum()) + 1


def test_bfloat16_engine_keeps_every_adapters_effect(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    """A bfloat16 engine (the CPU default where bfloat16 is native): its adapter products run in
    float32 on decode rows and in bfloat16 GEMMs on prefill segments, each added into a bfloat16
    output. Scored against transformers + PEFT in float32 on the same tokens, the prompt
    (prefill) and the answer (decode) each stay within bfloat16's error, far below what each
    adapter changes: an adapter product lost or misplaced on either path would be as large."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplane.serving.engine.sampling_params import SamplingParams

    names = ["qv4", "all8", "mlp16", "ku2"]
    prompts = _prompts(len(names), 320, seed=3)
    prompts = [(p * 4)[:40] for p in prompts]  # 40 tokens: long segments, the prefill GEMM path
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, dtype="bfloat16")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = engine.generate(prompts, params, list(names))  # one mixed batch
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        assert out.prompt_logprobs is not None
        seq = prompt + list(out.token_ids)
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval(), str(tiny_adapters[name])
        ).eval()
        with torch.no_grad():
            ref = torch.log_softmax(adapted(torch.tensor([seq])).logits[0], -1)
            bare = torch.log_softmax(base(torch.tensor([seq])).logits[0], -1)
        targets = torch.tensor(seq[1:])
        ref_lp = ref[:-1].gather(1, targets[:, None])[:, 0]
        effect = (ref_lp - bare[:-1].gather(1, targets[:, None])[:, 0]).abs()
        ours = torch.tensor([e.logprob for e in out.prompt_logprobs[1:] if e is not None] + [e.logprob for e in out.logprobs])
        err = (ours - ref_lp).abs()
        assert err.max() < 0.06, f"{name}: max log-probability error {err.max():.3f}"
        for part, rows in (("prompt", slice(0, len(prompt) - 1)), ("answer", slice(len(prompt) - 1, None))):
            mean_err = float(err[rows].mean())
            assert mean_err < 0.3 * effect.mean(), f"{name} {part}: error {mean_err:.4f}, effect {effect.mean():.4f}"
