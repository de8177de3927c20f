"""The API load benchmark's fixtures: servers, the tenant, confirmations, a lean HTTP
client, percentiles and the profile summary (``benchmarks/api_load.py`` runs them)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from orchestrator.runtime.ports import free_port
from orchestrator.settings import Settings

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 30.0
# The benchmark's one account holds every run it submits (with --runtime none they
# stay accepted): the most the server's setting allows, so no submit meets
# too_many_active_runs (tests/api cover that bound).
MAX_ACTIVE_RUNS = next(
    int(m.le)
    for m in Settings.model_fields["max_active_runs_per_account"].metadata
    if getattr(m, "le", None) is not None
)
# Plan validations one account may have in flight: one above the server's request
# threads, where the bound never bites (the clients are one account's; this measures
# throughput, tests/api/test_server_abuse.py measures the bound).
PLANS_PER_ACCOUNT = int(Settings.model_fields["request_threads"].default) + 1


# Approver keys the confirmations rotate over: a sweep's mix may need hundreds at once,
# past one key's rate-limit burst.
APPROVERS = 8


def _iso(hours: float) -> str:
    return (datetime.now(UTC) + timedelta(hours=hours)).isoformat().replace("+00:00", "Z")


def launch_server(
    tmp: Path,
    log_level: str,
    module: str = "orchestrator.admin",
    db: str | None = None,
    name: str = "server",
) -> tuple[subprocess.Popen[bytes], str]:
    """One API server on ``db`` (default: a SQLite file in ``tmp``): its process and
    URL, not yet waited for (``wait_healthy``)."""
    port = free_port()
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            "serve",
            "--db",
            db or str(tmp / "ito.db"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--var-dir",
            str(tmp / "var"),
            "--log-level",
            log_level,
            # The API under load, not training: runs stay `accepted` (no Ray, no actors);
            # the planner gate stays on, so a submit costs what it costs in production.
            "--runtime",
            "none",
            "--metrics-port",
            "0",
            "--plans-per-account",
            str(PLANS_PER_ACCOUNT),
            "--max-active-runs-per-account",
            str(MAX_ACTIVE_RUNS),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(tmp: Path, proc: subprocess.Popen[bytes], url: str, name: str) -> None:
    """Until the server answers ``/healthz`` (it is killed if it never does)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp / f"{name}.log").read_text()[-3000:])
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def make_tenant(db: str, keys: int) -> dict[str, Any]:
    """A fresh account with ``keys`` submitter keys, approver keys and a live booking."""
    from orchestrator.db.store import Store
    from orchestrator.gates.auth import SCOPES, issue_key
    from orchestrator.gates.bookings import BookingFile, add_booking

    store = Store(db)
    # A fresh account per run: a shared PostgreSQL database may hold earlier ones.
    name = f"bench-{os.urandom(4).hex()}"
    try:
        account = store.create_account(name)["account_id"]
        # The manifest's data and checkpoint folders are under the temp folder.
        root = os.path.realpath(tempfile.gettempdir())
        store.set_roots(account, "data", [root])
        store.set_roots(account, "checkpoint", [root])
        submitters = [issue_key(store, name, ["runs:read", "runs:write"])[1] for _ in range(keys)]
        approver_scopes = [s for s in SCOPES if s.startswith("confirm:")] + ["runs:read"]
        approvers = [issue_key(store, name, approver_scopes)[1] for _ in range(APPROVERS)]
        booking = f"bk-{name}"
        add_booking(
            store,
            BookingFile.model_validate(
                {
                    "booking_id": booking,
                    "account": name,
                    # The CPU testbed: the planner gate accepts llama-tiny on it.
                    "gpu_sku": "cpu-testbed",
                    "gpus_per_node": 2,
                    "node_count": 1,
                    "region": "local",
                    "fabric": "loopback",
                    "term_start": _iso(-1),
                    "term_end": _iso(24),
                }
            ),
        )
    finally:
        store.close()
    return {"submitters": submitters, "approvers": approvers, "booking": booking}


def manifest_body(tmp: Path) -> dict[str, str]:
    m = json.loads((REPO / "configs" / "manifests" / "example.json").read_text())
    m["checkpoint"]["storage_uri"] = "file://" + str(tmp / "ckpt")
    raw = json.dumps(m, sort_keys=True).encode()
    return {
        "manifest_b64": base64.b64encode(raw).decode(),
        "manifest_digest": hashlib.sha256(raw).hexdigest(),
    }


def confirmations(url: str, t: dict[str, Any], body: dict[str, str], n: int) -> list[str]:
    """``n`` train confirmations by the approvers (their step, made outside the timed
    load): each takes the next approver key, and one refused for the per-key rate limit
    is asked again after its Retry-After."""
    refs: list[str] = []
    approvers = itertools.cycle(t["approvers"])
    payload = {"action": "train", "booking_id": t["booking"], "cost_usd": 100.0, **body}
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as c:
        while len(refs) < n:
            auth = {"Authorization": f"Bearer {next(approvers)}"}
            r = c.post("/v1/confirmations", json=payload, headers=auth)
            env = r.json()
            if r.status_code == 429 and env["error"]["code"] == "rate_limited":
                time.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if not env["ok"]:
                raise RuntimeError(f"confirmation refused: {env}")
            refs.append(env["data"]["confirmation_ref"])
    return refs


def submit_sync(url: str, t: dict[str, Any], body: dict[str, str], ref: str, key: str) -> str:
    r = httpx.post(
        url + "/v1/runs",
        timeout=REQUEST_TIMEOUT_S,
        json={"booking_id": t["booking"], "confirmation_ref": ref, **body},
        headers={"Authorization": f"Bearer {t['submitters'][0]}", "Idempotency-Key": key},
    )
    env = r.json()
    if not env["ok"]:
        raise RuntimeError(f"submit refused: {env}")
    return str(env["data"]["run_id"])


class RawHttp:
    """A minimal HTTP/1.1 keep-alive connection on asyncio streams.

    httpx costs the load generator more CPU per request than the server spends (measured:
    ~2.5 ms vs ~1.6 ms); on a 2-core box that steals the server's CPU and inflates the
    latencies. This client costs a fraction of it; ``--http httpx`` keeps the other."""

    def __init__(self, url: str, headers: dict[str, str]):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.base = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            ctype = "Content-Type: application/json\r\n" if body else ""
            head = (
                f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.base}"
                f"{extra}{ctype}Content-Length: {len(body)}\r\n\r\n"
            )
            self.writer.write(head.encode() + body)
            raw = await self.reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            fields = {
                k.strip().lower(): v.strip()
                for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            data = await self.reader.readexactly(int(fields.get("content-length", "0")))
            if fields.get("connection", "").lower() == "close":
                await self.close()
            return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class HttpxConn:
    def __init__(self, url: str, headers: dict[str, str]):
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        self.c = httpx.AsyncClient(
            base_url=url, headers=headers, limits=limits, timeout=REQUEST_TIMEOUT_S
        )

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        hdrs = {**(headers or {}), **({"Content-Type": "application/json"} if body else {})}
        r = await self.c.request(method, path, content=body or None, headers=hdrs)
        return r.status_code, r.content

    async def close(self) -> None:
        await self.c.aclose()


def connect(kind: str, url: str, headers: dict[str, str]) -> RawHttp | HttpxConn:
    return (RawHttp if kind == "raw" else HttpxConn)(url, headers)


async def send(
    conn: RawHttp | HttpxConn,
    kind: str,
    method: str,
    path: str,
    errors: Counter[str],
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> bool:
    """One request; False (and the error counted under ``kind``) unless it answered 200.

    A refusal's key is ``"<kind> <status> <error code>"``; a lost connection's
    ``"<kind> <exception>"`` (the connection is dropped, the next request reconnects)."""
    try:
        code, data = await conn.request(method, path, body, headers)
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
        errors[f"{kind} {type(e).__name__}"] += 1
        await conn.close()
        return False
    if code == 200:
        return True
    try:
        what = json.loads(data)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        what = "?"
    errors[f"{kind} {code} {what}"] += 1
    return False


class Target:
    """The servers of one store, its tenant, the polled run and the manifest to submit."""

    def __init__(self, urls: list[str], pids: list[int], db: str, t: dict[str, Any], tmp: Path):
        self.urls, self.pids, self.db, self.t = urls, pids, db, t
        self.kind = "postgresql" if db.startswith("postgresql://") else "sqlite"
        self.label = f"{self.kind} x{len(urls)}"
        self.body = manifest_body(tmp)
        first = confirmations(urls[0], t, self.body, 1)[0]
        self.run_id = submit_sync(urls[0], t, self.body, first, "bench-poll-target")

    def payload(self, ref: str) -> bytes:
        return json.dumps(
            {"booking_id": self.t["booking"], "confirmation_ref": ref, **self.body}
        ).encode()

    def cpu(self) -> tuple[float, float | None, float, int, int]:
        """CPU seconds so far of the servers, the database's backends and this load
        generator, and the machine's (busy, total) jiffies."""
        vals = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        busy = sum(vals) - vals[3] - vals[4]  # less idle and iowait
        server = sum(cpu_seconds(p) for p in self.pids)
        return server, db_cpu_seconds(self.db), cpu_seconds(os.getpid()), busy, sum(vals)

    def cpu_per_request(
        self, before: tuple[float, float | None, float, int, int], n: int
    ) -> dict[str, Any]:
        after, n = self.cpu(), max(1, n)
        b0, d0, c0, busy0, all0 = before
        b1, d1, c1, busy1, all1 = after
        return {
            "server_cpu_ms_per_request": round(1000 * (b1 - b0) / n, 2),
            "db_cpu_ms_per_request": None
            if d0 is None or d1 is None
            else round(1000 * (d1 - d0) / n, 2),
            # The load generator shares the cores: its own cost per request, for context.
            "client_cpu_ms_per_request": round(1000 * (c1 - c0) / n, 2),
            "machine_busy_pct": round(100 * (busy1 - busy0) / max(1, all1 - all0), 1),
        }


@contextmanager
def serving(
    db: str | None, replicas: int, keys: int, log_level: str, module: str
) -> Iterator[Target]:
    """``replicas`` servers on ``db`` (None: a temp SQLite file) and a fresh tenant with
    ``keys`` submitter keys; the servers stop and their temp folder goes on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="ito-api-load-"))
    store = db or str(tmp / "ito.db")
    servers: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        # The replicas start together: each is seconds of imports before it listens.
        for i in range(replicas):
            servers.append(launch_server(tmp, log_level, module, store, f"server{i}"))
        for i, (proc, url) in enumerate(servers):
            wait_healthy(tmp, proc, url, f"server{i}")
        urls, pids = [u for _, u in servers], [p.pid for p, _ in servers]
        yield Target(urls, pids, store, make_tenant(store, keys), tmp)
    finally:
        for p, _ in servers:
            p.terminate()
        for p, _ in servers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc: robust to a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def db_cpu_seconds(db: str) -> float | None:
    """CPU of the PostgreSQL backends serving ``db`` (a local server: their titles read
    ``postgres: <user> <database> ...``); None for SQLite, whose work is the server's."""
    if not db.startswith("postgresql://"):
        return None
    tag = f" {urlsplit(db).path.lstrip('/')} ".encode()
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
            if title.startswith(b"postgres: ") and tag in title:
                total += cpu_seconds(int(pid))
        except OSError:  # gone meanwhile
            continue
    return total


def pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of seconds, in ms, rounded; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))] * 1000, 2)


def hottest(raw: Path, top: int = 15) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(self, inclusive) share of samples per frame from py-spy's raw (collapsed) output.

    Inclusive counts a frame once per sample wherever it is on the stack, so
    ``Store.audit`` or ``authenticate`` show their whole cost."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return [], []
    return (
        [(f, 100.0 * c / total) for f, c in own.most_common(top)],
        [(f, 100.0 * c / total) for f, c in incl.most_common(top * 4)],
    )
