"""Greedy continuations and raw logits from Hugging Face transformers (+ PEFT when adapters are given), the reference the
engine is measured against. PEFT runs the mixed batch itself (``adapter_names``, with
``__base__`` for requests without an adapter), left-padded as transformers expects."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(
    base_folder: Path,
    adapters: dict[str, Path],
    requests: list[tuple[list[int], str | None]],
    steps: int,
    pad_id: int = 0,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    eos_ids: frozenset[int] = frozenset(),
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(generated token ids, raw logits [steps, vocab] float32 on the host) per request; EOS (the
    model's, and ``eos_ids``) is suppressed for ``steps`` tokens (``min_new_tokens``) so every
    continuation has the same length. ``device`` and ``dtype`` move the model and its adapters
    (benchmarks/gpu_check.py compares the engine with it on a GPU in bfloat16)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=dtype).eval()
    extra: dict[str, object] = {"eos_token_id": sorted(eos_ids)} if eos_ids else {}
    if adapters:
        names = list(adapters)
        model = PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(str(adapters[name]), adapter_name=name)
        model.eval()
        extra["adapter_names"] = [a or "__base__" for _, a in requests]
    model = model.to(device=device, dtype=dtype)
    width = max(len(p) for p, _ in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for i, (prompt, _) in enumerate(requests):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **extra,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad_id,
        )
    tokens = out.sequences[:, width:].tolist()
    logits = torch.stack(out.logits, dim=1).float().cpu()
    return tokens, [logits[i] for i in range(len(requests))]
