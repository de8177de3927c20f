"""Which replica groups share each step's global batch.

A run's global batch is fixed: each step's block of sequences is cut into equal
shares, one per data-parallel rank of the member groups. The members change only at a
resize (``stages.resize``), from a step every group agreed on, so the cut of every
step is a pure function of the step: a group that joins, leaves or heals reads the
share of the block its place gives it, and no sequence is trained twice or skipped
(a group *lost* mid-run still skips its share until it heals, as torchft does).

The record is part of the loop's state: a healing group gets it from its live peer
with the weights, and a checkpoint keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stages.errors import ErrorCode, ItoError


@dataclass
class Membership:
    """``changes``: (first step, member groups) in step order; the first is at step 0."""

    changes: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)

    @classmethod
    def initial(cls, groups: int) -> Membership:
        return cls([(0, tuple(range(groups)))])

    def members_at(self, step: int) -> tuple[int, ...]:
        """The groups that share step ``step``'s batch."""
        members = self.changes[0][1]
        for first, groups in self.changes:
            if first > step:
                break
            members = groups
        return members

    def share(self, group: int, step: int) -> tuple[int, int] | None:
        """Group ``group``'s place among step ``step``'s members and their count; None:
        not a member at that step (it trains no share of it)."""
        members = self.members_at(step)
        return (members.index(group), len(members)) if group in members else None

    def change(self, first_step: int, members: tuple[int, ...]) -> None:
        """From ``first_step`` on the batch is shared by ``members``. A change never
        rewrites a step already trained: ``first_step`` is at or after the last one."""
        if not members or len(set(members)) != len(members):
            raise ItoError(ErrorCode.resize_refused, f"bad member groups {members}")
        if first_step < self.changes[-1][0]:
            raise ItoError(
                ErrorCode.resize_refused,
                f"a membership change at step {first_step} is before the last one "
                f"(step {self.changes[-1][0]})",
            )
        if first_step == self.changes[-1][0]:
            self.changes[-1] = (first_step, tuple(sorted(members)))
        else:
            self.changes.append((first_step, tuple(sorted(members))))

    def state_dict(self) -> list[list[Any]]:
        return [[first, list(groups)] for first, groups in self.changes]

    def load_state_dict(self, state: list[list[Any]]) -> None:
        self.changes = [(int(first), tuple(int(g) for g in groups)) for first, groups in state]
