"""The demo tenant's files: pretraining data, the post-training task and the manifest
(llama-tiny, two curriculum phases, SFT -> DPO -> RLVR), written inside the account's
data and checkpoint roots with each file's sha256."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Tokens each ladder-probe proxy of the demo trains on: 59 steps of 8 x 64 bytes.
DEMO_PROBE_TOKENS = 59 * 8 * 64


def write_data(data_dir: Path, rng: random.Random) -> tuple[Path, Path]:
    """Baseline: stdlib docstrings. Custom: GSM8K-train math text, with planted
    near-duplicates and GSM8K-test questions so dedup and decontamination show work."""
    data_dir.mkdir(parents=True, exist_ok=True)
    baseline = data_dir / "baseline.jsonl"
    shutil.copyfile(REPO / "data" / "python_docs" / "train.jsonl", baseline)
    train = [
        json.loads(line)
        for line in (REPO / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:3000]
    ]
    test = [
        json.loads(line)
        for line in (REPO / "configs" / "evals" / "gsm8k" / "test.jsonl").read_text().splitlines()
    ]
    docs = [f"{t['question']}\n{t['answer']}" for t in train]
    for doc in rng.sample(docs, 40):  # near-duplicates: one word changed
        words = doc.split()
        words[rng.randrange(len(words))] = "indeed"
        docs.append(" ".join(words))
    for item in rng.sample(test, 25):  # leaked eval questions
        docs.append(f"Practice problem. {item['question']} Show your work.")
    rng.shuffle(docs)
    custom = data_dir / "custom_math.jsonl"
    custom.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return baseline, custom


# The post-training task: one-digit sums, asked as GSM8K-style questions. SFT teaches
# the answer format on every sum, DPO prefers the right sum over a wrong one, and RLVR
# (reward: the completion's first number) trains on a few of them, where the small
# model that SFT left near chance can visibly improve in a few steps.
POST_TRAINING_SUMS = [(a, b) for a in range(5) for b in range(5)]
RLVR_SUMS = [(3, 4), (2, 2), (1, 5)]


def write_post_training_data(folder: Path, rng: random.Random) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)

    def question(a: int, b: int) -> str:
        return f"What is {a} + {b}?"

    rows: dict[str, list[dict[str, Any]]] = {
        "sft": [
            {
                "messages": [
                    {"role": "user", "content": question(a, b)},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
            for a, b in POST_TRAINING_SUMS
        ],
        "dpo": [
            {
                "prompt": [{"role": "user", "content": question(a, b)}],
                "chosen": [{"role": "assistant", "content": str(a + b)}],
                "rejected": [
                    {"role": "assistant", "content": str((a + b + rng.randint(1, 9)) % 10)}
                ],
            }
            for a, b in POST_TRAINING_SUMS
        ],
        "rlvr": [{"prompt": question(a, b), "answer": str(a + b)} for a, b in RLVR_SUMS],
    }
    paths = {}
    for objective, lines in rows.items():
        paths[objective] = folder / f"{objective}.jsonl"
        paths[objective].write_text("".join(json.dumps(r) + "\n" for r in lines))
    return paths


def post_training_recipe(data: dict[str, Path]) -> dict[str, Any]:
    """The recipe: no ``base_model``, so SFT starts from pretraining's HF export. Each
    objective is gated on its own battery: SFT on the held-out NLL gain, DPO on the margin
    gain, RLVR on the reward gain (last quarter of its steps over the first)."""
    from stages.data_prep import file_sha256

    def ref(objective: str) -> dict[str, Any]:
        return {
            "uri": f"file://{data[objective]}",
            "sha256": file_sha256(data[objective]),
            "provenance": {"source": "synthetic one-digit sums (the demo)", "license": "CC0-1.0"},
        }

    return {
        "sft": {
            "data": ref("sft"),
            "steps": 40,
            "learning_rate": 0.01,
            "batch_size": 8,
            "gate": {"metric": "nll_gain", "min": 0.5},
        },
        "dpo": {
            "data": ref("dpo"),
            "steps": 10,
            "learning_rate": 0.003,
            "gate": {"metric": "margin_gain", "min": 0.5},
        },
        "rlvr": {
            "data": ref("rlvr"),
            "steps": 10,
            "reward": "first_number_match",
            "group_size": 8,
            "groups_per_step": 2,
            "max_dropped_groups_per_step": 2,
            "max_completion_tokens": 3,
            "overlong_buffer_tokens": 1,
            "overlong_penalty_factor": 0.0,
            # AdamW's first steps move every weight by about the LR whatever the gradient:
            # at 0.005 one success in 16 rollouts broke the answer format of some
            # pretrained models (the reward then stayed 0); 0.002 learned from both tried.
            "learning_rate": 0.002,
            # Every rollout from the learner's current version: with the fixed seeds the
            # reward curve does not depend on timing.
            "max_staleness": 0,
            "rollout_workers": 1,
            "gate": {"metric": "reward_gain", "min": 0.1},
        },
    }


def write_manifest(
    path: Path,
    baseline: Path,
    custom: Path,
    ckpt_dir: Path,
    post_training: dict[str, Any] | None = None,
) -> None:
    from stages.data_prep import file_sha256

    def ref(p: Path, role: str, source: str, lic: str) -> dict[str, Any]:
        return {
            "uri": f"file://{p}",
            "sha256": file_sha256(p),
            "role": role,
            "format": "jsonl",
            "text_field": "text",
            "provenance": {"source": source, "license": lic, "decontaminated_against": []},
        }

    manifest = {
        "manifest_version": 1,
        "name": "demo-llama-tiny",
        "model": {
            "preset": "llama-tiny",
            "architecture": "llama",
            "size": "124K",
            "revision": "random-init",
        },
        "data": {
            "refs": [
                ref(baseline, "baseline", "CPython 3.11 stdlib docstrings", "PSF-2.0"),
                ref(custom, "custom", "GSM8K train (demo extract)", "MIT"),
            ],
            "eval_suites": ["gsm8k"],
            # Sized to the run it gates: four proxies of 59 steps at the run's first
            # context (64 bytes; params x tokens together ~2% of the run's pretraining),
            # each scored on 256 eval windows (both arms on the same ones). Fewer steps
            # leave the proxies on their early plateau, where seeds spread more than the
            # arms differ (no_decision); shorter windows and fewer eval bytes do not.
            "ladder_probe": {
                "enabled": True,
                "seeds": 2,
                "token_budget": DEMO_PROBE_TOKENS,
                "seq_len": 64,
                "eval_bytes": 16384,
            },
        },
        # ~1.6M tokens: the run's training outweighs what any run pays once (data prep
        # with the probe's four proxies, the actors' start-up, the gates and
        # hand-overs), as a booked run's does.
        "training": {
            "max_steps": 200,
            "seq_len": 64,
            "global_batch_tokens": 8192,
            "learning_rate": 0.003,
            "warmup_steps": 5,
            "seed": 0,
        },
        # Two phases, each closed by the smoke battery (held-out loss and bits per byte,
        # GSM8K-style exact match and multiple choice through lm-eval) and its gate.
        "curriculum": {
            "phases": [
                {
                    "name": "pretrain",
                    "kind": "pretrain",
                    "token_fraction": 0.5,
                    "seq_len": 64,
                    "eval_battery": "smoke",
                    "gates": [
                        {"metric": "heldout_loss", "max": 6.0},
                        {"metric": "heldout_bits_per_byte", "max": 9.0},
                        {"metric": "arith_mc_acc", "min": 0.0},
                    ],
                },
                {
                    "name": "long_context",
                    "kind": "long_context",
                    "token_fraction": 0.5,
                    "seq_len": 128,
                    "eval_battery": "smoke",
                    "gates": [
                        {"metric": "heldout_loss", "max": 6.0, "max_regression": 0.5},
                        {"metric": "heldout_bits_per_byte", "max": 9.0},
                        {"metric": "gsm8k_exact_match", "min": 0.0},
                    ],
                },
            ]
        },
        "post_training": post_training or {},
        "budget": {"ceiling_usd": 5.0, "max_incremental_cost_usd": 5.0},
        "checkpoint": {"interval_steps": 20, "keep": 2, "storage_uri": f"file://{ckpt_dir}"},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=2)
