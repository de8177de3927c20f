"""Oracle tests: the engine's SFT and DPO objectives against trl.

On the same rows, the same batch and the same weights (the tiny random policy of
conftest.py, its locally trained tokenizer), the objective's loss *and gradients*
through the engine's own path (``ParallelModel.forward_backward``) equal trl's
``SFTTrainer.compute_loss`` (``assistant_only_loss=True``) and ``DPOTrainer.compute_loss``
(sigmoid, ``precompute_ref_log_probs=True``), and trl's tokenization equals ours
row by row.

Tolerance: both sides are fp32 on CPU and compute the same sums in a different order
(trl's fused LM head projects tiles of the masked positions; the engine's loss is a
cross-entropy over the full logits divided by the whole batch's count). The
differences are a few float32 roundings of O(1) values (eps ~1.2e-7) accumulated over
~10^2 terms, so 1e-5 relative is ~10x above them and far below any real mistake: a
wrong mask, beta or denominator changes the loss by percents (checked below, so each
test can fail). A gradient entry is a sum of ~10^3 products with cancellation (the
head is tied to the embedding), so its error is bounded against the largest gradient
entry, 1e-4 of it (measured: DPO at most 2.4e-5 of it, SFT below 1e-5); a wrong beta or
denominator scales gradients by a factor, 10^4 times more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.evals.objective_eval import read_rows
from stages.post_training.hf_io import load_model, load_tokenizer
from stages.post_training.objectives import (
    DPOObjective,
    SFTObjective,
    _pairs_flat,
    sequence_logps,
)
from stages.trainer.parallel.layout import ParallelLayout
from stages.trainer.parallel.parallelize import ParallelModel

RTOL = 1e-5
GRAD_ATOL = 1e-4  # of the largest gradient entry
BATCH = 4
MAX_LENGTH = 64


def _trl_args(out: Path) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": BATCH,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        "max_length": MAX_LENGTH,
    }


def _engine(policy: Path, grad_accum: int = 1) -> ParallelModel:
    model = load_model(policy)
    model.train()
    layout = ParallelLayout(grad_accum=grad_accum).resolved(1)
    return ParallelModel(model, layout, None, torch.device("cpu"))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == ref.keys() and ours
    scale = max(float(g.abs().max()) for g in ref.values())
    assert scale > 0
    for name, g in ref.items():
        try:
            torch.testing.assert_close(ours[name], g, rtol=RTOL, atol=GRAD_ATOL * scale)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def _sft_rows(task_files: dict[str, Path]) -> list[dict[str, Any]]:
    rows = read_rows(task_files["sft"])
    # Multi-turn and system turns: only the assistant turns are targets.
    rows.append(
        {
            "messages": [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "Say 3."},
                {"role": "assistant", "content": "3"},
                {"role": "user", "content": "Say 4 twice."},
                {"role": "assistant", "content": "4 4"},
            ]
        }
    )
    return rows


def test_sft_loss_and_gradients_equal_trl(
    tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path
) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = _sft_rows(task_files)
    tok = load_tokenizer(tiny_policy)
    trainer = SFTTrainer(
        model=load_model(tiny_policy),
        args=SFTConfig(**_trl_args(tmp_path / "sft"), assistant_only_loss=True),
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    obj = SFTObjective(
        rows, tok, max_length=MAX_LENGTH, batch_size=BATCH, dp_rank=0, dp_world=1, seed=0
    )
    # The same tokens and targets for every row as trl's prepared dataset.
    ds: Any = trainer.train_dataset
    assert len(ds) == len(obj.examples) == len(rows)
    for i, ex in enumerate(obj.examples):
        assert ds[i]["input_ids"] == ex["input_ids"]
        assert ds[i]["labels"] == ex["labels"]
    multi = obj.examples[-1]["labels"]
    assert 0 < sum(t != -100 for t in multi) < len(multi)  # the mask masks something

    # One step's batch (it includes the multi-turn row), through trl and the engine.
    index = next(i for i in range(10) if len(rows) - 1 in obj.rows.rank_rows(i))
    mine = obj.rows.rank_rows(index)
    inputs = trainer.data_collator([ds[i] for i in mine])
    model: Any = trainer.model
    model.train()
    count = (inputs["labels"][:, 1:] != -100).sum()
    ref_loss = trainer.compute_loss(model, dict(inputs), num_items_in_batch=count)
    ref_loss.backward()
    ref_grads = _grads(model)

    for accum in (1, 2):  # micro-batches: the same loss and gradients as one pass
        pm = _engine(tiny_policy, grad_accum=accum)
        loss = pm.forward_backward(obj.batch(index), obj)
        assert float(loss) == pytest.approx(float(ref_loss), rel=RTOL)
        _assert_grads_close(_grads(pm.module), ref_grads)

    # Could fail: training on every token (no assistant mask) is another loss.
    unmasked = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    with torch.no_grad():
        logits = _engine(tiny_policy).forward_logits(
            {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        )
    everything = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), unmasked[:, 1:].reshape(-1), ignore_index=-100
    )
    assert abs(float(everything) - float(ref_loss)) > 100 * RTOL * float(ref_loss)


def _perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """The same small weight change on each copy: the policy moves off the reference,
    so the DPO loss depends on beta and on the reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _dpo_rows(task_files: dict[str, Path]) -> list[dict[str, Any]]:
    rows = read_rows(task_files["dpo"])
    # Completions of different lengths: padding and per-sequence sums matter.
    rows.append(
        {
            "prompt": [{"role": "user", "content": "Say 12."}],
            "chosen": [{"role": "assistant", "content": "12"}],
            "rejected": [{"role": "assistant", "content": "twelve or so, maybe 21"}],
        }
    )
    return rows


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_and_gradients_equal_trl(
    tiny_policy: Path, task_files: dict[str, Path], tmp_path: Path, beta: float
) -> None:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = _dpo_rows(task_files)
    tok = load_tokenizer(tiny_policy)
    trainer = DPOTrainer(
        model=load_model(tiny_policy),
        args=DPOConfig(
            **_trl_args(tmp_path / "dpo"),
            beta=beta,
            precompute_ref_log_probs=True,
            precompute_ref_batch_size=BATCH,  # the same padded chunks as ours
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    pm = _engine(tiny_policy)
    obj = DPOObjective(
        rows, tok, beta=beta, max_length=MAX_LENGTH, batch_size=BATCH, dp_rank=0, dp_world=1, seed=0
    )
    obj.precompute_reference(pm.forward_logits, chunk=BATCH, device=torch.device("cpu"))
    assert obj.ref_logps is not None
    ds: Any = trainer.train_dataset
    for i, ex in enumerate(obj.examples):
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert ds[i][key] == ex[key], (i, key)
    # Reference log-probs: ours equal a float64 forward of the base weights to fp32
    # rounding; trl's precomputed ones are off by up to ~8e-5 relative (measured: its
    # fused-head precompute pass; its policy pass matches ours to 1e-6), so they are
    # checked at 2e-4 and the loss below is compared on one set of references (ours).
    ref_trl = torch.tensor(
        [[ds[i]["ref_chosen_logps"], ds[i]["ref_rejected_logps"]] for i in range(len(ds))]
    )
    torch.testing.assert_close(obj.ref_logps, ref_trl, rtol=2e-4, atol=0)
    exact = load_model(tiny_policy).double()
    t = obj._tensors(list(range(len(obj.examples))))
    with torch.no_grad():
        logits64 = exact(**obj.model_inputs(t)).logits
    ref64 = torch.stack(sequence_logps(logits64, _pairs_flat(t["labels"])).chunk(2), dim=1)
    torch.testing.assert_close(obj.ref_logps, ref64, rtol=RTOL, atol=0)

    model: Any = trainer.model
    _perturb(model)
    _perturb(pm.module)
    index = next(i for i in range(10) if len(rows) - 1 in obj.rows.rank_rows(i))
    mine = obj.rows.rank_rows(index)
    model.train()
    inputs = trainer.data_collator([ds[i] for i in mine])
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = obj.ref_logps[mine].unbind(1)
    ref_loss = trainer.compute_loss(model, dict(inputs))
    ref_loss.backward()
    loss = pm.forward_backward(obj.batch(index), obj)
    assert float(loss) == pytest.approx(float(ref_loss), rel=RTOL)
    _assert_grads_close(_grads(pm.module), _grads(model))

    # Could fail: another beta, or a reference of the perturbed weights, is another loss.
    batch = obj.batch(index)
    with torch.no_grad():
        logits = pm.forward_logits(obj.model_inputs(batch.tensors))
    other = DPOObjective.__new__(DPOObjective)
    other.beta = 2 * beta
    wrong_beta = float(other.loss_sum(logits, batch.tensors)) / len(mine)
    assert abs(wrong_beta - float(ref_loss)) > 100 * RTOL * float(ref_loss)
    no_ref = dict(batch.tensors, ref_logps=torch.zeros_like(batch.tensors["ref_logps"]))
    assert abs(float(obj.loss_sum(logits, no_ref)) / len(mine) - float(ref_loss)) > 1e-3


def test_step_rows_are_a_function_of_the_step(tmp_path: Path) -> None:
    """Step i's rows on rank r never depend on what was served before; ranks split the
    global batch disjointly; an epoch visits every row once."""
    from stages.post_training.objectives import StepRows

    a = [StepRows(10, 4, r, 2, seed=3) for r in range(2)]
    b = StepRows(10, 4, 1, 2, seed=3)
    assert b.rank_rows(7) == a[1].rank_rows(7)  # b asked for step 7 first
    for i in range(5):
        both = a[0].rank_rows(i) + a[1].rank_rows(i)
        assert both == a[0].global_rows(i) and len(set(both)) == 4
    first_epoch = [r for i in range(5) for r in a[0].global_rows(i)][:10]
    assert sorted(first_epoch) == list(range(10))
    assert StepRows(10, 4, 0, 1, seed=4).global_rows(0) != a[0].global_rows(0)
    json.dumps(first_epoch)  # plain ints (they index rows)
