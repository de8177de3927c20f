"""The supervisor's leader lease and its fence, as part of the store.

One row per lease (``leases``): holder, fencing ``token`` (+1 for every new holder)
and ``expires_at``, all by the database's clock, never a host's. A holder's writes go
through ``Store.fenced``: each of its transactions first reads the lease row ``FOR
SHARE`` with its holder and token, so a holder that lost the lease (paused,
partitioned) has every write refused, and no takeover interleaves with a write.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.db.engines import Conn, Row
from stages.errors import ErrorCode, ItoError

if TYPE_CHECKING:
    from typing import Self

    from orchestrator.db.engines import PostgresEngine, SqliteEngine


@dataclass
class Fence:
    """A lease as its holder knows it; ``token`` is None while it holds none."""

    name: str
    holder: str
    token: int | None = None


class Leases:
    engine: SqliteEngine | PostgresEngine
    _fence: Fence | None

    def acquire_lease(self, fence: Fence, lease_s: float) -> int | None:
        """Take or renew the lease by the database's clock; returns the holder's token
        (new holder: the previous token + 1) or None while another holder's is live."""
        now = self.engine.now_sql
        with self.engine.tx() as c:
            row = c.execute(
                f"SELECT holder, token, expires_at, {now} AS now FROM leases "
                "WHERE name = ? FOR UPDATE",
                (fence.name,),
            ).fetchone()
            if row is None:
                cur = c.execute(
                    f"INSERT INTO leases VALUES (?, ?, 1, {now} + ?) ON CONFLICT (name) DO NOTHING",
                    (fence.name, fence.holder, lease_s),
                )
                fence.token = 1 if cur.rowcount == 1 else None
            elif (
                row["holder"] == fence.holder
                and row["token"] == fence.token
                and row["expires_at"] > row["now"]
            ):
                c.execute(
                    f"UPDATE leases SET expires_at = {now} + ? WHERE name = ?",
                    (lease_s, fence.name),
                )
            elif row["expires_at"] <= row["now"]:
                fence.token = int(row["token"]) + 1
                c.execute(
                    f"UPDATE leases SET holder = ?, token = ?, expires_at = {now} + ? "
                    "WHERE name = ?",
                    (fence.holder, fence.token, lease_s, fence.name),
                )
            else:
                fence.token = None
        return fence.token

    def release_lease(self, fence: Fence) -> None:
        """Give the lease up at once (a clean shutdown): a standby need not wait it out."""
        if fence.token is not None:
            with self.engine.tx() as c:
                c.execute(
                    f"UPDATE leases SET expires_at = {self.engine.now_sql} "
                    "WHERE name = ? AND holder = ? AND token = ?",
                    (fence.name, fence.holder, fence.token),
                )
            fence.token = None

    def lease(self, name: str) -> Row | None:
        rows = self.engine.read("SELECT * FROM leases WHERE name = ?", (name,))
        return rows[0] if rows else None

    def _check_fence(self, c: Conn, fence: Fence) -> None:
        held = (
            fence.token is not None
            and c.execute(
                f"SELECT 1 FROM leases WHERE name = ? AND holder = ? AND token = ? AND "
                f"expires_at > {self.engine.now_sql} FOR SHARE",
                (fence.name, fence.holder, fence.token),
            ).fetchone()
        )
        if not held:
            raise ItoError(
                ErrorCode.lease_lost,
                f"the {fence.name} lease (token "
                f"{fence.token}) is no longer held here; write refused",
            )

    def fenced(self, fence: Fence) -> Self:
        """A view on the same connections whose every write transaction first checks
        that ``fence`` still holds its lease: a stale leader's write is refused."""
        view = copy.copy(self)
        view._fence = fence
        return view
