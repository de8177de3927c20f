"""Checkpointer with a gloo process group: 2 real ranks, async save, exact resume.

Two processes train a data-parallel bigram LM (gradients all-reduced on the
default gloo group) while the checkpoint is written on a dedicated gloo group.
Each rank has its own RNG seed and data slice, so exact resume shows that every
rank's RNG and loader position came back, not one rank's copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stages.checkpointing import list_checkpoints

RANK_TIMEOUT_S = 240.0

RANK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from stages.checkpointing import CheckpointPolicy, Checkpointer
    from stages.trainer.rank.data import TokenLoader
    from stages.trainer.rank.train_state import TrainState, set_determinism

    rank, tmp = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank,
                            world_size=2)
    ckpt_pg = dist.new_group(backend="gloo")
    shards = sorted((tmp / "shards").glob("shard_*.npy"))

    class BigramLM(torch.nn.Module):  # small and transformers-free: fast to import
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(260, 32)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                           torch.nn.Linear(64, 260))

        def forward(self, ids):
            return self.mlp(self.emb(ids))

    def causal_lm_loss(model, batch, labels):
        logits = model(batch)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 260), labels[:, 1:].reshape(-1),
                               ignore_index=-100)

    def make(seed):
        torch.manual_seed(seed)
        model = BigramLM()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = TokenLoader(shards, seq_len=32, micro_batch=2, seed=5, dp_rank=rank,
                             dp_world=2)
        return TrainState(model, opt, loader=loader, rank=rank)

    def train(state, steps):
        losses = []
        for _ in range(steps):
            batch = state.loader.next_batch()
            labels = batch.clone()
            labels[torch.rand(labels.shape) < 0.2] = -100
            loss = causal_lm_loss(state.model, batch, labels)
            loss.backward()
            for p in state.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= 2
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.step += 1
            losses.append(loss.item())
        return losses

    policy = CheckpointPolicy(storage_uri=f"file://{tmp / 'ckpt'}", interval_steps=2, keep=2)
    set_determinism(100 + rank)
    state = make(seed=7)
    ck = Checkpointer(policy, process_group=ckpt_pg, run_label="dist")
    train(state, 2)
    assert ck.due(2)
    ck.save(2, state)
    expected = train(state, 3)  # trains on while the save is written
    record = ck.wait()
    ck.close()
    dist.barrier()

    set_determinism(999)
    resumed = make(seed=8)
    ck = Checkpointer(policy, process_group=ckpt_pg, run_label="dist")
    latest = ck.latest()
    ck.load(latest, resumed)
    got = train(resumed, 3)
    ck.close()
    out = {"expected": expected, "got": got, "step": resumed.step,
           "record": record.model_dump() if record else None}
    (tmp / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_gloo_ranks_save_async_and_resume_exactly(tmp_path: Path) -> None:
    from stages.model.tokenizer import ByteTokenizer
    from stages.trainer.rank.data import build_token_shards

    src = tmp_path / "corpus.txt"
    src.write_text("".join(f"rank-aware record {i} {i * 13 % 29}\n" for i in range(300)))
    build_token_shards([src], tmp_path / "shards", tokenizer=ByteTokenizer(), shard_tokens=2048)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=RANK_TIMEOUT_S)
            outputs.append(out.decode()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["step"] == 5
        assert res["got"] == res["expected"], f"rank {r}"
    assert results[0]["expected"] != results[1]["expected"]  # different data and RNG
    # Group rank 0 commits and reports; rank 1 gets no record.
    assert results[0]["record"]["step"] == 2 and results[1]["record"] is None
    records = list_checkpoints(tmp_path / "ckpt")
    assert [r.step for r in records] == [2]
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".tmp-")]
