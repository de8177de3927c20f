"""TP (with and without sequence parallel), PP (GPipe, 1F1B, Interleaved1F1B, uneven
split), TP x FSDP2, PP x FSDP2 and PP x TP on gloo, each against one process training
the same batches; under TP the lm loss runs on vocab-sharded logits (loss parallel)
and another objective's on gathered ones; a DCP checkpoint saved under TP2 loads
under TP1 and PP2 with the same logits.

Real processes (one per rank, ``tests/trainer/parallel_cases.py``), real gloo, real
DTensor / FSDP2 / torch.distributed.pipelining, fp32, a 3-layer Llama.

Tolerances. Losses: every layout computes the same fp32 math with sums in a
different order (row-wise TP partial sums all-reduced, FSDP reduce-scatters, the
pipeline's micro-batch means), worth ~1e-7 relative per reduction; 1e-5 relative
leaves room for three steps and is still far below any real bug (a wrong shard, a
dropped micro-batch or a double-counted gradient moves the loss by >1e-3).
Weights: AdamW divides each update by sqrt(v), so an element whose gradient is
near zero takes a step of up to ``lr`` from rounding noise alone; the bound is 5%
of one step's ``lr`` per element, and the test checks that training moved the
weights by more than ten times that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.xdist_groups import module_group

from tests.trainer.parallel_cases import (
    CASES,
    LR,
    PRESET,
    SEQ_LEN,
    SEQS,
    STEPS,
    TIED_PRESET,
    batches,
    eval_ids,
    launch,
    make_optimizer,
)

# Above pytest's 300 s default: ranks may take parallel_cases.RANK_TIMEOUT_S.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), module_group(__name__)]

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 0.05 * LR
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    two = ["tp2", "tp2_sp", "tp2_tied", "tp2_gathered", "pp2_gpipe", "pp2_1f1b"]
    launch(2, [*two, "pp2_interleaved", "pp2_load", "mesh_handoff"], out)
    launch(4, ["tp2_fsdp2", "pp2_fsdp2", "pp2_tp2"], out)
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One process, the whole batch, the trainer's loss, clip and AdamW."""
    return _one_process(PRESET)


@pytest.fixture(scope="module")
def tied_reference() -> dict[str, Any]:
    return _one_process(TIED_PRESET)


def _one_process(preset: Any) -> dict[str, Any]:
    from stages.model.lm import build_model, causal_lm_loss

    model = build_model(preset, seed=0)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model.parameters())
    losses = []
    for ids in batches():
        loss = causal_lm_loss(model, ids)
        loss.backward()
        losses.append(float(loss))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=eval_ids()).logits
    return {
        "losses": losses,
        "weights": dict(model.state_dict()),
        "initial": initial,
        "logits": logits,
        "model": model,
    }


def _results(out: Path, case: str) -> list[dict[str, Any]]:
    files = sorted(out.glob(f"{case}-rank*.pt"))
    assert files, f"no results for {case}"
    return [torch.load(f, weights_only=False) for f in files]


@pytest.mark.parametrize(
    "case",
    [
        "tp2",
        "tp2_sp",
        "tp2_tied",
        "tp2_gathered",
        "pp2_gpipe",
        "pp2_1f1b",
        "pp2_interleaved",
        "tp2_fsdp2",
        "pp2_fsdp2",
        "pp2_tp2",
    ],
)
def test_layout_trains_like_one_process(
    runs: Path, reference: dict[str, Any], tied_reference: dict[str, Any], case: str
) -> None:
    if case.endswith("_tied"):  # one parameter for embedding and head, on every rank too
        reference = tied_reference
    ranks = _results(runs, case)
    for r in ranks:  # every rank reports the group's loss
        assert r["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    weights: dict[str, torch.Tensor] = {}
    for r in ranks:
        weights.update(r["weights"])
    assert set(weights) == set(reference["weights"]), "a parameter is held by no rank"
    moved = max(
        (reference["weights"][k] - reference["initial"][k]).abs().max().item() for k in weights
    )
    assert moved > 10 * WEIGHT_ATOL
    for name, w in weights.items():
        diff = (w - reference["weights"][name]).abs().flatten()
        # AdamW normalises each element's update, so an element whose gradient is at
        # rounding level (seen: 6e-10 against a median of 5e-3) can move up to a whole
        # step either way under another summation order. A layout bug (a wrong shard,
        # a missing reduction) moves most elements: all but 0.1% must agree closely,
        # and none by more than the steps could move it.
        bulk = diff.quantile(0.999).item() if diff.numel() > 1 else diff.max().item()
        assert bulk <= WEIGHT_ATOL, f"{case}: {name} differs by {bulk:.2e} (99.9th pct)"
        assert diff.max().item() <= STEPS * LR, f"{case}: {name} differs by {diff.max():.2e}"


def test_built_layout_is_read_back_from_the_mesh_and_equals_the_plan(runs: Path) -> None:
    from stages.trainer.parallel.layout import ParallelLayout

    for case, world in [
        ("tp2", 2),
        ("tp2_sp", 2),
        ("pp2_gpipe", 2),
        ("pp2_1f1b", 2),
        ("pp2_interleaved", 2),
        ("tp2_gathered", 2),
        ("tp2_fsdp2", 4),
        ("pp2_fsdp2", 4),
        ("pp2_tp2", 4),
    ]:
        plan = ParallelLayout(**CASES[case]).resolved(world)
        for r in _results(runs, case):
            built = r["layout"]
            assert {k: built[k] for k in ("pp", "dp_shard", "cp", "tp")} == plan.degrees()
            if plan.pp > 1:
                assert built["pp_schedule"] == plan.pp_schedule
                assert built["pp_microbatches"] == plan.pp_microbatches
                assert built["pp_stage_layers"] == (
                    plan.pp_stage_layers or plan.stage_layers(PRESET.num_hidden_layers)
                )
            assert built["precision"] == "fp32"
            assert built["sequence_parallel"] == case.endswith("_sp")


@pytest.mark.parametrize("case", ["tp2", "tp2_sp", "tp2_tied", "tp2_fsdp2"])
def test_the_lm_loss_under_tp_takes_vocab_sharded_logits(runs: Path, case: str) -> None:
    """Loss parallel: the head leaves each TP rank its vocab/tp columns of the logits
    (no all-gather of batch x seq x vocab), and the loss (compared with one process
    above) is computed on them."""
    for r in _results(runs, case):
        assert r["loss_input"] == {
            "dtensor": True,
            "placements": ["S(2)"],
            "local_shape": [
                SEQS // CASES[case].get("dp_shard", 1),
                SEQ_LEN,
                PRESET.vocab_size // 2,
            ],
        }


def test_the_plain_lm_loss_gathers_a_tp_models_logits(
    runs: Path, reference: dict[str, Any]
) -> None:
    # causal_lm_loss (the rank's warm-up) on the laid-out model, after training
    from stages.model.lm import causal_lm_loss

    with torch.no_grad():
        expected = float(causal_lm_loss(reference["model"], eval_ids()))
    for r in _results(runs, "tp2"):
        assert r["causal_lm_loss"] == pytest.approx(expected, rel=LOSS_RTOL)


def test_an_objective_outside_loss_parallel_gets_whole_rows_of_logits(runs: Path) -> None:
    for r in _results(runs, "tp2_gathered"):
        assert r["loss_input"] == {
            "dtensor": False,
            "placements": [],
            "local_shape": [SEQS, SEQ_LEN, PRESET.vocab_size],
        }


def test_checkpoint_saved_under_tp2_loads_under_tp1_and_pp2_with_the_same_logits(
    runs: Path, reference: dict[str, Any]
) -> None:
    from stages.checkpointing.checkpointer import Checkpointer
    from stages.model.lm import build_model
    from stages.trainer.rank.train_state import TrainState
    from tests.trainer.parallel_cases import ckpt_policy

    saved = _results(runs, "tp2")[0]["logits"]
    model = build_model(PRESET, seed=7)  # other weights, overwritten by the load
    with Checkpointer(ckpt_policy(runs / "ckpt-tp2")) as ck:
        rec = ck.latest()
        assert rec is not None
        ck.load(rec, TrainState(model, make_optimizer(model.parameters())))
    with torch.no_grad():
        tp1 = model(input_ids=eval_ids()).logits
    pp2 = [r["logits"] for r in _results(runs, "pp2_load")]
    assert pp2[0] is None and pp2[1] is not None  # logits live on the last stage
    assert (saved - reference["logits"]).abs().max() <= LOGIT_ATOL
    assert (tp1 - saved).abs().max() <= LOGIT_ATOL
    assert (pp2[1] - saved).abs().max() <= LOGIT_ATOL
    fresh = build_model(PRESET, seed=7)
    with torch.no_grad():  # the load really replaced the weights
        assert (fresh(input_ids=eval_ids()).logits - saved).abs().max() > 0.01


def test_a_handed_on_rank_keeps_its_mesh_or_replaces_it_never_piles_them_up(
    runs: Path,
) -> None:
    """pp=2 then dp_shard=2 on the same two processes (pretraining's layout, then
    post-training's, stages.trainer.rank.setup.group_mesh): the same layout again reuses the
    mesh and DCP group; a new one destroys them first (no more process groups than
    before), and its groups carry collectives."""
    for rank in (0, 1):
        got = torch.load(runs / f"mesh_handoff-rank{rank}.pt")
        assert got["reused"] is True
        assert got["counts"][0] == got["counts"][1] >= got["counts"][2], got
        assert got["sum"] == 2.0
