"""API load benchmark: status reads and submits against real servers, open or closed loop.

Starts real ``ito-backend serve`` subprocesses on loopback (``--runtime none``: runs
stay ``accepted``; the planner gate is on, so a submit costs what it costs in
production) and makes one tenant: a fresh account with submitter keys, an approver key
and a live booking, one run to poll, and the train confirmations the submits consume
(made by the approver before the timed load: confirming is its step, not load). The
servers run with ``--max-active-runs-per-account`` at its maximum and
``--plans-per-account`` above the request threads (the operator's own settings), so
every submit the benchmark sends can be accepted: a refusal is an error, never timed.
The load generator is one asyncio process beside the servers: on a small box they share
the cores, and the figures are what a co-located client sees.

``--mode open`` (fixed rate): ``--clients`` clients, one key each, poll
``GET /v1/runs/{id}`` every ``--interval`` s for ``--duration`` s, and ``--submits``
``POST /v1/runs`` go out at random moments (each on a fresh connection). Latency counts
from when the request was *due* (no coordinated omission); ``*_service_p99_ms`` times
the same requests from their send. Numbers (ms, nearest-rank percentiles):

- ``status_p50_ms``/``status_p99_ms``/``status_mean_ms``, ``submit_p50_ms``/
  ``submit_p99_ms``: due-to-answer latency of the requests answered 200, only those.
- ``status_requests``/``submit_requests``: requests answered 200; ``errors``: every
  other answer or lost connection, ``{"<kind> <status> <error code>": count}``.
- ``requests_per_s``: 200 answers (both kinds) per second of the timed phase.

``--mode closed`` (saturation): ``c`` clients each send the next request as soon as the
last answers, on one keep-alive connection, spread round-robin over the replicas; each
request takes the next key of a pool of ``--keys`` (so the per-key rate limit, 50/s by
default, never bites). ``c`` doubles from 1 up to ``--clients-max``: each step runs
``--warmup-s`` then ``--step-s`` measured seconds, and the sweep stops once a step's
throughput is not ``--plateau`` above the best so far (``--patience`` steps in a row),
its p99 passes ``--p99-bound-ms``, or it saw an error. Two sweeps per store:

- ``status``: only status reads.
- ``mix``: every ``--submit-every``-th request of each client is a submit (the open
  mode's default mix is 100 submits to 4000 reads, 1 in 41), the rest status reads.

Per step: ``requests_per_s`` = 200 answers completed inside the measured window per
second of it (status and submits alike; ``status_per_s``/``submit_per_s`` split it);
``p50_ms``/``p99_ms`` (all kinds), ``status_p99_ms``/``submit_p99_ms``: send-to-answer
latency of those answers; ``server_cpu_ms_per_request``, ``db_cpu_ms_per_request``,
``client_cpu_ms_per_request``: CPU of the servers (all replicas), of the PostgreSQL
backends serving the database (a local server; None for SQLite) and of the load
generator over the whole step (warm-up included) per 200 answer of the step;
``machine_busy_pct``: the cores' busy share over the step, everyone's (/proc/stat).
(The open mode reports the same CPU figures over its timed phase.)
``saturation_rps`` (and ``status_saturation_rps``/``mix_saturation_rps``) = the highest
``requests_per_s`` of a step within the p99 bound, ``saturation_clients`` its ``c``.

Several replicas: ``--replicas N --db postgresql://...`` starts N servers on that
(empty or shared) PostgreSQL database; ``--sqlite-baseline`` first measures one server
on a temp SQLite file in the same run. The password comes from ``ITO_DB_PASSWORD_FILE``
/ ``PGPASSWORD``, never argv. In closed mode the last line then carries
``saturation_ratio`` = replicas' status ``saturation_rps`` / SQLite's, and
``mix_saturation_ratio`` the same for the mix.

    .venv/bin/python benchmarks/api_load.py --clients 50 --duration 20 --interval 0.25
    .venv/bin/python benchmarks/api_load.py --mode closed --replicas 2 \\
        --db postgresql://ito@127.0.0.1:5432/ito --sqlite-baseline

Every line but the last is for people; the last is one JSON object (with
``--sqlite-baseline``: ``{"sqlite": {...}, "replicas": {...}, ...}``). Neither mode
expects any error: the exit status is 1, after the JSON line, when any request was
refused or lost (the codes and counts go to stderr). ``--profile PATH`` records the
first server with py-spy during the load (raw collapsed stacks) and prints the hottest
frames.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.api_load_setup import (
    confirmations,
    connect,
    cpu_seconds,
    db_cpu_seconds,
    hottest,
    make_tenant,
    manifest_body,
    pct,
    send,
    start_server,
    submit_sync,
)


class Target:
    """The servers of one store, its tenant, the polled run and the manifest to submit."""

    def __init__(self, urls: list[str], pids: list[int], db: str, t: dict[str, Any], tmp: Path):
        self.urls, self.pids, self.db, self.t = urls, pids, db, t
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


# --- open loop ----------------------------------------------------------------------


async def open_client(
    i: int,
    tg: Target,
    url: str,
    refs: list[str],
    args: argparse.Namespace,
    t_end: float,
    lat: dict[str, list[float]],
    errors: Counter[str],
) -> None:
    rng = random.Random(i)
    headers = {"Authorization": f"Bearer {tg.t['submitters'][i]}"}
    conn = connect(args.http, url, headers)
    try:
        # Submits at random moments of the run, so they meet polls from other clients.
        submit_at = sorted(rng.uniform(0, args.duration * 0.9) for _ in refs)
        start = time.monotonic()
        await asyncio.sleep(rng.uniform(0, max(args.interval, 0.01)))  # de-synchronise
        # Each client keeps its own random phase: polls are due interval apart from the
        # client's first poll (from the common start they re-align into bursts).
        phase = time.monotonic()
        n = 0
        # Submits go out on their own connection at their due moments, so a poll in
        # progress on this client's connection never delays them.
        submits = asyncio.create_task(
            open_submits(i, tg, url, headers, refs, submit_at, start, args, lat, errors)
        )
        path = f"/v1/runs/{tg.run_id}"
        while time.monotonic() < t_end:
            sent = time.monotonic()
            due = phase + n * args.interval if args.interval > 0 else sent
            ok = await send(conn, "status", "GET", path, errors)
            done = time.monotonic()
            if ok:  # refusals are counted in errors, never timed
                lat["status"].append(done - min(due, sent))
                lat["status_service"].append(done - sent)
            n += 1
            if args.interval > 0:
                # Fixed rate: the next poll is due interval after the last was due.
                await asyncio.sleep(max(0.0, phase + n * args.interval - time.monotonic()))
        await submits
    finally:
        await conn.close()


async def open_submits(
    i: int,
    tg: Target,
    url: str,
    headers: dict[str, str],
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
        conn = connect(args.http, url, headers)
        try:
            ref = refs.pop()
            key = {"Idempotency-Key": f"bench-{i}-{os.urandom(6).hex()}"}
            sent = time.monotonic()
            ok = await send(conn, "submit", "POST", "/v1/runs", errors, tg.payload(ref), key)
            done = time.monotonic()
            if ok:
                lat["submit"].append(done - due)
                lat["submit_service"].append(done - sent)
        finally:
            await conn.close()


async def open_load(tg: Target, refs: list[str], args: argparse.Namespace) -> dict[str, Any]:
    lat: dict[str, list[float]] = {
        k: [] for k in ("status", "submit", "status_service", "submit_service")
    }
    errors: Counter[str] = Counter()
    per_client = [refs[i :: args.clients] for i in range(args.clients)]
    t0 = time.monotonic()
    t_end = t0 + args.duration
    await asyncio.gather(
        *(
            open_client(i, tg, tg.urls[i % len(tg.urls)], per_client[i], args, t_end, lat, errors)
            for i in range(args.clients)
        )
    )
    elapsed = time.monotonic() - t0
    total = len(lat["status"]) + len(lat["submit"])
    return {
        "mode": "open",
        "clients": args.clients,
        "replicas": len(tg.urls),
        "status_p50_ms": pct(lat["status"], 50),
        "status_p99_ms": pct(lat["status"], 99),
        "submit_p50_ms": pct(lat["submit"], 50),
        "submit_p99_ms": pct(lat["submit"], 99),
        "status_service_p99_ms": pct(lat["status_service"], 99),
        "submit_service_p99_ms": pct(lat["submit_service"], 99),
        "requests_per_s": round(total / elapsed, 1),
        "status_requests": len(lat["status"]),
        "submit_requests": len(lat["submit"]),
        "status_mean_ms": round(statistics.fmean(lat["status"]) * 1000, 2)
        if lat["status"]
        else None,
        "interval_s": args.interval,
        "duration_s": round(elapsed, 2),
        "errors": dict(errors),
    }


def run_open(tg: Target, args: argparse.Namespace) -> dict[str, Any]:
    refs = confirmations(tg.urls[0], tg.t, tg.body, args.submits)
    before = tg.cpu()
    result = asyncio.run(open_load(tg, refs, args))
    n = result["status_requests"] + result["submit_requests"]
    result.update(tg.cpu_per_request(before, n))
    print(
        f"status  p50 {result['status_p50_ms']} ms  p99 {result['status_p99_ms']} ms  "
        f"(n={result['status_requests']})\n"
        f"submit  p50 {result['submit_p50_ms']} ms  p99 {result['submit_p99_ms']} ms  "
        f"(n={result['submit_requests']})\n"
        f"requests/s {result['requests_per_s']}  errors {result['errors']}  server CPU "
        f"{result['server_cpu_ms_per_request']} ms/request"
    )
    return result


# --- closed loop --------------------------------------------------------------------


async def closed_step(
    tg: Target, pool: list[str], c: int, submit_every: int, args: argparse.Namespace
) -> tuple[dict[str, list[float]], Counter[str], int]:
    """``c`` clients back to back for warm-up + step; (latencies of the 200 answers
    completed in the measured window by kind, errors of the whole step, 200 answers of
    the whole step)."""
    lat: dict[str, list[float]] = {"status": [], "submit": []}
    errors: Counter[str] = Counter()
    answered = [0]
    keys = itertools.cycle(tg.t["submitters"])  # shared: each request takes the next
    path = f"/v1/runs/{tg.run_id}"
    t_start = time.monotonic() + args.warmup_s
    t_end = t_start + args.step_s

    async def client(i: int) -> None:
        conn = connect(args.http, tg.urls[i % len(tg.urls)], {})
        # Each client's submits fall at its own offset in the cycle.
        n = random.Random(i).randrange(submit_every) if submit_every else 0
        try:
            while time.monotonic() < t_end:
                n += 1
                auth = {"Authorization": f"Bearer {next(keys)}"}
                sent = time.monotonic()
                if submit_every and n % submit_every == 0:
                    if not pool:
                        errors["submit no confirmation left (raise the pool's margin)"] += 1
                        return
                    kind = "submit"
                    hdrs = {**auth, "Idempotency-Key": f"bench-{os.urandom(8).hex()}"}
                    payload = tg.payload(pool.pop())
                    ok = await send(conn, kind, "POST", "/v1/runs", errors, payload, hdrs)
                else:
                    kind = "status"
                    ok = await send(conn, kind, "GET", path, errors, headers=auth)
                done = time.monotonic()
                if ok:
                    answered[0] += 1
                    if t_start <= done <= t_end:
                        lat[kind].append(done - sent)
        finally:
            await conn.close()

    await asyncio.gather(*(client(i) for i in range(c)))
    return lat, errors, answered[0]


def closed_sweep(
    tg: Target, name: str, submit_every: int, args: argparse.Namespace, est_rps: float
) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    errors: Counter[str] = Counter()
    pool: list[str] = []
    best_rps, flat, c = 0.0, 0, 1
    while c <= args.clients_max:
        if submit_every:
            # Enough confirmations for the step at the status reads' saturation, twice
            # over (a mix answers fewer requests per second than reads alone).
            need = math.ceil(2 * est_rps * (args.warmup_s + args.step_s) / submit_every) + c
            pool.extend(confirmations(tg.urls[0], tg.t, tg.body, max(0, need - len(pool))))
        before = tg.cpu()
        lat, errs, answered = asyncio.run(closed_step(tg, pool, c, submit_every, args))
        both = lat["status"] + lat["submit"]
        step = {
            "clients": c,
            "requests_per_s": round(len(both) / args.step_s, 1),
            "status_per_s": round(len(lat["status"]) / args.step_s, 1),
            "submit_per_s": round(len(lat["submit"]) / args.step_s, 1),
            "p50_ms": pct(both, 50),
            "p99_ms": pct(both, 99),
            "status_p99_ms": pct(lat["status"], 99),
            "submit_p99_ms": pct(lat["submit"], 99),
            **tg.cpu_per_request(before, answered),
            "errors": dict(errs),
        }
        steps.append(step)
        errors.update(errs)
        print(
            f"  {name:6} c={c:<3} {step['requests_per_s']:8.1f} req/s  p50 {step['p50_ms']} "
            f"ms  p99 {step['p99_ms']} ms  CPU/req: server {step['server_cpu_ms_per_request']} "
            f"db {step['db_cpu_ms_per_request']} client {step['client_cpu_ms_per_request']} ms  "
            f"busy "
            f"{step['machine_busy_pct']}%  errors {step['errors']}",
            flush=True,
        )
        if errs or step["p99_ms"] is None or step["p99_ms"] > args.p99_bound_ms:
            step["over_bound"] = True
            break
        if step["requests_per_s"] > best_rps * (1 + args.plateau):
            flat = 0
        else:
            flat += 1
        best_rps = max(best_rps, step["requests_per_s"])
        if flat >= args.patience:
            break
        c *= 2
    within = [s for s in steps if not s.get("over_bound")]
    peak = max(within, key=lambda s: s["requests_per_s"]) if within else None
    return {
        "saturation_rps": peak["requests_per_s"] if peak else None,
        "saturation_clients": peak["clients"] if peak else None,
        "steps": steps,
        "errors": dict(errors),
    }


def run_closed(tg: Target, args: argparse.Namespace) -> dict[str, Any]:
    status = closed_sweep(tg, "status", 0, args, 0.0)
    mix = closed_sweep(tg, "mix", args.submit_every, args, status["saturation_rps"] or 100.0)
    return {
        "mode": "closed",
        "replicas": len(tg.urls),
        "status_saturation_rps": status["saturation_rps"],
        "mix_saturation_rps": mix["saturation_rps"],
        "submit_every": args.submit_every,
        "status": status,
        "mix": mix,
        "errors": dict(Counter(status["errors"]) + Counter(mix["errors"])),
    }


# --- one store ----------------------------------------------------------------------


def measure(args: argparse.Namespace, db: str | None, replicas: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ito-api-load-"))
    store = db or str(tmp / "ito.db")
    kind = "postgresql" if store.startswith("postgresql://") else "sqlite"
    servers: list[tuple[subprocess.Popen[bytes], str]] = []
    spy: subprocess.Popen[bytes] | None = None
    try:
        for i in range(replicas):
            servers.append(
                start_server(tmp, args.server_log_level, args.server_module, store, f"server{i}")
            )
        keys = args.clients if args.mode == "open" else args.keys
        urls, pids = [u for _, u in servers], [p.pid for p, _ in servers]
        tg = Target(urls, pids, store, make_tenant(store, keys), tmp)
        print(f"{kind} x{replicas}, {args.mode} loop", flush=True)
        if args.profile is not None:
            spy = subprocess.Popen(
                [
                    shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                    *("record", "--pid", str(servers[0][0].pid), "--format", "raw"),
                    *("--nonblocking", "--rate", "200", "--output", str(args.profile)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # let py-spy attach
        result = (run_open if args.mode == "open" else run_closed)(tg, args)
        result = {"store": kind, **result, "load_avg_1m": os.getloadavg()[0]}
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            spy.wait(timeout=60)
    finally:
        for p, _ in servers:
            p.terminate()
        for p, _ in servers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.profile is not None and args.profile.exists():
        own, incl = hottest(args.profile)
        print("server self time (py-spy):")
        for frame, share in own:
            print(f"  {share:5.1f}%  {frame}")
        print("server inclusive time (py-spy):")
        for frame, share in incl:
            print(f"  {share:5.1f}%  {frame}")
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = ap.add_argument
    add("--mode", choices=["open", "closed"], default="open", help="fixed rate or saturation")
    add("--clients", type=int, default=50, help="open: clients, each with its own key")
    add("--duration", type=float, default=20.0, help="open: seconds of timed load")
    add("--interval", type=float, default=0.25, help="open: s between a client's polls")
    add("--submits", type=int, default=100, help="open: submits in total")
    add("--clients-max", type=int, default=64, help="closed: the sweep's last concurrency")
    add("--step-s", type=float, default=5.0, help="closed: measured seconds per step")
    add("--warmup-s", type=float, default=1.0, help="closed: unmeasured seconds per step")
    add("--plateau", type=float, default=0.05, help="closed: a step must beat the best by")
    add("--patience", type=int, default=1, help="closed: steps without that gain to stop")
    add("--p99-bound-ms", type=float, default=1000.0, help="closed: a step's p99 at most")
    add("--submit-every", type=int, default=40, help="closed mix: a submit every Nth request")
    add("--keys", type=int, default=64, help="closed: submitter keys the requests rotate")
    add("--server-log-level", default="warning")
    add("--http", choices=["raw", "httpx"], default="raw", help="load generator's client")
    add("--profile", type=Path, default=None, help="py-spy raw output path")
    add(
        "--server-module",
        default="orchestrator.admin",
        help="module run as `python -m MODULE serve ...` (A/B a patched server)",
    )
    add("--replicas", type=int, default=1, help="API servers on one store")
    add(
        "--db",
        default=None,
        help="the store (default: a temp SQLite file); postgresql://... for replicas, "
        "without a password",
    )
    add(
        "--sqlite-baseline",
        action="store_true",
        help="first measure one server on a temp SQLite file, in the same run",
    )
    args = ap.parse_args()
    if args.replicas > 1 and not (args.db or "").startswith("postgresql://"):
        ap.error("--replicas > 1 needs --db postgresql://... (SQLite has one writer host)")
    runs: list[dict[str, Any]]
    if args.sqlite_baseline:
        base, rep = measure(args, None, 1), measure(args, args.db, args.replicas)
        runs = [base, rep]
        out: dict[str, Any] = {"mode": args.mode, "sqlite": base, "replicas": rep}
        if args.mode == "closed":
            out["saturation_ratio"] = ratio(
                rep["status_saturation_rps"], base["status_saturation_rps"]
            )
            out["mix_saturation_ratio"] = ratio(
                rep["mix_saturation_rps"], base["mix_saturation_rps"]
            )
            print(f"saturation_ratio {out['saturation_ratio']}  mix {out['mix_saturation_ratio']}")
    else:
        out = measure(args, args.db, args.replicas)
        runs = [out]
    out["cpus"] = os.cpu_count()
    print(json.dumps(out))
    unexpected = [(r["store"], r["replicas"], r["errors"]) for r in runs if r["errors"]]
    if unexpected:
        for store, n, errs in unexpected:
            for what, count in sorted(errs.items()):
                print(f"unexpected error: {store} x{n}: {what}: {count}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
