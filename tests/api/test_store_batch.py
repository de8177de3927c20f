"""``Store.read_batch``: several reads in one round trip (PostgreSQL: one query of
several statements, its parameters bound client-side) or one read transaction
(SQLite), and the run's view read that way. On both engines, real stores."""

from __future__ import annotations

import pytest
from helpers.fixtures import both_engines
from helpers.store_rows import insert_run

from orchestrator.db.store import Store
from stages.errors import ErrorCode, ItoError
from stages.events import (
    EvalEvent,
    LogEvent,
    ProgressEvent,
    ProposalEvent,
    StageResultEvent,
)

pytestmark = both_engines

QUOTED = "run_a'b%c\\d"


def test_a_batch_answers_each_read_in_order_with_parameters_bound_as_values(db: str) -> None:
    store = Store(db)
    insert_run(store, QUOTED, idempotency_key="k-quoted")
    insert_run(store, "run_2", idempotency_key="k-2")
    answers = store.read_batch(
        [
            ("SELECT run_id FROM runs WHERE run_id = ?", (QUOTED,)),
            # A parameter that would end the statement if it were pasted in, not bound.
            ("SELECT run_id FROM runs WHERE run_id = ?", ("x'; DELETE FROM runs; --",)),
            ("SELECT run_id FROM runs WHERE state = ? ORDER BY run_id", ("accepted",)),
            ("SELECT COUNT(*) AS n FROM runs WHERE plan IS NULL AND state_reason = ?", ("",)),
        ]
    )
    assert answers == [
        [{"run_id": QUOTED}],
        [],
        [{"run_id": "run_2"}, {"run_id": QUOTED}],
        [{"n": 2}],
    ]
    assert store.read_batch([]) == []
    assert store.read("SELECT COUNT(*) AS n FROM runs")[0]["n"] == 2


def test_the_run_view_rows_are_what_each_query_answers_alone(db: str) -> None:
    store = Store(db)
    insert_run(store, "run_1")
    events = [
        StageResultEvent(outcome={"stage": "data_prep", "status": "passed", "metrics": {"a": 1}}),
        ProposalEvent(proposal_id="p1", action="restart_from_checkpoint", description="d"),
        ProgressEvent(stage="data_prep", step="sketch", docs_done=10),
        EvalEvent(phase="p", battery="b", check="loss", score=0.25, passed=True),
        ProgressEvent(stage="data_prep", step="verify", docs_done=20),
        LogEvent(message="not in the view"),
        EvalEvent(phase="p", battery="b", check="bpb", score=1.5, passed=False),
    ]
    store.ingest_events(
        "run_1", [{**e.model_dump(mode="json"), "seq": i} for i, e in enumerate(events)]
    )
    rows = store.run_view_rows("run_1")
    assert rows.run == store.get_run("run_1")
    assert rows.stage_gates == store.list_stage_gates("run_1") and rows.stage_gates
    assert rows.proposals == store.list_proposals("run_1") and rows.proposals
    assert rows.progress == store.last_event("run_1", "progress")
    assert rows.progress is not None and rows.progress["step"] == "verify"
    assert rows.eval_events == store.list_events("run_1", kinds=["eval"])
    assert [e["payload"]["check"] for e in rows.eval_events] == ["loss", "bpb"]
    assert rows.resize_events == [] and rows.resizes == store.run_resizes("run_1") == []
    for run_id, account in (("run_missing", None), ("run_1", "acct_other")):
        with pytest.raises(ItoError) as e:
            store.run_view_rows(run_id, account)
        assert e.value.code == ErrorCode.run_not_found
