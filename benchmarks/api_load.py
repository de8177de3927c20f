"""API load benchmark: status reads and submits against real servers, open or closed loop.

Starts real ``ito-backend serve`` subprocesses on loopback (``--runtime none``: runs
stay ``accepted``; the planner gate is on, so a submit costs what it costs in
production) and makes one tenant: a fresh account with submitter keys, approver keys
and a live booking, one run to poll, and the train confirmations the submits consume
(made by the approvers before each timed load: confirming is their step, not load). The
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
``--warmup-s`` then ``--step-s`` measured seconds, and the sweep stops once its
throughput has not risen ``--plateau`` above the best so far for ``--patience`` steps
in a row (side by side: every store's), or, for that store, once a step's p99 passes
``--p99-bound-ms`` or it saw an error. Two sweeps per store:

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
(empty or shared) PostgreSQL database; ``--sqlite-baseline`` also starts one server on
a temp SQLite file and measures both in the same run: the open mode one after the
other, the closed mode side by side (at each concurrency the stores take turns, the
first to go alternating, so a change in the machine's other load falls on both alike).
The password comes from ``ITO_DB_PASSWORD_FILE`` / ``PGPASSWORD``, never argv. In
closed mode the last line then carries ``saturation_ratio`` = the replicas' status
``saturation_rps`` / SQLite's, and ``mix_saturation_ratio`` the same for the mix.

    .venv/bin/python benchmarks/api_load.py --clients 50 --duration 20 --interval 0.25
    .venv/bin/python benchmarks/api_load.py --mode closed --replicas 2 \\
        --db postgresql://ito@127.0.0.1:5432/ito --sqlite-baseline

Every line but the last is for people; the last is one JSON object (with
``--sqlite-baseline``: ``{"sqlite": {...}, "replicas": {...}, ...}``). Neither mode
expects any error: the exit status is 1, after the JSON line, when any request was
refused or lost (the codes and counts go to stderr). ``--profile PATH`` records the
measured store's first server (the replicas' with ``--sqlite-baseline``) with py-spy
during the load (raw collapsed stacks) and prints the hottest frames.
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
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.api_load_setup import (
    Target,
    confirmations,
    connect,
    hottest,
    pct,
    send,
    serving,
)

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
        "http": args.http,
        "duration_s": round(elapsed, 2),
        "errors": dict(errors),
    }


def run_open(tg: Target, args: argparse.Namespace) -> dict[str, Any]:
    refs = confirmations(tg.urls[0], tg.t, tg.body, args.submits)
    before = tg.cpu()
    result = asyncio.run(open_load(tg, refs, args))
    n = result["status_requests"] + result["submit_requests"]
    result.update(tg.cpu_per_request(before, n), load_avg_1m=round(os.getloadavg()[0], 2))
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


class Sweep:
    """One store's closed-loop sweep of one workload: a step per concurrency until the
    throughput stops rising (``--plateau``, ``--patience``), p99 passes its bound or a
    request fails."""

    def __init__(
        self, tg: Target, name: str, submit_every: int, args: argparse.Namespace, est_rps: float
    ):
        self.tg, self.name, self.submit_every, self.args = tg, name, submit_every, args
        self.est_rps = est_rps
        self.steps: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.pool: list[str] = []
        self.best_rps, self.flat = 0.0, 0
        # Past the p99 bound or with an error: no further step.
        self.stopped = False

    def step(self, c: int) -> None:
        args, tg = self.args, self.tg
        if self.submit_every:
            # Enough confirmations for the step at the status reads' saturation, twice
            # over (a mix answers fewer requests per second than reads alone).
            window = args.warmup_s + args.step_s
            need = math.ceil(2 * self.est_rps * window / self.submit_every) + c
            self.pool.extend(
                confirmations(tg.urls[0], tg.t, tg.body, max(0, need - len(self.pool)))
            )
        before = tg.cpu()
        lat, errs, answered = asyncio.run(closed_step(tg, self.pool, c, self.submit_every, args))
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
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "errors": dict(errs),
        }
        self.steps.append(step)
        self.errors.update(errs)
        print(
            f"  {tg.label:13} {self.name:6} c={c:<3} {step['requests_per_s']:7.1f} req/s  "
            f"p50 {step['p50_ms']} ms  p99 {step['p99_ms']} ms  CPU ms/req: server "
            f"{step['server_cpu_ms_per_request']} db {step['db_cpu_ms_per_request']} client "
            f"{step['client_cpu_ms_per_request']}  busy {step['machine_busy_pct']}%  load "
            f"{step['load_avg_1m']}  errors {step['errors']}",
            flush=True,
        )
        if errs or step["p99_ms"] is None or step["p99_ms"] > args.p99_bound_ms:
            step["over_bound"] = True
            self.stopped = True
            return
        self.flat = (
            0 if step["requests_per_s"] > self.best_rps * (1 + args.plateau) else self.flat + 1
        )
        self.best_rps = max(self.best_rps, step["requests_per_s"])

    @property
    def flat_out(self) -> bool:
        """No step rose by ``--plateau`` for ``--patience`` steps (or it stopped)."""
        return self.stopped or self.flat >= self.args.patience

    def result(self) -> dict[str, Any]:
        within = [s for s in self.steps if not s.get("over_bound")]
        peak = max(within, key=lambda s: s["requests_per_s"]) if within else None
        return {
            "saturation_rps": peak["requests_per_s"] if peak else None,
            "saturation_clients": peak["clients"] if peak else None,
            "steps": self.steps,
            "errors": dict(self.errors),
        }


def sweep_side_by_side(
    targets: list[Target], name: str, submit_every: int, args: argparse.Namespace, est: list[float]
) -> list[dict[str, Any]]:
    """Each store's sweep at the same concurrencies, the stores taking turns at each
    (the first to go alternates), so a change in the machine's other load falls on both
    alike; it goes on while any store's throughput still rises (one noisy step does not
    end a store's sweep early)."""
    sweeps = [Sweep(tg, name, submit_every, args, e) for tg, e in zip(targets, est, strict=True)]
    c, level = 1, 0
    while c <= args.clients_max and not all(s.flat_out for s in sweeps):
        for s in sweeps if level % 2 == 0 else sweeps[::-1]:
            if not s.stopped:
                s.step(c)
        c, level = c * 2, level + 1
    return [s.result() for s in sweeps]


def run_closed(targets: list[Target], args: argparse.Namespace) -> list[dict[str, Any]]:
    status = sweep_side_by_side(targets, "status", 0, args, [0.0] * len(targets))
    est = [s["saturation_rps"] or 100.0 for s in status]
    mix = sweep_side_by_side(targets, "mix", args.submit_every, args, est)
    return [
        {
            "mode": "closed",
            "status_saturation_rps": st["saturation_rps"],
            "mix_saturation_rps": mx["saturation_rps"],
            "submit_every": args.submit_every,
            "status": st,
            "mix": mx,
            "errors": dict(Counter(st["errors"]) + Counter(mx["errors"])),
        }
        for st, mx in zip(status, mix, strict=True)
    ]


# --- the run ------------------------------------------------------------------------


def profiled(pid: int, out: Path) -> subprocess.Popen[bytes]:
    spy = subprocess.Popen(
        [
            shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
            *("record", "--pid", str(pid), "--format", "raw", "--nonblocking"),
            *("--rate", "200", "--output", str(out)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # let py-spy attach
    return spy


def print_profile(raw: Path) -> None:
    own, incl = hottest(raw)
    print("server self time (py-spy):")
    for frame, share in own:
        print(f"  {share:5.1f}%  {frame}")
    print("server inclusive time (py-spy):")
    for frame, share in incl:
        print(f"  {share:5.1f}%  {frame}")


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
    add("--patience", type=int, default=2, help="closed: steps without that gain to stop")
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
    specs = ([(None, 1)] if args.sqlite_baseline else []) + [(args.db, args.replicas)]
    keys = args.clients if args.mode == "open" else args.keys
    spy: subprocess.Popen[bytes] | None = None
    with ExitStack() as stack:
        targets = [
            stack.enter_context(serving(db, n, keys, args.server_log_level, args.server_module))
            for db, n in specs
        ]
        if args.profile is not None:  # the measured store's first server
            spy = profiled(targets[-1].pids[0], args.profile)
        if args.mode == "open":
            runs = []
            for tg in targets:
                print(f"{tg.label}, open loop", flush=True)
                runs.append(run_open(tg, args))
        else:
            print(" / ".join(tg.label for tg in targets) + ", closed loop", flush=True)
            runs = run_closed(targets, args)
        for tg, r in zip(targets, runs, strict=True):
            r.update(store=tg.kind, replicas=len(tg.urls))
            r.setdefault("load_avg_1m", round(os.getloadavg()[0], 2))
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            spy.wait(timeout=60)
    if args.profile is not None and args.profile.exists():
        print_profile(args.profile)
    if args.sqlite_baseline:
        base, rep = runs
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
        [out] = runs
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
