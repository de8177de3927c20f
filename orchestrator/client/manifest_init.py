"""``ito manifest init``: the short form of a run, written out as a complete manifest.

Tenants describe a run as ``--booking B --model-size 8B --data REF --target CAPABILITY
--budget-usd N [--post-training sft|dpo|rlvr] [--checkpoint-dir DIR]``. This writes the
full manifest those flags mean (0600, every default spelled out), reads it back with the
safe manifest reader, and asks the server for its plan and cost estimate. Checkpoints go
under ``--checkpoint-dir``, by default the account's first checkpoint root as the
server's eligibility answer names it (the server refuses storage outside those roots).
It never submits: the reviewed file is the only thing a run is made from, through
``ito confirm`` and ``ito train``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

from orchestrator.client.api import ItoClient
from orchestrator.client.envelope import Envelope, error_envelope, ok_envelope
from orchestrator.client.manifest_reader import read_manifest
from stages.atomic_write import write_bytes
from stages.checkpointing.config import DEFAULT_INTERVAL_STEPS, DEFAULT_KEEP, CheckpointPolicy
from stages.data_prep.config import DataPrepConfig, DataProvenance, DataRef
from stages.errors import ErrorCode, ItoError
from stages.post_training.config import DPOConfig, RLVRConfig, SFTConfig
from stages.presets import list_configs, load_model_preset
from stages.trainer.config import LossSpikeConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMBT])\s*$", re.IGNORECASE)
_SCALE = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
# A preset further than this factor from the asked size is not "that size".
MAX_SIZE_FACTOR = 2.0
# Capabilities named by what they are rather than by their eval suite.
CAPABILITY_SUITES = {"math": ["gsm8k"], "grade-school-math": ["gsm8k"]}
# Rewards of RLVR per eval suite (verifiable answers).
SUITE_REWARDS = {"gsm8k": "gsm8k_exact_match"}
# Optimizer steps of each post-training objective written by default (reviewed and
# edited like everything else).
DEFAULT_POST_STEPS = {"sft": 1000, "dpo": 500, "rlvr": 200}
MAX_SEQ_LEN = 4096
DEFAULT_BATTERY = "smoke"
BATCH_SEQUENCES_LARGE = 256  # >= 1B parameters
BATCH_SEQUENCES_SMALL = 8


def model_params(size: str) -> float:
    m = _SIZE.match(size)
    if not m:
        raise ItoError(
            ErrorCode.bad_request,
            f"--model-size {size!r}: a number and K, M, B or T (e.g. 8B, 150M)",
        )
    return float(m.group(1)) * _SCALE[m.group(2).lower()]


def preset_for(size: str) -> str:
    """The model preset nearest the asked size (probes of the ladder excluded)."""
    want = model_params(size)
    best, gap = None, math.inf
    for name in list_configs("models"):
        if name.startswith("llama-probe"):
            continue
        g = abs(math.log(load_model_preset(name).num_params / want))
        if g < gap:
            best, gap = name, g
    if best is None or gap > math.log(MAX_SIZE_FACTOR):
        raise ItoError(
            ErrorCode.model_preset_unknown,
            f"no model preset within {MAX_SIZE_FACTOR:g}x of {size}; known: "
            + ", ".join(list_configs("models")),
        )
    return best


def suites_for(target: str) -> list[str]:
    known = list_configs("evals")
    if target in known:
        return [target]
    if target.lower() in CAPABILITY_SUITES:
        return CAPABILITY_SUITES[target.lower()]
    raise ItoError(
        ErrorCode.eval_suite_unknown,
        f"--target {target[:64]!r}: no eval suite measures it; known: "
        + ", ".join([*known, *CAPABILITY_SUITES]),
    )


def data_ref(ref: str) -> tuple[DataRef, int]:
    """The data reference (absolute file:// URI, sha256 of the bytes) and its bytes."""
    raw = ref.removeprefix("file://")
    if "://" in raw:
        raise ItoError(
            ErrorCode.data_scheme_not_allowed,
            "--data: only local paths or file:// URIs in this build",
        )
    path = Path(raw).expanduser().resolve()
    if not path.exists():
        raise ItoError(ErrorCode.data_not_found, f"--data: no such file or folder: {path}")
    from stages.data_prep.refs import data_files, path_sha256

    files = data_files(path) if path.is_dir() else [path]
    size = sum(f.stat().st_size for f in files)
    if not size:
        raise ItoError(ErrorCode.data_empty, f"--data: {path} holds no data")
    return DataRef(
        uri=f"file://{path}",
        sha256=path_sha256(path),
        provenance=DataProvenance(
            source=f"{path} (named with ito manifest init; review before confirming)",
            license="unspecified (review before confirming)",
        ),
    ), size


def build_manifest(
    booking: str,
    size: str,
    data: str,
    target: str,
    budget_usd: float,
    post_training: str | None,
    checkpoint_dir: Path,
) -> dict[str, Any]:
    """The complete manifest of the short form; validated as the server will."""
    from orchestrator.gates.manifest import Manifest

    if not (budget_usd > 0 and math.isfinite(budget_usd)):
        raise ItoError(ErrorCode.bad_request, "--budget-usd must be a positive number")
    preset_name = preset_for(size)
    preset = load_model_preset(preset_name)
    suites = suites_for(target)
    ref, data_bytes = data_ref(data)
    # The phase's gate battery: the target's suite when it has checks, else the
    # default battery (stages.evals).
    from stages.evals.config import list_batteries

    batteries = list_batteries()
    battery = next((s for s in suites if s in batteries), DEFAULT_BATTERY)
    seq_len = min(MAX_SEQ_LEN, preset.max_position_embeddings)
    seqs = BATCH_SEQUENCES_LARGE if preset.num_params >= 1e9 else BATCH_SEQUENCES_SMALL
    batch = seq_len * seqs
    # One pass over the data; the trainer's byte tokenizer makes a byte one token.
    target_tokens = max(batch, -(-data_bytes // batch) * batch)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{booking}-{size}".strip())[:64].lstrip("-_.")
    post: dict[str, Any] = {}
    if post_training is not None:
        steps = DEFAULT_POST_STEPS[post_training]
        if post_training == "sft":
            post["sft"] = SFTConfig(data=ref, steps=steps).model_dump()
        elif post_training == "dpo":
            post["dpo"] = DPOConfig(data=ref, steps=steps).model_dump()
        else:
            reward = next((SUITE_REWARDS[s] for s in suites if s in SUITE_REWARDS), None)
            if reward is None:
                raise ItoError(
                    ErrorCode.bad_request,
                    f"--post-training rlvr: no verifiable reward for {target!r}",
                )
            post["rlvr"] = RLVRConfig(data=ref, steps=steps, reward=reward).model_dump()
    doc: dict[str, Any] = {
        "manifest_version": 1,
        "name": name or "run",
        "model": {
            "preset": preset_name,
            "architecture": preset.architecture,
            "size": size,
            "revision": "random-init",
        },
        "data": DataPrepConfig(refs=[ref], eval_suites=suites).model_dump(),
        "training": {
            "target_tokens": target_tokens,
            "seq_len": seq_len,
            "global_batch_tokens": batch,
            "learning_rate": 3e-4,
            "warmup_steps": 10,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "seed": 0,
            "deterministic": True,
        },
        "curriculum": {
            "phases": [
                {
                    "name": "pretrain",
                    "kind": "pretrain",
                    "token_fraction": 1.0,
                    "eval_battery": battery,
                }
            ]
        },
        "post_training": post,
        "budget": {"ceiling_usd": float(budget_usd), "max_incremental_cost_usd": 0.0},
        "checkpoint": CheckpointPolicy(
            interval_steps=DEFAULT_INTERVAL_STEPS,
            keep=DEFAULT_KEEP,
            storage_uri=f"file://{checkpoint_dir / (name or 'run')}",
        ).model_dump(),
        "loss_spike": LossSpikeConfig().model_dump(),
    }
    doc = json.loads(json.dumps(doc))  # plain JSON types only
    Manifest.model_validate(doc)  # what the server checks first; fails here, not there
    return doc


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` 0600, whole or not at all (never over an existing file or
    through a symlink)."""
    try:
        write_bytes(path, data, perms=0o600, exclusive=True)
    except FileExistsError:
        raise ItoError(
            ErrorCode.bad_request,
            f"{path} exists: choose another --output (it is never overwritten)",
        ) from None
    except OSError as e:
        raise ItoError(ErrorCode.bad_request, f"cannot create {path}: {e.strerror}") from None


def _absolute(path: str) -> Path:
    return Path(os.path.normpath(Path(path).expanduser().absolute()))


def checkpoint_dir(client: ItoClient, booking: str, chosen: str | None) -> Path | Envelope:
    """``--checkpoint-dir``, else the account's first checkpoint root (from eligibility);
    an envelope when the server refused or the account has no checkpoint root."""
    if chosen:
        return _absolute(chosen)
    env = client.eligibility(booking)
    if not env.get("ok"):
        return env
    roots = (env["data"].get("roots") or {}).get("checkpoint") or []
    if not roots:
        raise ItoError(
            ErrorCode.path_outside_root,
            "this account has no checkpoint root: ask the operator for one "
            "(ito-backend accounts roots) and pass it as --checkpoint-dir",
        )
    return Path(str(roots[0]))


def run_init(client: ItoClient, args: argparse.Namespace) -> Envelope:
    output = _absolute(args.output or f"ito-manifest-{args.booking}.json")
    where = checkpoint_dir(client, args.booking, args.checkpoint_dir)
    if not isinstance(where, Path):
        return where  # nothing written
    doc = build_manifest(
        args.booking,
        args.model_size,
        args.data,
        args.target,
        args.budget_usd,
        args.post_training,
        where,
    )
    write_private(output, (json.dumps(doc, indent=2) + "\n").encode())
    mb = read_manifest(str(output))  # the bytes a later confirm/train will send
    q = shlex.quote
    data: dict[str, Any] = {
        "manifest_path": str(output),
        "manifest_digest": mb.digest,
        "booking_id": args.booking,
        "model_preset": doc["model"]["preset"],
        "eval_suites": doc["data"]["eval_suites"],
        "next": {
            "review": f"less {q(str(output))}",
            "confirm": f"ito confirm --action train --booking {q(args.booking)} "
            f"--manifest {q(str(output))}",
            "train": f"ito train --booking {q(args.booking)} --manifest {q(str(output))} "
            "--confirmation-ref <ref from confirm> --idempotency-key <new key>",
        },
    }
    plan = client.plan(args.booking, mb)
    if not plan.get("ok"):
        plan["notice"] = (
            f"manifest written to {output} (sha256 {mb.digest}); the server "
            "refused its plan: edit the file and plan it again. Nothing was "
            "submitted."
        )
        return plan
    pd = plan["data"]
    data.update(
        manifest_id=pd.get("manifest_id"),
        server_digest=pd.get("manifest_digest"),
        cost_estimate_usd=pd.get("cost_estimate_usd"),
        incremental_cost_usd=pd.get("incremental_cost_usd"),
        plan=pd.get("plan"),
        plan_refusal=pd.get("plan_refusal"),
        validation=pd.get("validation"),
    )
    if pd.get("manifest_digest") != mb.digest:  # cannot happen unless bytes changed
        return error_envelope(
            ErrorCode.manifest_digest_mismatch,
            "the server planned other bytes than the file holds",
            live_api_contacted=True,
        )
    return ok_envelope(
        data,
        notice="manifest written for review; nothing was submitted "
        "(confirm and train it with the commands under next)",
        live_api_contacted=True,
    )
