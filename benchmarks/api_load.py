"""API load benchmark (not in CI): N concurrent clients polling status and submitting.

Starts a real ``ito-backend serve`` subprocess on loopback with a temp DB, makes one
tenant (one submitter key per client, so the per-key rate limit measures nothing
here; an approver key; a live booking), one run to poll, and one
confirmation per planned submit (made before the timed phase: confirming is the
approver's step, not load). Then ``--clients`` asyncio clients, each with its own
connection, run for ``--duration`` seconds: GET /v1/runs/{id} every ``--interval``
seconds (0 = back to back, a closed loop), and ``--submits`` POST /v1/runs spread
over the run. The load generator is a separate process from the server, but both
share this machine's cores: the figures are what a co-located client sees.

    .venv/bin/python benchmarks/api_load.py --clients 50 --duration 20 --interval 0.25

Latency counts from when a request was due, not from when it was sent: a poll is due
``--interval`` after the previous one was due (fixed rate), a submit at its planned
moment, so time spent queued behind a slow request counts (no coordinated omission;
with ``--interval 0``, a closed loop, due = sent). ``*_service_p99_ms`` are the same
requests timed from their send, for comparison.

Several replicas: ``--replicas N --db postgresql://...`` starts N servers on that
(empty or shared) PostgreSQL database and spreads the clients over them round-robin,
as a load balancer would; ``--sqlite-baseline`` first measures the single server on
a temp SQLite file in the same run, so both lines come from the same machine state.
The password comes from ``ITO_DB_PASSWORD_FILE`` / ``PGPASSWORD``, never argv.

    .venv/bin/python benchmarks/api_load.py --replicas 2 --db postgresql://ito@127.0.0.1:5432/ito \
        --sqlite-baseline

Prints p50/p99 latency per kind and requests/s; the last line is one JSON object:
clients, status_p50_ms, status_p99_ms, submit_p99_ms, the service-time p99s,
requests_per_s (plus details); with ``--sqlite-baseline``, ``{"sqlite": {...},
"replicas": {...}}``.
``--profile PATH`` records the server with py-spy during the timed phase (raw
collapsed stacks) and prints the hottest frames.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from orchestrator.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 30.0


def _iso(hours: float) -> str:
    return (datetime.now(UTC) + timedelta(hours=hours)).isoformat().replace("+00:00", "Z")


def start_server(
    tmp: Path,
    log_level: str,
    module: str = "orchestrator.admin",
    db: str | None = None,
    name: str = "server",
) -> tuple[subprocess.Popen[bytes], str]:
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
            # The clients are one account's: the per-account plan bound would refuse
            # overlapping submits; lifted to the server's 4 request threads (this
            # measures throughput; tests/api/test_server_abuse.py measures the bound).
            "--plans-per-account",
            "4",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp / f"{name}.log").read_text()[-3000:])
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def make_tenant(db: str, clients: int) -> dict[str, Any]:
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
        submitters = [
            issue_key(store, name, ["runs:read", "runs:write"])[1] for _ in range(clients)
        ]
        approver_scopes = [s for s in SCOPES if s.startswith("confirm:")] + ["runs:read"]
        _, approver = issue_key(store, name, approver_scopes)
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
    return {
        "submitter": submitters[0],
        "submitters": submitters,
        "approver": approver,
        "booking": booking,
    }


def manifest_body(tmp: Path) -> dict[str, str]:
    m = json.loads((REPO / "configs" / "manifests" / "example.json").read_text())
    m["checkpoint"]["storage_uri"] = "file://" + str(tmp / "ckpt")
    raw = json.dumps(m, sort_keys=True).encode()
    return {
        "manifest_b64": base64.b64encode(raw).decode(),
        "manifest_digest": hashlib.sha256(raw).hexdigest(),
    }


def confirmations(url: str, t: dict[str, str], body: dict[str, str], n: int) -> list[str]:
    refs = []
    with httpx.Client(
        base_url=url,
        timeout=REQUEST_TIMEOUT_S,
        headers={"Authorization": f"Bearer {t['approver']}"},
    ) as c:
        for _ in range(n):
            env = c.post(
                "/v1/confirmations",
                json={
                    "action": "train",
                    "booking_id": t["booking"],
                    "cost_usd": 100.0,
                    **body,
                },
            ).json()
            if not env["ok"]:
                raise RuntimeError(f"confirmation refused: {env}")
            refs.append(env["data"]["confirmation_ref"])
    return refs


def submit_sync(url: str, t: dict[str, str], body: dict[str, str], ref: str, key: str) -> str:
    r = httpx.post(
        url + "/v1/runs",
        timeout=REQUEST_TIMEOUT_S,
        json={"booking_id": t["booking"], "confirmation_ref": ref, **body},
        headers={"Authorization": f"Bearer {t['submitter']}", "Idempotency-Key": key},
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


async def client_loop(
    i: int,
    url: str,
    t: dict[str, str],
    body: dict[str, str],
    run_id: str,
    refs: list[str],
    args: argparse.Namespace,
    t_end: float,
    lat: dict[str, list[float]],
    errors: Counter[str],
) -> None:
    rng = random.Random(i)
    headers = {"Authorization": f"Bearer {t['submitters'][i]}"}
    conn: RawHttp | HttpxConn = (RawHttp if args.http == "raw" else HttpxConn)(url, headers)
    try:
        # Submits at random moments of the run, so they meet polls from other clients.
        submit_at = sorted(rng.uniform(0, args.duration * 0.9) for _ in refs)
        start = time.monotonic()
        await asyncio.sleep(rng.uniform(0, max(args.interval, 0.01)))  # de-synchronise
        # Each client keeps its own random phase: polls are due interval apart from
        # the client's first poll (measuring from the common start re-aligned them all
        # into bursts of 50 simultaneous requests).
        phase = time.monotonic()
        n = 0
        # Submits go out on their own connection at their due moments, so a poll in
        # progress on this client's connection never delays them.
        submits = asyncio.create_task(
            submit_loop(i, url, headers, t, body, refs, submit_at, start, args, lat, errors)
        )
        status_path = f"/v1/runs/{run_id}"
        while time.monotonic() < t_end:
            # Latency counts from when the poll was due, not from when it could be sent:
            # a poll delayed behind a slow one has been waiting (no coordinated omission).
            sent = time.monotonic()
            due = phase + n * args.interval if args.interval > 0 else sent
            code, _ = await conn.request("GET", status_path)
            done = time.monotonic()
            lat["status"].append(done - min(due, sent))
            lat["status_service"].append(done - sent)
            if code != 200:
                errors[f"status {code}"] += 1
            n += 1
            if args.interval > 0:
                # Fixed-rate polling: the next poll is due interval after the last was due.
                next_due = phase + n * args.interval
                await asyncio.sleep(max(0.0, next_due - time.monotonic()))
        await submits
    finally:
        await conn.close()


async def submit_loop(
    i: int,
    url: str,
    headers: dict[str, str],
    t: dict[str, str],
    body: dict[str, str],
    refs: list[str],
    submit_at: list[float],
    start: float,
    args: argparse.Namespace,
    lat: dict[str, list[float]],
    errors: Counter[str],
) -> None:
    # A fresh connection per submit (the server closes idle keep-alive connections
    # between these rare calls); connecting is part of the submit's latency.
    for at in submit_at:
        due = start + at
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        conn: RawHttp | HttpxConn = (RawHttp if args.http == "raw" else HttpxConn)(url, headers)
        try:
            ref = refs.pop()
            payload = json.dumps(
                {"booking_id": t["booking"], "confirmation_ref": ref, **body}
            ).encode()
            key = {"Idempotency-Key": f"bench-{i}-{len(refs)}-{ref[-8:]}"}
            sent = time.monotonic()
            code, data = await conn.request("POST", "/v1/runs", payload, key)
            done = time.monotonic()
            lat["submit"].append(done - due)
            lat["submit_service"].append(done - sent)
            if code != 200:
                errors[f"submit {code} {json.loads(data)['error']['code']}"] += 1
        finally:
            await conn.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc: robust to a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))] * 1000


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


async def load(
    urls: list[str],
    t: dict[str, str],
    body: dict[str, str],
    run_id: str,
    refs: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    lat: dict[str, list[float]] = {
        "status": [],
        "submit": [],
        "status_service": [],
        "submit_service": [],
    }
    errors: Counter[str] = Counter()
    per_client = [refs[i :: args.clients] for i in range(args.clients)]
    t0 = time.monotonic()
    t_end = t0 + args.duration
    await asyncio.gather(
        *(
            client_loop(
                i, urls[i % len(urls)], t, body, run_id, per_client[i], args, t_end, lat, errors
            )
            for i in range(args.clients)
        )
    )
    elapsed = time.monotonic() - t0
    total = len(lat["status"]) + len(lat["submit"])
    return {
        "clients": args.clients,
        "replicas": len(urls),
        "status_p50_ms": round(pct(lat["status"], 50), 2),
        "status_p99_ms": round(pct(lat["status"], 99), 2),
        "submit_p50_ms": round(pct(lat["submit"], 50), 2),
        "submit_p99_ms": round(pct(lat["submit"], 99), 2),
        "status_service_p99_ms": round(pct(lat["status_service"], 99), 2),
        "submit_service_p99_ms": round(pct(lat["submit_service"], 99), 2),
        "requests_per_s": round(total / elapsed, 1),
        "status_requests": len(lat["status"]),
        "submit_requests": len(lat["submit"]),
        "status_mean_ms": round(statistics.fmean(lat["status"]) * 1000, 2)
        if lat["status"]
        else None,
        "interval_s": args.interval,
        "http": args.http,
        "duration_s": round(elapsed, 2),
        "errors": dict(errors),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of timed load")
    ap.add_argument(
        "--interval",
        type=float,
        default=0.25,
        help="seconds between one client's polls; 0 = closed loop",
    )
    ap.add_argument("--submits", type=int, default=100, help="submits in total")
    ap.add_argument("--server-log-level", default="warning")
    ap.add_argument(
        "--http", choices=["raw", "httpx"], default="raw", help="load generator's HTTP client"
    )
    ap.add_argument("--profile", type=Path, default=None, help="py-spy raw output path")
    ap.add_argument(
        "--server-module",
        default="orchestrator.admin",
        help="module run as `python -m MODULE serve ...` (A/B a patched server)",
    )
    ap.add_argument("--replicas", type=int, default=1, help="API servers on one store")
    ap.add_argument(
        "--db",
        default=None,
        help="the store (default: a temp SQLite file); postgresql://... for "
        "replicas, without a password",
    )
    ap.add_argument(
        "--sqlite-baseline",
        action="store_true",
        help="first measure one server on a temp SQLite file, in the same run",
    )
    args = ap.parse_args()
    if args.replicas > 1 and not (args.db or "").startswith("postgresql://"):
        ap.error("--replicas > 1 needs --db postgresql://... (SQLite has one writer host)")
    if args.sqlite_baseline:
        results = {
            "sqlite": measure(args, None, 1),
            "replicas": measure(args, args.db, args.replicas),
        }
        print(json.dumps(results))
    else:
        print(json.dumps(measure(args, args.db, args.replicas)))


def measure(args: argparse.Namespace, db: str | None, replicas: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ito-api-load-"))
    store = db or str(tmp / "ito.db")
    servers: list[tuple[subprocess.Popen[bytes], str]] = []
    spy: subprocess.Popen[bytes] | None = None
    try:
        for i in range(replicas):
            servers.append(
                start_server(tmp, args.server_log_level, args.server_module, store, f"server{i}")
            )
        proc, url = servers[0]
        urls = [u for _, u in servers]
        t = make_tenant(store, args.clients)
        body = manifest_body(tmp)
        first = confirmations(url, t, body, 1)[0]
        run_id = submit_sync(url, t, body, first, "bench-poll-target")
        refs = confirmations(url, t, body, args.submits)
        if args.profile is not None:
            spy = subprocess.Popen(
                [
                    shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--format",
                    "raw",
                    "--nonblocking",
                    "--rate",
                    "200",
                    "--duration",
                    str(int(args.duration)),
                    "--output",
                    str(args.profile),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # let py-spy attach
        pids = [p.pid for p, _ in servers]
        cpu0, own0 = sum(cpu_seconds(p) for p in pids), cpu_seconds(os.getpid())
        result = asyncio.run(load(urls, t, body, run_id, refs, args))
        n = result["status_requests"] + result["submit_requests"]
        server_cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        result["store"] = "postgresql" if store.startswith("postgresql://") else "sqlite"
        result["server_cpu_ms_per_request"] = round(1000 * server_cpu / n, 2)
        # The load generator shares the cores: its own cost per request, for context.
        result["client_cpu_ms_per_request"] = round(1000 * (cpu_seconds(os.getpid()) - own0) / n, 2)
        result["load_avg_1m"] = os.getloadavg()[0]
        if spy is not None:
            spy.wait(timeout=args.duration + 60)
    finally:
        for p, _ in servers:
            p.terminate()
        for p, _ in servers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"{result['store']} x{result['replicas']}: {result['clients']} clients, "
        f"{result['duration_s']} s, interval {args.interval} s"
    )
    print(
        f"status  p50 {result['status_p50_ms']} ms  p99 {result['status_p99_ms']} ms  "
        f"(n={result['status_requests']})"
    )
    print(
        f"submit  p50 {result['submit_p50_ms']} ms  p99 {result['submit_p99_ms']} ms  "
        f"(n={result['submit_requests']})"
    )
    print(
        f"requests/s {result['requests_per_s']}  errors {result['errors']}  server CPU "
        f"{result['server_cpu_ms_per_request']} ms/request  load avg {result['load_avg_1m']}"
    )
    if args.profile is not None and args.profile.exists():
        own, incl = hottest(args.profile)
        print("server self time (py-spy):")
        for frame, share in own:
            print(f"  {share:5.1f}%  {frame}")
        print("server inclusive time (py-spy):")
        for frame, share in incl:
            print(f"  {share:5.1f}%  {frame}")
    return result


if __name__ == "__main__":
    main()
