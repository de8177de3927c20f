"""A real torchft Manager for a one-rank replica group in this process (its own
store, no state to heal), as the trainer builds it: for tests of the gradient path."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from stages.run_secret import RunSecret
from stages.trainer.config import FaultToleranceConfig
from stages.trainer.rank import ft


def one_rank_manager(
    cfg: FaultToleranceConfig,
    lighthouse_addr: str,
    *,
    group: int = 0,
    secret: RunSecret,
    sync_quorum: bool = False,
) -> tuple[Any, Any]:
    """(manager, its group's TCPStore): keep the store alive as long as the manager.
    ``sync_quorum``: DiLoCo's Manager (its quorum taken before the work that needs it)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = ft.build_manager(
        cfg,
        pg=ft.build_process_group(cfg, "cpu"),
        replica_group=group,
        rank=0,
        ranks_per_group=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        load_state_dict=lambda _s: None,
        state_dict=lambda: {},
        secret=secret,
        placement=None,
        sync_quorum=sync_quorum,
    )
    return manager, store


def run_groups(count: int, group: Callable[[int], None], *, timeout_s: float = 120.0) -> None:
    """``group(g)`` for each of ``count`` replica groups, each in a thread of this
    process (their Managers meet at one lighthouse); raises the first group's error."""
    errors: list[BaseException] = []

    def body(g: int) -> None:
        try:
            group(g)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(g,)) for g in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not errors, errors
