"""Train the demo's style adapters with PEFT on CPU, once; later runs find them in the cache.

The recipe is small on purpose (rank 16 on all seven projections, 20 steps of 8 examples, bf16
autocast where the CPU has native bf16): about 40 seconds per adapter on two cores, enough for
the base to pick up a style it can then apply to questions it was never trained on. Training
goes through transformers + PEFT, exactly as a customer's fine-tuning job would, so the files
the server loads are what PEFT writes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from loraplane.adapter_format import LLAMA_TARGETS
from loraplane.serving.config import EngineConfig
from loraplane.serving.demo.styles import STYLES, Style, training_questions
from loraplane.serving.engine.builder import build_engine, resolve_dtype
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.weights.base import BaseCheckpoint, resolve_base

RECIPE = {"rank": 16, "alpha": 32, "steps": 20, "batch": 8, "lr": 4e-3, "answer_tokens": 40, "seed": 0, "version": 1}


def base_answers(model: str, cache_dir: Path, questions: list[str]) -> list[str]:
    """What the bare base says to each question (greedy), through our own engine in one batch."""
    engine = build_engine(EngineConfig(model=model, cache_dir=cache_dir, max_num_seqs=32))
    try:
        prompts = [engine.tokenizer.chat([{"role": "user", "content": q}]) for q in questions]
        params = SamplingParams(max_tokens=int(RECIPE["answer_tokens"]), temperature=0)
        return [out.text for out in engine.generate(prompts, params)]
    finally:
        engine.adapters.close()


def train_adapter(base: BaseCheckpoint, style: Style, questions: list[str], answers: list[str], out: Path) -> Path:
    """Fine-tune ``style`` into a PEFT LoRA adapter at ``out`` (written whole or not at all)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(int(RECIPE["seed"]))
    tokenizer = AutoTokenizer.from_pretrained(base.folder)
    base_model = AutoModelForCausalLM.from_pretrained(base.folder, dtype=torch.float32)
    rank = int(RECIPE["rank"])
    config = LoraConfig(r=rank, lora_alpha=int(RECIPE["alpha"]), target_modules=list(LLAMA_TARGETS), task_type="CAUSAL_LM")
    model = get_peft_model(base_model, config)
    examples = []
    for question, answer in zip(questions, answers, strict=True):
        user = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": style.rewrite(answer)}], tokenize=False)
        ids = tokenizer(full, add_special_tokens=False).input_ids
        examples.append((ids, len(tokenizer(prompt, add_special_tokens=False).input_ids)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=float(RECIPE["lr"]))
    order = torch.Generator().manual_seed(int(RECIPE["seed"]))
    batch = int(RECIPE["batch"])
    autocast = resolve_dtype("auto") == torch.bfloat16  # emulated bf16 would be slower than fp32
    steps = tqdm(range(int(RECIPE["steps"])), desc=f"training {style.name}", unit="step", leave=False)
    for _ in steps:
        picked = [examples[i] for i in torch.randperm(len(examples), generator=order)[:batch].tolist()]
        width = max(len(ids) for ids, _ in picked)
        input_ids = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), -100)  # only the answer's tokens are learned
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, (ids, prompt_len) in enumerate(picked):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
            mask[row, : len(ids)] = 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.set_postfix(loss=f"{loss.item():.2f}")
    model.peft_config["default"].base_model_name_or_path = base.shape.name  # not our cache path
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial), save_embedding_layers=False)  # no hub lookup of the base
    partial.rename(out)
    return out


def demo_adapters(model: str, cache_dir: Path, store: Path | None = None) -> dict[str, Path]:
    """Style name -> PEFT folder under ``store`` (default: the cache), training the ones it lacks.
    The key covers the base's fingerprint, the recipe and the style's name, so a new base or
    recipe retrains."""
    base = resolve_base(model, cache_dir)
    store = store or cache_dir / "demo-adapters"
    folders = {}
    for style in STYLES:
        key = hashlib.sha256(json.dumps([base.shape.fingerprint, RECIPE, style.name]).encode()).hexdigest()[:16]
        folders[style.name] = store / f"{style.name}-{key}"
    missing = [s for s in STYLES if not (folders[s.name] / "adapter_config.json").is_file()]
    if missing:
        questions = training_questions()
        answers = base_answers(model, cache_dir, questions)
        for style in tqdm(missing, desc="demo adapters", unit="adapter"):
            folders[style.name].parent.mkdir(parents=True, exist_ok=True)
            train_adapter(base, style, questions, answers, folders[style.name])
    return folders
