"""One rank of the multi-process parallelism tests (run as a subprocess per rank).

``python -m tests.trainer.parallel_cases RANK WORLD INIT_FILE OUT_DIR CASE [CASE...]``
trains each case's layout for ``STEPS`` steps on gloo, writing per rank the group's
losses, the full (gathered) weights after the last optimizer step and, for some
cases, logits; the test compares them with one process training the same batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from stages.presets import ModelPreset
from stages.trainer.parallel.layout import ParallelLayout
from stages.trainer.rank.objective import LanguageModelObjective, Tensors, token_nll_sum

REPO = Path(__file__).resolve().parents[2]
RANK_TIMEOUT_S = 300
STEPS = 3
LR = 1e-3
SEQS, SEQ_LEN = 4, 16
# 4 decoder layers: PP2 splits them unevenly (3 + 1, 1 + 3), or in 4 interleaved chunks.
PRESET = ModelPreset(
    name="pp-probe",
    vocab_size=260,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# PRESET with its head tied to the embedding (tie_word_embeddings, as Llama 3.2 1B/3B).
TIED_PRESET = PRESET.model_copy(update={"name": "pp-probe-tied", "tie_word_embeddings": True})

# Memory probes: big enough that activations, weights and AdamW state all count.
MEM_PRESET = ModelPreset(
    name="mem-probe",
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
MEM_SEQS, MEM_SEQ_LEN = 4, 128
MEM_CASES: dict[str, dict[str, Any]] = {
    "mem_tp2": {"tp": 2},
    "mem_pp2": {"pp": 2, "pp_schedule": "1F1B", "pp_microbatches": 4, "pp_stage_layers": [2, 2]},
    "mem_pp2_gpipe": {
        "pp": 2,
        "pp_schedule": "GPipe",
        "pp_microbatches": 4,
        "pp_stage_layers": [2, 2],
    },
}

CASES: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2},
    "pp2_gpipe": {"pp": 2, "pp_schedule": "GPipe", "pp_microbatches": 4, "pp_stage_layers": [3, 1]},
    "pp2_1f1b": {"pp": 2, "pp_schedule": "1F1B", "pp_microbatches": 2, "pp_stage_layers": [3, 1]},
    "pp2_interleaved": {
        "pp": 2,
        "pp_schedule": "Interleaved1F1B",
        "pp_virtual_stages": 2,
        "pp_microbatches": 4,
    },
    "tp2_sp": {"tp": 2},  # with sequence parallel forced on (the GPU default)
    "tp2_tied": {"tp": 2},  # on TIED_PRESET: the head is the embedding's parameter
    "tp2_fsdp2": {"tp": 2, "dp_shard": 2},
    # an objective other than lm: its loss reads whole rows of logits, gathered
    "tp2_gathered": {"tp": 2},
    "pp2_fsdp2": {
        "pp": 2,
        "dp_shard": 2,
        "pp_schedule": "1F1B",
        "pp_microbatches": 2,
        "pp_stage_layers": [1, 3],
    },
    # the last stage's head vocab-sharded over TP, its loss under loss_parallel()
    "pp2_tp2": {"pp": 2, "tp": 2, "pp_schedule": "1F1B", "pp_microbatches": 2},
    # load the checkpoint the tp2 case saved, under PP2, and compute logits
    "pp2_load": {"pp": 2, "pp_schedule": "1F1B", "pp_microbatches": 2, "pp_stage_layers": [3, 1]},
}


class GatheredRowsObjective(LanguageModelObjective):
    """The lm loss under another objective's name (as SFT's, DPO's and GRPO's, which
    are not in ``LOSS_PARALLEL_OBJECTIVES``): records the logits its loss is given."""

    name = "gathered-rows"

    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[dict[str, Any]] = []

    def loss_sum(self, logits: torch.Tensor, part: Tensors) -> torch.Tensor:
        self.seen.append(head_output(logits))
        return token_nll_sum(logits, part["labels"])


def head_output(logits: torch.Tensor) -> dict[str, Any]:
    """What a rank's head hands the loss: a DTensor's placements and local shape."""
    from torch.distributed.tensor import DTensor

    dtensor = isinstance(logits, DTensor)
    return {
        "dtensor": dtensor,
        "placements": [str(p) for p in logits.placements] if dtensor else [],
        "local_shape": list((logits.to_local() if dtensor else logits).shape),
    }


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, PRESET.vocab_size, (SEQS, SEQ_LEN), generator=g) for _ in range(STEPS)]


def eval_ids() -> torch.Tensor:
    return torch.randint(
        0, PRESET.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(99)
    )


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    # The trainer's AdamW (loop.py); foreach off as on the CPU trainer path.
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in module.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name.replace("._checkpoint_wrapped_module", "")] = full.detach().clone()
    return out


def ckpt_policy(directory: Path) -> Any:
    from stages.checkpointing.config import CheckpointPolicy

    return CheckpointPolicy(interval_steps=1, keep=2, storage_uri=f"file://{directory}")


def mesh_handoff_case(rank: int, world: int, out: Path) -> None:
    """A rank handed on from a pp=2 run to a dp_shard=2 run (pretraining's layout, then
    post-training's): the same shape reuses its mesh and DCP group, another destroys
    them before it builds its own, and the new ones carry collectives."""
    import torch.distributed as dist

    from stages.trainer.parallel.mesh import FSDP_DIM
    from stages.trainer.rank.setup import group_mesh, process_groups

    pp2 = ParallelLayout(**CASES["pp2_1f1b"]).resolved(world)
    mesh, ckpt_pg = group_mesh(pp2, "cpu")
    counts = [process_groups()]
    again = group_mesh(pp2, "cpu")
    counts.append(process_groups())
    fsdp, fsdp_ckpt_pg = group_mesh(ParallelLayout(dp_shard=2).resolved(world), "cpu")
    counts.append(process_groups())
    total = torch.ones(1)
    dist.all_reduce(total, group=fsdp[FSDP_DIM].get_group())
    dist.barrier(group=fsdp_ckpt_pg)
    result = {"counts": counts, "reused": again == (mesh, ckpt_pg), "sum": float(total)}
    torch.save(result, out / f"mesh_handoff-rank{rank}.pt")


def run_case(name: str, rank: int, world: int, out: Path) -> None:
    import torch.distributed as dist

    from stages.checkpointing.checkpointer import Checkpointer
    from stages.model.lm import build_model, causal_lm_loss
    from stages.trainer.parallel.mesh import build_mesh
    from stages.trainer.parallel.parallelize import ParallelModel
    from stages.trainer.rank.train_state import TrainState

    if name in MEM_CASES:
        measure_case(name, rank, world, out)
        return
    if name == "mesh_handoff":
        mesh_handoff_case(rank, world, out)
        return
    layout = ParallelLayout(**CASES[name]).resolved(world)
    mesh = build_mesh(layout, "cpu")
    seed = 7 if name.endswith("_load") else 0  # a load must overwrite other weights
    pm = ParallelModel(
        build_model(TIED_PRESET if name.endswith("_tied") else PRESET, seed=seed),
        layout,
        mesh,
        torch.device("cpu"),
        sequence_parallel=name.endswith("_sp"),
    )
    opt = make_optimizer(pm.module.parameters())
    ckpt_pg = dist.new_group(backend="gloo")
    result: dict[str, Any] = {"layout": pm.built_layout()}
    if name.endswith("_load"):
        with Checkpointer(ckpt_policy(out / "ckpt-tp2"), process_group=ckpt_pg) as ck:
            rec = ck.latest()
            assert rec is not None
            ck.load(rec, TrainState(pm.module, opt, rank=rank))
        result["logits"] = pm.logits(eval_ids())
        torch.save(result, out / f"{name}-rank{rank}.pt")
        return
    dp = layout.dp_shard
    d = pm.coords["dp_shard"]
    losses = []
    objective = (
        GatheredRowsObjective() if name.endswith("_gathered") else LanguageModelObjective(None)
    )
    heads: list[dict[str, Any]] = []
    if pm.schedule is None:
        pm.module.get_submodule("lm_head").register_forward_hook(
            lambda _m, _i, out: heads.append(head_output(out))
        )
    for ids in batches():
        local = ids.chunk(dp)[d]
        loss = pm.forward_backward(LanguageModelObjective.batch_of(local), objective)
        losses.append(float(pm.group_mean_loss(loss)))
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    result["losses"] = losses
    result["weights"] = full_weights(pm.module)
    if isinstance(objective, GatheredRowsObjective):
        result["loss_input"] = objective.seen[0]
    elif heads:  # the logits the lm loss takes: the head's own output
        result["loss_input"] = heads[0]
    if name == "tp2":
        result["logits"] = pm.logits(eval_ids())
        # the one-off warm-up's loss (RankSetup.warm_up) on the laid-out model
        result["causal_lm_loss"] = float(causal_lm_loss(pm.module, eval_ids()))
        with Checkpointer(ckpt_policy(out / "ckpt-tp2"), process_group=ckpt_pg) as ck:
            ck.save(STEPS, TrainState(pm.module, opt, rank=rank))
            ck.wait()
    torch.save(result, out / f"{name}-rank{rank}.pt")
    dist.barrier()


def measure_case(name: str, rank: int, world: int, out: Path) -> None:
    """Peak tensor bytes of one training step on this rank (profiler, exact)."""
    from stages.model.lm import build_model
    from stages.trainer.parallel.memory_measure import measure_step_peak
    from stages.trainer.parallel.mesh import build_mesh
    from stages.trainer.parallel.parallelize import ParallelModel

    layout = ParallelLayout(**MEM_CASES[name]).resolved(world)
    pm = ParallelModel(
        build_model(MEM_PRESET, seed=0), layout, build_mesh(layout, "cpu"), torch.device("cpu")
    )
    opt = torch.optim.AdamW(pm.module.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(
        0,
        MEM_PRESET.vocab_size,
        (MEM_SEQS, MEM_SEQ_LEN),
        generator=torch.Generator().manual_seed(0),
    )

    def step() -> None:
        pm.forward_backward(LanguageModelObjective.batch_of(ids), LanguageModelObjective(None))
        opt.step()

    peak = measure_step_peak(step, pm.module.parameters(), opt)
    torch.save({"peak": peak, "pp_rank": pm.coords["pp"]}, out / f"{name}-rank{rank}.pt")


def launch(world: int, cases: list[str], out: Path) -> None:
    """Run ``cases`` in ``world`` rank processes (gloo, file init); fail on any error."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.trainer.parallel_cases",
                str(r),
                str(world),
                str(out / f"init-{world}"),
                str(out),
                *cases,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append((p.returncode, stdout.decode(errors="replace")[-3000:]))
    for rc, log in logs:
        assert rc == 0, log


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    rank, world, init, out = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        for name in argv[4:]:
            run_case(name, rank, world, out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
