"""The driver's side of a loss spike, without Ray: a rank's typed spike report becomes
one proposal (its restart skips the batches the detector names), and the human's
decision goes to every rank."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from stages.events import Event, ProposalEvent
from stages.trainer.config import TrainStageConfig
from stages.trainer.fleet import spike_relay
from stages.trainer.fleet.spike_relay import LossSpikeRelay
from stages.trainer.fleet.supervision import GroupState
from stages.trainer.rank.control import CommandName, CommandParams
from stages.trainer.rank.loss_spike import ReportedSpike
from stages.trainer.rank.rank_state import RankReport, RankState


@dataclass
class _Checkpoint:
    step: int


class _Host:
    """Stands in for the engine: every group is paused, commands are recorded."""

    def __init__(self) -> None:
        self.groups = {0: GroupState(0, paused=True), 1: GroupState(1, paused=True)}
        self.sent: list[tuple[CommandName, CommandParams | None]] = []

    def poll_once(self, timeout_s: float) -> None:
        pass

    def command_all(self, kind: CommandName, params: CommandParams | None = None) -> None:
        self.sent.append((kind, params))


def _relay(tmp_path: Path, decision: str, emitted: list[Event]) -> LossSpikeRelay:
    cfg = TrainStageConfig.model_validate(
        {
            "model": {"preset": "llama-tiny", "size": "0.1M"},
            "target": {"max_steps": 40, "seq_len": 32, "global_batch_tokens": 256},
            "checkpoint": {"interval_steps": 5, "storage_uri": "file:///tmp/x"},
            "loss_spike": {"skip_window_steps": 4},
        },
        strict=False,
    )
    return LossSpikeRelay(
        cfg,
        checkpoint_dir=tmp_path,
        emit=emitted.append,
        wait_decision=lambda _proposal, _timeout: decision,
        cancel_event=threading.Event(),
    )


def _paused(step: int, loss: float) -> RankReport:
    spike = ReportedSpike(
        step=step,
        loss=loss,
        z=math.inf if not math.isfinite(loss) else 9.0,
        median=2.0,
        mad=math.nan if not math.isfinite(loss) else 0.1,
        non_finite=not math.isfinite(loss),
        batch=step - 1,
        windows=[(3, 5)],
    )
    return RankReport(pid=1, state=RankState.paused, spike=spike, paused_at=step)


@pytest.mark.parametrize("loss", [40.0, math.inf])
def test_an_approved_spike_restores_the_checkpoint_before_it_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loss: float
) -> None:
    monkeypatch.setattr(
        spike_relay, "list_checkpoints", lambda _d: [_Checkpoint(10), _Checkpoint(20)]
    )
    emitted: list[Event] = []
    relay, host = _relay(tmp_path, "approved", emitted), _Host()
    relay.reported(_paused(20, loss), group=1, now=123.0)
    # The other group's report of the same spike is not relayed twice.
    relay.reported(_paused(20, loss), group=0, now=124.0)
    assert relay.pending is not None and relay.pending.group == 1
    relay.relay(host)
    [proposal] = [e for e in emitted if isinstance(e, ProposalEvent)]
    # From checkpoint 10 (20 holds the spike's update), skipping steps 11..20.
    assert proposal.params["from_step"] == 10 and proposal.params["skip_batches"] == 10
    assert proposal.params["non_finite"] is (not math.isfinite(loss))
    assert proposal.params["loss"] == (loss if math.isfinite(loss) else None)
    assert host.sent == [("pause", None), ("restore", {"step": 10, "skip_batches": 10})]
    assert relay.pending is None
    recovered = relay.recovered()
    assert recovered is not None and recovered[0] == 123.0
    relay.reported(_paused(20, loss), group=0, now=125.0)
    assert relay.pending is None  # handled: a late poll's copy is ignored


def test_a_declined_spike_resumes_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spike_relay, "list_checkpoints", lambda _d: [_Checkpoint(10)])
    emitted: list[Event] = []
    relay, host = _relay(tmp_path, "declined", emitted), _Host()
    relay.reported(_paused(14, 40.0), group=0, now=1.0)
    relay.relay(host)
    assert host.sent == [("pause", None), ("resume", None)]
    assert relay.recovered() is None
