"""Every-step sync: torchft's fault-tolerant DDP over the replica groups.

Each step the quorum starts at ``zero_grad`` (async: it overlaps the forward), the
gradient buckets are averaged over the participating groups as the backward makes them
(``ft.GradientReducer``), the groups vote (``should_commit``: a group behind its peers
loads their state first) and the inner AdamW steps. One torchft step is one step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from stages.events import StepEvent
from stages.trainer.rank.ft import GradientReducer
from stages.trainer.rank.group_sync import StepHost
from stages.trainer.rank.step_state import StepResult, data_index


class EveryStepSync:
    def __init__(
        self, manager: Any, inner_optimizer: torch.optim.Optimizer, model: torch.nn.Module
    ):
        from torchft.optim import OptimizerWrapper

        self.manager = manager
        self.inner_optimizer = inner_optimizer
        # torchft: zero_grad() starts the quorum; the step votes should_commit itself
        # before the inner AdamW step (a healed group's LR is its peers' step's).
        self.optimizer = OptimizerWrapper(manager, inner_optimizer)
        self.reducer = GradientReducer(manager, model.parameters())

    def train_step(self, loop: StepHost, step: int) -> StepResult:
        """zero_grad (the quorum starts, overlapping the forward), forward/backward, the
        gradient and loss allreduce, clip, the finiteness check, the commit vote (a
        group behind its peers loads their state there) and the inner optimizer step."""
        t0 = time.time()
        self.optimizer.zero_grad()  # torchft: starts the quorum (async: overlaps forward)
        share = loop.cut(step)
        batch = data_index(step - loop.phase.start_step, loop.windows)
        data = loop.next_batch(batch)
        inj = loop.cfg.inject_loss_spike  # test knob: a poisoned data batch
        scale = inj.scale if inj is not None and batch in inj.batches else 1.0
        # torchft: the gradient buckets are reduced over the groups as the backward
        # produces them (the first waits for the quorum); a group that must heal
        # contributes zeros (its batch is not trained): the mean is the participants'.
        loss = loop.parallel.forward_backward(
            data, loop.objective, scale=scale, reducer=self.reducer
        )
        # torchft: the loss and the vote to hold at this step's end ride the last bucket.
        reduced = self.reducer.finish(
            loop.parallel.group_mean_loss(loss), vote=1.0 if loop.control.hold else 0.0
        )
        global_loss = reduced.loss
        grad_norm = loop.parallel.clip_grad_norm_(loop.cfg.target.grad_clip)
        if not (math.isfinite(global_loss) and math.isfinite(grad_norm)):
            # torchft: an error reported before the vote makes should_commit false, so
            # the update is skipped. Loss and norm are global (allreduced), so every
            # group refuses the same step.
            self.manager.report_error(
                FloatingPointError(
                    f"non-finite loss {global_loss} or grad norm {grad_norm} at step {step}"
                )
            )
        self.manager.wait_quorum()  # torchft: whether this group heals is known then
        if self.manager.is_participating():
            # torchft: refused everywhere (every participant sees the same quorum); a
            # group that heals votes on its peers' step once it loaded their state
            # (``TrainLoop.load_heal_state``), not on its own stale one.
            loop.refuse_if_members_missing(step)
        # torchft: the vote. A group behind its peers loads their state first (async
        # quorum), so the step it commits is theirs: its LR, phase and data position.
        committed = self.manager.should_commit()
        trained = self.manager.current_step() - 1 if committed else self.manager.current_step()
        rank_tokens = data.tokens
        if loop.after_heal(trained):
            share = None  # its peers' state replaced what it trained: no share of its own
            batch = data_index(trained - loop.phase.start_step, loop.windows)
            # The quorum's tokens are its peers' shares, not the stale cut it read.
            rank_tokens = loop.share_tokens(trained, data.tokens)
        lr = loop.phase.lr(trained)
        if committed:
            for g in self.inner_optimizer.param_groups:
                g["lr"] = lr
            self.inner_optimizer.step()
        quorum = self.manager.num_participants()  # torchft
        now = time.time()
        result = StepResult(
            step=trained,
            committed=committed,
            loss=global_loss,
            grad_norm=grad_norm,
            lr=lr,
            batch=batch,
            quorum=quorum,
            seconds=now - t0 - data.waited_s,
            ended_at=now,
            hold=reduced.vote > 0,
        )
        loop.emit(
            StepEvent(
                step=trained + 1 if committed else trained,
                replica_group=loop.spec.replica_group,
                loss=global_loss if math.isfinite(global_loss) else 1e9,
                tokens=rank_tokens * quorum * loop.cfg.layout.dp_shard if committed else 0,
                seconds=result.seconds,
                committed=committed,
                quorum_size=quorum,
                lr=lr,
                seq_len=data.seq_len,
                phase=loop.phase.name,
                batch_share=share if committed else None,
            )
        )
        loop.status.update(step=self.manager.current_step(), quorum=quorum)  # torchft
        loop.pace(t0, quorum, trained)
        return result

    def current_step(self) -> int:
        return int(self.manager.current_step())  # torchft

    def manager_step(self, step: int) -> int:
        return step

    @contextmanager
    def loading(self) -> Iterator[None]:
        yield

    @property
    def mid_turn(self) -> bool:
        return False

    def join_running_run(
        self, peer_steps: Callable[[], list[int]], stopped: Callable[[], bool]
    ) -> None:
        """Nothing before the first step: its quorum heals the group from a peer ahead."""

    def close(self) -> None:
        """Detach the reducer from the parameters (a model handed on gets a new one)."""
        self.reducer.close()
