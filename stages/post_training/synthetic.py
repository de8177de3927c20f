"""A synthetic verifiable task and a tiny local HF policy, for tests, benchmarks and
the demo (nothing can be downloaded here).

The task: "Say <n>." -> "<n>"; the reward (``first_number_match``) checks the first
number of the completion. The policy: a random-init ``LlamaForCausalLM`` and the
run's byte-level BPE tokenizer (``stages.hf.train_tokenizer``, chat template
included) trained on the task's text, saved with ``stages.hf.export_hf``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def _say(n: int) -> dict[str, Any]:
    return {"prompt": f"Say {n}.", "answer": str(n)}


def write_task(
    folder: Path, *, n_prompts: int = 10, rl_numbers: tuple[int, ...] = (7,), seed: int = 0
) -> dict[str, Path]:
    """SFT (conversational) and DPO (preference) files over ``n_prompts`` numbers; the
    RLVR prompt/answer file over ``rl_numbers`` (a few, so a tiny policy that SFT
    left near chance can visibly improve within a few RL steps)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    nums = list(range(n_prompts))
    sft = [
        {
            "messages": [
                {"role": "user", "content": f"Say {n}."},
                {"role": "assistant", "content": str(n)},
            ]
        }
        for n in nums
    ]
    dpo = [
        {
            "prompt": [{"role": "user", "content": f"Say {n}."}],
            "chosen": [{"role": "assistant", "content": str(n)}],
            "rejected": [{"role": "assistant", "content": str((n + rng.randint(1, 9)) % 10)}],
        }
        for n in nums
    ]
    rl = [_say(n) for n in rl_numbers]
    paths = {}
    for name, rows in (("sft", sft), ("dpo", dpo), ("rlvr", rl)):
        p = folder / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = p
    return paths


def build_tiny_policy(folder: Path, *, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """A random-init tiny Llama + tokenizer saved as a local HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.hf import train_tokenizer

    corpus = [f"Say {n}. {n} " * 3 for n in range(100)] + [
        "user assistant system Say number answer"
    ] * 5
    tok = train_tokenizer(corpus, vocab_size=320)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    from stages.hf import export_hf

    return export_hf(model, tok, folder, metadata={"source": "synthetic tiny policy"})
