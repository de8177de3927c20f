"""Settings of the API server and the admin CLI: every limit and timeout is named here."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.db.engines import StoreLimits
from orchestrator.db.store import Store
from stages.presets import configs_dir


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # The store: a SQLite file (embedded) or a ``postgresql://`` URL (several replicas).
    db_path: Path | str
    # Scratch space of runs (``<var_dir>/runs/<run_id>``); cleanup removes it.
    var_dir: Path = Path("/tmp/ito-var")
    configs_dir: Path = Field(default_factory=configs_dir)
    # Server-wide checkpoint roots added to every account's own (``ito-backend accounts
    # roots``); with neither, checkpoint storage is refused (there is no "any path").
    checkpoint_roots: tuple[Path, ...] = ()
    allowed_data_schemes: tuple[str, ...] = ("file",)
    # How long a store call may wait (SQLite's lock, PostgreSQL's pool, connect and
    # statements) before it answers 503 store_unavailable, and the Retry-After it gives.
    store: StoreLimits = Field(default_factory=StoreLimits)
    confirmation_ttl_default_s: int = Field(default=600, gt=0)
    confirmation_ttl_max_s: int = Field(default=900, gt=0)
    # An eligibility answer is fresh for this long (and never past the term end).
    eligibility_ttl_s: int = Field(default=60, gt=0)
    # Upper bound on a manifest's bytes (the client caps it too).
    max_manifest_bytes: int = Field(default=1 << 20, gt=0)
    # Whole request bodies above this are refused before parsing.
    max_body_bytes: int = Field(default=2 << 20, gt=0)
    # Model FLOPs utilisation assumed by the cost estimate until the planner lands.
    assumed_mfu: float = Field(default=0.4, gt=0, le=1)
    # The same for RLVR rollout generation, which decodes token by token and is bound
    # by memory bandwidth, not FLOPs: priced at a far lower utilisation.
    assumed_rollout_mfu: float = Field(default=0.1, gt=0, le=1)
    logs_page_max: int = Field(default=1000, gt=0)
    # Runs an account may have active (queued, starting, running, awaiting approval or
    # cancelling) at once; one more is refused with too_many_active_runs. Each active
    # run holds the booking's nodes or waits for them.
    max_active_runs_per_account: int = Field(default=64, ge=1, le=100_000)
    # Worker threads for the sync route handlers (see orchestrator/api/app.py).
    request_threads: int = Field(default=4, ge=1, le=64)
    # Refuse at submit what the parallelism planner refuses, price from its step time
    # and store its plan on the run (off: the plan is advisory in POST /v1/plans and
    # the run's parallelism stage gates it).
    # The parallelism planner is a server-side gate: what it refuses never becomes a run.
    planner_gate: bool = True
    # --- tenant isolation and bounds -----------------------------------------------
    # The Prometheus scrape has its own listener (None: not served); loopback by default,
    # with an optional bearer token (never on the API socket, which tenants reach).
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, lt=65536)
    metrics_token: str | None = Field(default=None, min_length=16, repr=False)
    # Serve /openapi.json, /docs and /redoc only where the operator enables them.
    api_docs: bool = False
    # The planner's layout search gives up after this long (plan_time_budget_exceeded).
    plan_time_budget_s: float = Field(default=2.0, gt=0, le=60)
    # Rate limits (token buckets): per API key, and per client address for requests
    # that fail authentication. Over the limit: 429 rate_limited with Retry-After.
    rate_key_per_s: float = Field(default=50.0, gt=0)
    rate_key_burst: int = Field(default=200, ge=1)
    rate_auth_fail_per_s: float = Field(default=2.0, gt=0)
    rate_auth_fail_burst: int = Field(default=20, ge=1)
    # Unauthenticated failures are audited as one counted row per (address class, code)
    # per window, written by one transaction, not one row per request.
    auth_fail_audit_window_s: float = Field(default=5.0, gt=0)
    # --- the HTTP server under abuse (orchestrator/api/serving.py) --------------------
    # Open client connections at most. Each is a file descriptor: without a cap a flood
    # of idle sockets exhausts the process's descriptors, accept() fails for everyone
    # and asyncio logs every failure. At the cap, the oldest connection that has not
    # sent a complete request head (half-open, dribbling, idle keep-alive) is closed to
    # admit the new one; with none such, the new one is closed at once. The server
    # clamps this to its descriptor limit less ``fd_reserve``.
    max_connections: int = Field(default=4096, ge=8, le=1_000_000)
    # The kernel's queue of connections not yet accepted; asyncio also accepts up to
    # this many at once before any is seen (and closed) by the connection cap, so the
    # descriptor budget keeps room for it.
    listen_backlog: int = Field(default=128, ge=16, le=65535)
    # Descriptors kept for everything but client connections (store connections, log
    # files, Ray, the metrics listener): the connection cap never eats into them.
    fd_reserve: int = Field(default=256, ge=32)
    # A connection must deliver a complete request head this soon after it opens (or
    # after its previous response): a client that sends nothing, or dribbles a header
    # a byte at a time, is closed after this (uvicorn has no such timeout).
    header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    # A request body must arrive whole this soon after its head (max_body_bytes in this
    # long is ~70 KB/s at the defaults): a slow-body client cannot hold a handler.
    body_timeout_s: float = Field(default=30.0, gt=0, le=600)
    # An idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive).
    keep_alive_timeout_s: float = Field(default=5.0, gt=0, le=300)
    # Protocol-level log lines (malformed requests, timeouts, refused connections,
    # accept errors) are kept to this many per kind per window, then one line that
    # counts the rest: a flood of bad connections grows the log boundedly.
    protocol_log_burst: int = Field(default=10, ge=1)
    protocol_log_window_s: float = Field(default=60.0, gt=0)
    # Plan validations (POST /v1/plans, and the same work in a train confirmation and
    # POST /v1/runs) one account may have in flight on this replica; beyond: 429
    # too_many_concurrent_plans with Retry-After. The work holds the GIL (parsing and
    # scanning up to a 1 MiB manifest): measured under a flood of one account's 1 MiB
    # plans, another account's plan took ~1 s at a bound of 1, ~2-5 s at 2 and up to
    # 7 s unbounded (tests/api/test_server_abuse.py). Above request_threads the bound
    # never bites (at most request_threads handlers hold a slot); at request_threads a
    # request that arrives while every handler works for the account is refused.
    plans_in_flight_per_account: int = Field(default=1, ge=1, le=64)
    plan_retry_after_s: int = Field(default=1, ge=1, le=60)
    # On SIGTERM the server stops accepting, lets requests finish for at most this long,
    # then exits (uvicorn's timeout_graceful_shutdown).
    shutdown_grace_s: float = Field(default=10.0, gt=0, le=300)


def open_store(settings: Settings) -> Store:
    """The server's store, with its limits and audit window."""
    store = Store(settings.db_path, settings.store)
    store.counted_window_s = settings.auth_fail_audit_window_s
    return store
