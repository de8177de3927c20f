"""The canonical client of the ito-train HTTP API (docs/api-contract.md).

Every method returns one envelope (a dict): the server's, or one the client made
with ``live_api_contacted: false`` when the server was never reached. Nothing
raises for a remote or transport failure.

The transport (timeouts, which failures may have reached the server, bounded
retries) is ``orchestrator/client/transport.py``; on top of it:

* ``train`` never creates a second run because a response was lost: after an
  ambiguous failure it looks the run up by idempotency key (``GET
  /v1/runs?idempotency_key=K``) before any retry; retries are bounded with
  exponential backoff and reuse the same key;
* polling (``follow_status``/``follow_logs``) stops at once on
  ``credential_revoked``/``unauthenticated``/``forbidden_scope``; it never tries
  to obtain a new credential.

Use one client per thread, not from inside a running event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from orchestrator.client.envelope import (
    STOP_POLLING_CODES,
    Envelope,
    error_code,
    error_envelope,
    ok_envelope,
)
from orchestrator.client.manifest_reader import ManifestBytes
from orchestrator.client.transport import ApiTransport
from stages.errors import ErrorCode

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "cleaned"})


class ItoClient(ApiTransport):
    """Typed calls over the v1 contract; every call returns an envelope."""

    # --- reads --------------------------------------------------------------------------
    def health(self) -> Envelope:
        return self._get("/healthz")

    def eligibility(self, booking_id: str) -> Envelope:
        return self._get(f"/v1/bookings/{_seg(booking_id)}/eligibility")

    def run(self, run_id: str) -> Envelope:
        return self._get(f"/v1/runs/{_seg(run_id)}")

    status = run

    def find_run_by_key(self, idempotency_key: str) -> Envelope:
        return self._get("/v1/runs", {"idempotency_key": idempotency_key})

    def logs(
        self, run_id: str, cursor: str | int | None = None, limit: int | None = None
    ) -> Envelope:
        params: dict[str, Any] = {"limit": limit or self.settings.logs_page_limit}
        if cursor is not None:
            params["cursor"] = cursor
        return self._get(f"/v1/runs/{_seg(run_id)}/logs", params)

    def metrics(self, run_id: str) -> Envelope:
        return self._get(f"/v1/runs/{_seg(run_id)}/metrics")

    def checkpoints(self, run_id: str) -> Envelope:
        return self._get(f"/v1/runs/{_seg(run_id)}/checkpoints")

    # --- inspection and confirmation ----------------------------------------------------
    def plan(self, booking_id: str, manifest: ManifestBytes) -> Envelope:
        body = {
            "booking_id": booking_id,
            "manifest_b64": manifest.b64,
            "manifest_digest": manifest.digest,
        }
        # Creates nothing server-side, so a retry after an ambiguous failure is harmless.
        res = self._once("POST", "/v1/plans", body=body)
        for attempt in range(1, self.settings.read_max_attempts):
            if res.kind == "answered":
                break
            self._backoff(attempt - 1)
            res = self._once("POST", "/v1/plans", body=body)
        return res.envelope

    def confirm(
        self,
        action: str,
        booking_id: str,
        *,
        cost_usd: float,
        manifest: ManifestBytes | None = None,
        run_id: str | None = None,
        proposal_id: str | None = None,
        ttl_s: int | None = None,
    ) -> Envelope:
        """The approver's call. Not retried: a lost answer leaves at most an unused,
        short-lived reference that authorizes nothing by itself."""
        body: dict[str, Any] = {"action": action, "booking_id": booking_id, "cost_usd": cost_usd}
        if manifest is not None:
            body["manifest_b64"] = manifest.b64
            body["manifest_digest"] = manifest.digest
        if run_id is not None:
            body["run_id"] = run_id
        if proposal_id is not None:
            body["proposal_id"] = proposal_id
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        res = self._once("POST", "/v1/confirmations", body=body)
        if res.kind == "not_sent":  # never reached the server: safe to try once more
            self._backoff(0)
            res = self._once("POST", "/v1/confirmations", body=body)
        return res.envelope

    # --- train --------------------------------------------------------------------------
    def train(
        self, booking_id: str, manifest: ManifestBytes, confirmation_ref: str, idempotency_key: str
    ) -> Envelope:
        """Submit a run; never creates a second run because a response was lost."""
        body = {
            "booking_id": booking_id,
            "manifest_b64": manifest.b64,
            "manifest_digest": manifest.digest,
            "confirmation_ref": confirmation_ref,
        }
        ambiguous = False
        last: Envelope | None = None
        for attempt in range(self.settings.train_max_attempts):
            if attempt:
                self._backoff(attempt - 1)
            if ambiguous:
                # The previous POST may have created the run: look before any retry.
                found, env = self._lookup(idempotency_key, booking_id, manifest.digest)
                if found != "absent":
                    if found == "unknown":
                        last = env
                        continue  # could not look: never re-POST blindly
                    return env
            res = self._once("POST", "/v1/runs", body=body, idempotency_key=idempotency_key)
            last = res.envelope
            if res.kind == "answered":
                if ambiguous and not res.envelope.get("ok"):
                    # e.g. confirmation_consumed because our lost earlier attempt won.
                    found, env = self._lookup(idempotency_key, booking_id, manifest.digest)
                    if found in ("found", "conflict"):
                        return env
                return res.envelope
            ambiguous = ambiguous or res.kind == "ambiguous"
        if ambiguous:
            found, env = self._lookup(idempotency_key, booking_id, manifest.digest)
            if found in ("found", "conflict", "stop"):
                return env
            return error_envelope(
                ErrorCode.ambiguous_transport_failure,
                f"no answer after {self.settings.train_max_attempts} attempts and the run "
                f"could not be shown absent; look it up with the same idempotency key "
                f"(GET /v1/runs?idempotency_key=...) before submitting again",
            )
        assert last is not None
        return last

    def _lookup(
        self, idempotency_key: str, booking_id: str, digest: str
    ) -> tuple[Literal["found", "absent", "conflict", "stop", "unknown"], Envelope]:
        """Find the run created under ``idempotency_key``, as a train answer."""
        env = self.find_run_by_key(idempotency_key)
        if not env.get("ok"):
            return ("stop" if error_code(env) in STOP_POLLING_CODES else "unknown"), env
        runs = env["data"].get("runs") or []
        if not runs:
            return "absent", env
        run = dict(runs[0])
        if run.get("booking_id") != booking_id or run.get("manifest_digest") != digest:
            return "conflict", error_envelope(
                ErrorCode.idempotency_conflict,
                "the idempotency key already names a run for another booking or manifest",
                live_api_contacted=True,
            )
        run["replayed"] = True
        return "found", ok_envelope(
            run, notice="the submit's answer was lost; the run was found by its idempotency key"
        )

    # --- other mutations ----------------------------------------------------------------
    def cancel(self, run_id: str, confirmation_ref: str, idempotency_key: str) -> Envelope:
        return self._keyed_post(
            f"/v1/runs/{_seg(run_id)}/cancel",
            {"confirmation_ref": confirmation_ref},
            idempotency_key,
        )

    def cleanup(self, run_id: str, confirmation_ref: str, idempotency_key: str) -> Envelope:
        return self._keyed_post(
            f"/v1/runs/{_seg(run_id)}/cleanup",
            {"confirmation_ref": confirmation_ref},
            idempotency_key,
        )

    def decide(
        self,
        run_id: str,
        proposal_id: str,
        decision: Literal["approve", "decline"],
        confirmation_ref: str,
        idempotency_key: str,
    ) -> Envelope:
        path = f"/v1/runs/{_seg(run_id)}/proposals/{_seg(proposal_id)}/{decision}"
        return self._keyed_post(path, {"confirmation_ref": confirmation_ref}, idempotency_key)

    def release(self, booking_id: str, confirmation_ref: str, idempotency_key: str) -> Envelope:
        return self._keyed_post(
            f"/v1/bookings/{_seg(booking_id)}/release",
            {"confirmation_ref": confirmation_ref},
            idempotency_key,
        )

    # --- polling ------------------------------------------------------------------------
    def follow_status(
        self,
        run_id: str,
        on_update: Callable[[Envelope], None] | None = None,
        *,
        with_progress: bool = False,
    ) -> Envelope:
        """Poll the run until a terminal state or a stop code; returns the last envelope.

        ``with_progress`` also reads the run's metrics while it is not terminal and puts
        ``{step, loss}`` under ``data.progress`` (for a readable display).
        """
        failures = 0
        path = f"/v1/runs/{_seg(run_id)}"
        while True:
            res = self._once("GET", path)
            env = res.envelope
            if error_code(env) in STOP_POLLING_CODES:
                _notify(on_update, env)
                return env
            if res.kind == "answered":
                if not env.get("ok"):
                    _notify(on_update, env)
                    return env
                failures = 0
                if env["data"].get("state") in TERMINAL_STATES:
                    _notify(on_update, env)
                    return env
                if with_progress:
                    m = self._once("GET", f"{path}/metrics").envelope
                    if error_code(m) in STOP_POLLING_CODES:
                        _notify(on_update, m)
                        return m
                    if m.get("ok"):
                        md = m["data"]
                        step = md.get("last_step", md.get("committed_steps"))
                        env["data"]["progress"] = {"step": step, "loss": md.get("last_loss")}
                _notify(on_update, env)
            else:
                _notify(on_update, env)
                failures += 1
                if failures >= self.settings.follow_max_transport_failures:
                    return env
            self._sleep(self.settings.poll_interval_s)

    def follow_logs(
        self,
        run_id: str,
        on_entries: Callable[[list[dict[str, Any]]], None],
        cursor: str | int | None = None,
    ) -> Envelope:
        """Stream log pages until the run is terminal and drained; returns the last envelope
        (the run's, on success), with ``data.next_cursor`` set to where reading stopped."""
        failures = 0
        terminal_seen = False
        while True:
            res = self._once(
                "GET",
                f"/v1/runs/{_seg(run_id)}/logs",
                params=_drop_none({"cursor": cursor, "limit": self.settings.logs_page_limit}),
            )
            env = res.envelope
            if error_code(env) in STOP_POLLING_CODES or (res.kind == "answered" and not env["ok"]):
                return env
            if res.kind != "answered":
                failures += 1
                if failures >= self.settings.follow_max_transport_failures:
                    return env
                self._sleep(self.settings.poll_interval_s)
                continue
            failures = 0
            entries = env["data"].get("entries") or []
            if entries:
                on_entries(entries)
            cursor = env["data"].get("next_cursor", cursor)
            if len(entries) >= self.settings.logs_page_limit:
                continue  # more pages already there
            if terminal_seen:
                run_env = self.run(run_id)
                if run_env.get("ok"):
                    run_env["data"]["next_cursor"] = cursor
                return run_env
            run_env = self._once("GET", f"/v1/runs/{_seg(run_id)}").envelope
            if error_code(run_env) in STOP_POLLING_CODES:
                return run_env
            if run_env.get("ok") and run_env["data"].get("state") in TERMINAL_STATES:
                terminal_seen = True  # one more drain, then stop
                continue
            self._sleep(self.settings.poll_interval_s)


def _notify(cb: Callable[[Envelope], None] | None, env: Envelope) -> None:
    if cb is not None:
        cb(env)


def _seg(value: str) -> str:
    """A path segment: ids are opaque, so escape anything that could change the path."""
    from urllib.parse import quote

    return quote(str(value), safe="")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
