"""Two API replicas (real ``ito-backend serve`` processes) on one real PostgreSQL.

Requests for one key, one confirmation or one credential land on different replicas,
as behind any load balancer; every guarantee must hold through the shared store.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.backend import Backend
from helpers.flows import confirm_ref, submit
from helpers.manifests import example_manifest
from helpers.postgres import PgServer
from helpers.tenants import Tenant, admin, make_tenant
from helpers.waiting import wait_until
from helpers.xdist_groups import module_group

from orchestrator.db.store import Store

pytestmark = [pytest.mark.slow, module_group(__name__)]
N = 50


def _replica(tmp: Path, name: str, db: str) -> Backend:
    (tmp / name).mkdir(parents=True, exist_ok=True)
    # The races under test need every request to reach the store: the per-account
    # plan bound (tests/api/test_server_abuse.py) is lifted above the server's thread
    # count, where it never bites (at the thread count a request arriving while every
    # handler works for the account is refused: a 429 in a race that must reach the store).
    return Backend(
        db=db,
        var_dir=tmp / name / "var",
        log_path=tmp / name / "backend.log",
        extra_args=["--plans-per-account", "64"],
    )


@pytest.fixture(scope="module")
def replicas(
    pg_server: PgServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Backend]]:
    db = pg_server.new_database()
    tmp = tmp_path_factory.mktemp("replicas")
    pair = [_replica(tmp, "a", db).start(), _replica(tmp, "b", db).start()]
    try:
        yield pair
    finally:
        for b in pair:
            b.stop()


def _fire(
    calls: list[tuple[Backend, Callable[[httpx.Client], httpx.Response]]],
) -> list[httpx.Response | BaseException]:
    """Send every call at once, each on its own connection to its replica."""
    barrier = threading.Barrier(len(calls))

    def one(
        call: tuple[Backend, Callable[[httpx.Client], httpx.Response]],
    ) -> httpx.Response | BaseException:
        backend, send = call
        with backend.client() as c:
            barrier.wait()
            try:
                return send(c)
            except httpx.HTTPError as e:
                return e

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def _runs(db: str, account: str) -> list[dict[str, Any]]:
    store = Store(db)
    try:
        return store.read(
            "SELECT run_id, idempotency_key FROM runs JOIN accounts USING "
            "(account_id) WHERE name = ?",
            (account,),
        )
    finally:
        store.close()


def _submit_call(
    t: Tenant, m: dict[str, Any], ref: str, key: str
) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: submit(c, t.submitter, t.booking_id, m, ref, key)


def test_50_submits_of_one_key_across_replicas_make_one_run(
    replicas: list[Backend], tmp_path: Path
) -> None:
    t = make_tenant(replicas[0].db, "ha-one-key")
    m = example_manifest(tmp_path / "ckpt")
    with replicas[0].client() as c:
        ref = confirm_ref(c, t.approver, "train", t.booking_id, manifest=m)
    answers = _fire(
        [(replicas[i % 2], _submit_call(t, m, ref, "one-key-two-replicas")) for i in range(N)]
    )
    bodies = [a.json() if isinstance(a, httpx.Response) else repr(a) for a in answers]
    assert all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers), bodies
    ok = [a.json()["data"] for a in answers if isinstance(a, httpx.Response)]
    assert len({d["run_id"] for d in ok}) == 1
    assert [d["replayed"] for d in ok].count(False) == 1
    assert [r["run_id"] for r in _runs(str(replicas[0].db), t.account)] == [ok[0]["run_id"]]


def test_one_confirmation_through_both_replicas_authorises_one_mutation(
    replicas: list[Backend], tmp_path: Path
) -> None:
    t = make_tenant(replicas[0].db, "ha-one-confirmation")
    m = example_manifest(tmp_path / "ckpt")
    with replicas[0].client() as c:
        train_ref = confirm_ref(c, t.approver, "train", t.booking_id, manifest=m)
    # One train confirmation, 50 keys: one run.
    answers = _fire(
        [(replicas[i % 2], _submit_call(t, m, train_ref, f"one-ref-key-{i:03d}")) for i in range(N)]
    )
    codes = [
        a.json()["error"]["code"]
        for a in answers
        if isinstance(a, httpx.Response) and a.status_code != 200
    ]
    created = [
        a.json()["data"]["run_id"]
        for a in answers
        if isinstance(a, httpx.Response) and a.status_code == 200
    ]
    assert len(created) == 1 and codes == ["confirmation_consumed"] * (N - 1), codes
    run_id = created[0]
    # One cancel confirmation, used at once through both replicas under 20 keys: one
    # cancel is authorised, every other use is refused.
    with replicas[1].client() as c:
        cancel_ref = confirm_ref(c, t.approver, "cancel", t.booking_id, run_id=run_id, cost_usd=0)

    def cancel(key: str) -> Callable[[httpx.Client], httpx.Response]:
        return lambda c: c.post(
            f"/v1/runs/{run_id}/cancel",
            json={"confirmation_ref": cancel_ref},
            headers={"Authorization": f"Bearer {t.submitter}", "Idempotency-Key": key},
        )

    answers = _fire([(replicas[i % 2], cancel(f"cancel-key-{i:03d}")) for i in range(20)])
    assert all(isinstance(a, httpx.Response) for a in answers)
    done = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
    refused = [
        a.json()["error"]["code"]
        for a in answers
        if isinstance(a, httpx.Response) and a.status_code != 200
    ]
    assert len(done) == 1 and done[0].json()["data"]["replayed"] is False
    assert refused == ["confirmation_consumed"] * 19
    store = Store(replicas[0].db)
    try:
        cancels = store.read(
            "SELECT idempotency_key FROM idempotency WHERE action = 'cancel' AND target = ?",
            (run_id,),
        )
        assert len(cancels) == 1
    finally:
        store.close()


def test_revoked_key_stops_on_every_replica(replicas: list[Backend]) -> None:
    t = make_tenant(replicas[0].db, "ha-revoke")
    for b in replicas:
        with b.client(t.submitter) as c:
            assert c.get("/v1/runs", params={"idempotency_key": "x"}).status_code == 200
    admin(replicas[0].db, "keys", "revoke", t.key_ids["submitter"])
    for b in replicas:
        with b.client(t.submitter) as c:
            r = c.get("/v1/runs", params={"idempotency_key": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "credential_revoked"


def test_replica_killed_mid_submit_retry_through_the_other_finds_one_run(
    replicas: list[Backend], tmp_path: Path
) -> None:
    """SIGKILL replica A while submits to it are on the wire; the client then looks each
    key up through replica B and retries there only if no run has it."""
    a, b = replicas
    t = make_tenant(a.db, "ha-kill")
    m = example_manifest(tmp_path / "ckpt")
    with b.client() as c:
        refs = [confirm_ref(c, t.approver, "train", t.booking_id, manifest=m) for _ in range(N)]
    keys = [f"crash-{i:03d}" for i in range(N)]
    acked: dict[str, str] = {}
    lock = threading.Lock()
    killed = threading.Event()
    assert a.proc is not None

    def one(i: int) -> None:
        try:
            with a.client() as c:
                r = submit(c, t.submitter, t.booking_id, m, refs[i], keys[i])
        except httpx.HTTPError:
            return  # lost or never sent: the retry below decides
        if r.status_code == 200:
            with lock:
                acked[keys[i]] = r.json()["data"]["run_id"]
                if len(acked) == N // 5 and not killed.is_set():
                    killed.set()
                    a.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]

    with ThreadPoolExecutor(N) as pool:
        list(pool.map(one, range(N)))
    assert killed.is_set() and N // 5 <= len(acked) < N
    a.proc.wait(10)
    # The client's recovery: look up by key first, submit again only if absent.
    with b.client(t.submitter) as c:
        for i, key in enumerate(keys):
            found = c.get("/v1/runs", params={"idempotency_key": key}).json()["data"]["runs"]
            if found:
                run_id = found[0]["run_id"]
            else:
                r = submit(c, t.submitter, t.booking_id, m, refs[i], key)
                assert r.status_code == 200, r.json()
                run_id = r.json()["data"]["run_id"]
            if key in acked:
                assert run_id == acked[key], f"acknowledged run of {key} lost"
    rows = _runs(str(a.db), t.account)
    assert sorted(r["idempotency_key"] for r in rows) == sorted(keys)  # one run per key
    a.proc = None
    a.start()  # the module's pair stays whole for any later test


def test_one_key_with_two_confirmations_through_both_replicas_makes_one_run(
    replicas: list[Backend], pg_server: PgServer, tmp_path: Path
) -> None:
    """Two submits of one key, each with its own confirmation, one through each
    replica, both past the key's replay lookup before either commits: they lose no
    confirmation lock to each other, so the runs' UNIQUE (account, key) decides. The
    loser's transaction is rolled back and run again (``Store.write``), finds the
    winner's run and answers as for any other request under a used key: a different
    confirmation is a different request, ``409 idempotency_conflict``, never a 500."""
    import psycopg

    t = make_tenant(replicas[0].db, "ha-key-race")
    m = example_manifest(tmp_path / "ckpt")
    with replicas[0].client() as c:
        refs = [confirm_ref(c, t.approver, "train", t.booking_id, manifest=m) for _ in range(2)]
    key = "one-key-two-confirmations"
    password = pg_server.password_file.read_text().strip()
    # The test holds the account's row lock, which each submit's transaction takes
    # after its own key lookup (the active-run count), until both submits wait on it:
    # the race is then lost for sure, not by chance. FOR NO KEY UPDATE lets the
    # foreign-key checks of other rows (audit, confirmations) through.
    with (
        psycopg.connect(str(replicas[0].db), password=password) as holder,
        # pg_stat_activity is read outside the holder's transaction (a transaction
        # sees one snapshot of it).
        psycopg.connect(str(replicas[0].db), password=password, autocommit=True) as watcher,
        ThreadPoolExecutor(2) as pool,
    ):
        holder.execute(
            "SELECT 1 FROM accounts WHERE name = %s FOR NO KEY UPDATE", (t.account,)
        ).fetchone()
        sent = [
            pool.submit(_fire, [(replicas[i], _submit_call(t, m, refs[i], key))]) for i in range(2)
        ]

        def waiting() -> bool:
            row = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE '%FROM accounts%FOR UPDATE%'"
            ).fetchone()
            return row is not None and row[0] == 2

        wait_until(waiting, 60, "both submits to wait on the account's row lock")
        holder.rollback()
        answers = [f.result()[0] for f in sent]
    bodies = [a.json() if isinstance(a, httpx.Response) else repr(a) for a in answers]
    assert all(isinstance(a, httpx.Response) for a in answers), bodies
    by_status = {a.status_code: a.json() for a in answers if isinstance(a, httpx.Response)}
    assert sorted(by_status) == [200, 409], bodies
    won = by_status[200]["data"]
    assert won["replayed"] is False
    assert by_status[409]["error"]["code"] == "idempotency_conflict"
    assert [r["run_id"] for r in _runs(str(replicas[0].db), t.account)] == [won["run_id"]]
    # The loser's rolled-back attempt consumed nothing: its confirmation still
    # authorises a run under a key of its own.
    loser = next(i for i, a in enumerate(answers) if a.status_code == 409)  # type: ignore[union-attr]
    with replicas[loser].client() as c:
        again = submit(c, t.submitter, t.booking_id, m, refs[loser], "the-losers-own-key")
    assert again.status_code == 200 and again.json()["data"]["replayed"] is False, again.json()
