"""A booking's named nodes: ``ito-backend bookings add-nodes`` / ``remove-nodes`` (the
real typer app, in process), their refusals, the change log the supervisor resizes
runs from, and the migration that names an older database's nodes; on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.fixtures import both_engines
from helpers.tenants import booking_doc
from typer.testing import CliRunner

from orchestrator.admin import app
from orchestrator.db.engines import open_engine
from orchestrator.db.schema import MIGRATIONS, SCHEMA_VERSION, render
from orchestrator.db.store import Store, is_postgres
from orchestrator.gates.bookings import BookingFile, add_booking, check_eligibility
from stages.errors import ErrorCode, ItoError

pytestmark = both_engines


def _admin(db: str, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, [*args, "--db", db, "--json"])
    env: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    assert (result.exit_code == 0) == env["ok"], result.stdout
    return env


def _code(env: dict[str, Any]) -> str:
    assert env["ok"] is False, env
    return str(env["error"]["code"])


def _store_with_bookings(db: str) -> Store:
    store = Store(db)
    store.create_account("acme")
    add_booking(store, BookingFile(**booking_doc("bk-a", "acme", node_count=None, nodes=["h1"])))
    add_booking(store, BookingFile(**booking_doc("bk-b", "acme", node_count=2)))
    return store


def test_add_and_remove_nodes_keep_the_count_log_the_change_and_audit(db: str) -> None:
    store = _store_with_bookings(db)
    assert store.booking_nodes("bk-b") == ["bk-b-n0", "bk-b-n1"]  # derived names
    env = _admin(db, "bookings", "add-nodes", "bk-a", "--node", "h2", "--node", "h3")
    assert env["data"]["nodes"] == ["h1", "h2", "h3"] and env["data"]["node_count"] == 3
    env = _admin(db, "bookings", "remove-nodes", "bk-a", "--node", "h1")
    assert env["data"]["nodes"] == ["h2", "h3"]
    assert store.booking("bk-a")["node_count"] == 2  # type: ignore[index]
    changes = store.booking_changes("bk-a")
    assert [(c["action"], c["nodes"], c["node_count"]) for c in changes] == [
        ("add", ["h2", "h3"], 3),
        ("remove", ["h1"], 2),
    ]
    assert changes[0]["change_id"] < changes[1]["change_id"]
    assert store.booking_changes("bk-a", after_change_id=changes[0]["change_id"]) == changes[1:]
    audit = [(r["action"], r["booking_id"]) for r in store.audit_events()]
    assert ("admin:bookings.add_nodes", "bk-a") in audit
    assert ("admin:bookings.remove_nodes", "bk-a") in audit
    # Every node taken back: still registered, but no longer eligible for a run.
    _admin(db, "bookings", "remove-nodes", "bk-a", "--node", "h2", "--node", "h3")
    account_id = store.account_by_name("acme")["account_id"]  # type: ignore[index]
    with pytest.raises(ItoError) as e:
        check_eligibility(store, "bk-a", account_id, ttl_s=60)
    assert e.value.code == ErrorCode.booking_incomplete


def test_bad_node_changes_are_refused_with_their_codes_and_change_nothing(db: str) -> None:
    store = _store_with_bookings(db)
    add = ("bookings", "add-nodes")
    remove = ("bookings", "remove-nodes")
    # A node another active booking holds, by add-nodes and by a booking file.
    assert _code(_admin(db, *add, "bk-a", "--node", "bk-b-n1")) == "booking_node_taken"
    with pytest.raises(ItoError) as e:
        add_booking(store, BookingFile(**booking_doc("bk-c", "acme", node_count=1, nodes=["h1"])))
    assert e.value.code == ErrorCode.booking_node_taken
    assert store.booking("bk-c") is None  # the whole registration rolled back
    # Removing a node twice, or one the booking never had.
    _admin(db, *add, "bk-a", "--node", "h9")
    assert _admin(db, *remove, "bk-a", "--node", "h9")["ok"]
    assert _code(_admin(db, *remove, "bk-a", "--node", "h9")) == "booking_node_unknown"
    assert _code(_admin(db, *remove, "bk-a", "--node", "bk-b-n0")) == "booking_node_unknown"
    # Empty lists, malformed names, a name twice, a node the booking holds already.
    assert _code(_admin(db, *add, "bk-a")) == "booking_nodes_invalid"
    assert _code(_admin(db, *remove, "bk-a")) == "booking_nodes_invalid"
    for bad in ("", "h 1", "h/1", "x" * 129, "h\n1"):
        assert _code(_admin(db, *add, "bk-a", "--node", bad)) == "booking_nodes_invalid", bad
    assert _code(_admin(db, *add, "bk-a", "--node", "h5", "--node", "h5")) == (
        "booking_nodes_invalid"
    )
    assert _code(_admin(db, *add, "bk-a", "--node", "h1")) == "booking_nodes_invalid"
    with pytest.raises(ItoError) as e:
        add_booking(store, BookingFile(**booking_doc("bk-d", "acme", node_count=2, nodes=["z"])))
    assert e.value.code == ErrorCode.booking_nodes_invalid
    # Unknown and inactive bookings.
    assert _code(_admin(db, *add, "bk-nope", "--node", "h7")) == "booking_not_found"
    _admin(db, "bookings", "revoke", "bk-b")
    assert _code(_admin(db, *add, "bk-b", "--node", "h7")) == "booking_revoked"
    assert _code(_admin(db, *remove, "bk-b", "--node", "bk-b-n0")) == "booking_revoked"
    assert store.booking_nodes("bk-a") == ["h1"]
    assert [c["nodes"] for c in store.booking_changes("bk-a")] == [["h9"], ["h9"]]
    # A revoked booking's nodes are free for another booking.
    assert _admin(db, *add, "bk-a", "--node", "bk-b-n1")["data"]["nodes"] == ["h1", "bk-b-n1"]


def test_migration_names_the_nodes_of_an_older_database(db: str) -> None:
    """A store at schema 3 (bookings with a count only) opens at the current schema;
    each booking's nodes get their derived names, held only by active bookings."""
    statements = [
        s for m in MIGRATIONS[:3] for s in render(m, "postgresql" if is_postgres(db) else "sqlite")
    ]
    statements += [
        "CREATE TABLE schema_version (version INTEGER NOT NULL)",
        "INSERT INTO schema_version VALUES (3)",
        "INSERT INTO accounts (account_id, name, created_at) VALUES ('acct_1', 'acme', 0)",
    ]
    for booking_id, nodes, state in (("old-a", 3, "active"), ("old-b", 1, "revoked")):
        statements.append(
            "INSERT INTO bookings VALUES ("
            f"'{booking_id}', 'acct_1', 'H100-SXM', 8, {nodes}, 'eu', 'ib-ndr', 0, 1e12, "
            f"'{state}', 5, 5)"
        )
    engine = open_engine(db)  # the engine alone: no migration runs
    with engine.tx() as c:
        for statement in statements:
            c.execute(statement)
    engine.close()
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.booking_nodes("old-a") == ["old-a-n0", "old-a-n1", "old-a-n2"]
    assert store.booking_nodes("old-b") == ["old-b-n0"]
    # The revoked booking's node is free; the active booking's are not.
    store.change_booking_nodes("old-a", "add", ["old-b-n0"])
    with pytest.raises(ItoError) as e:
        store.create_account("globex")
        add_booking(
            store, BookingFile(**booking_doc("new", "globex", node_count=1, nodes=["old-a-n1"]))
        )
    assert e.value.code == ErrorCode.booking_node_taken
    assert store.booking("old-a")["node_count"] == 4  # type: ignore[index]


def test_one_node_added_to_two_bookings_at_once_goes_to_exactly_one(db: str) -> None:
    """Concurrent add-nodes of one node (two operators, two stores, e.g. two API hosts):
    the held-node index decides, the loser gets ``booking_node_taken``. Raced a few
    times, since one race may not overlap."""
    import threading

    _store_with_bookings(db)
    stores = {b: Store(db) for b in ("bk-a", "bk-b")}
    for race in range(RACES):
        node = f"contended-{race}"
        results: dict[str, str] = {}
        start = threading.Barrier(2)

        def add(
            booking_id: str,
            node: str = node,
            results: dict[str, str] = results,
            start: threading.Barrier = start,
        ) -> None:
            start.wait()
            try:
                stores[booking_id].change_booking_nodes(booking_id, "add", [node])
                results[booking_id] = "added"
            except ItoError as e:
                results[booking_id] = str(e.code)

        threads = [threading.Thread(target=add, args=(b,)) for b in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results.values()) == ["added", "booking_node_taken"], race
        holders = [b for b in stores if node in stores[b].booking_nodes(b)]
        assert len(holders) == 1 and results[holders[0]] == "added"


RACES = 6
