"""HTTP flows against a backend: confirm, submit, plan (envelopes returned as dicts)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from helpers.manifests import manifest_payload


def confirm(
    client: httpx.Client,
    approver_key: str,
    action: str,
    booking_id: str,
    cost_usd: float = 100.0,
    manifest: dict[str, Any] | bytes | None = None,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "action": action,
        "booking_id": booking_id,
        "cost_usd": cost_usd,
        **extra,
    }
    if manifest is not None:
        body.update(manifest_payload(manifest))
    r = client.post(
        "/v1/confirmations", json=body, headers={"Authorization": f"Bearer {approver_key}"}
    )
    out: dict[str, Any] = r.json()
    return out


def confirm_ref(
    client: httpx.Client, approver_key: str, action: str, booking_id: str, **kw: Any
) -> str:
    env = confirm(client, approver_key, action, booking_id, **kw)
    assert env["ok"], env
    ref: str = env["data"]["confirmation_ref"]
    return ref


def submit(
    client: httpx.Client,
    submitter_key: str,
    booking_id: str,
    manifest: dict[str, Any] | bytes,
    ref: str,
    idempotency_key: str | None = None,
) -> httpx.Response:
    return client.post(
        "/v1/runs",
        json={"booking_id": booking_id, "confirmation_ref": ref, **manifest_payload(manifest)},
        headers={
            "Authorization": f"Bearer {submitter_key}",
            "Idempotency-Key": idempotency_key or f"key-{uuid.uuid4().hex}",
        },
    )


def submit_run(
    client: httpx.Client,
    tenant: Any,
    booking_id: str,
    manifest: dict[str, Any],
    idempotency_key: str | None = None,
) -> str:
    """Confirm ``manifest`` with the tenant's approver key, submit it with its
    submitter key (``tenant``: a ``helpers.tenants.Tenant``), and return the run id."""
    ref = confirm_ref(client, tenant.approver, "train", booking_id, manifest=manifest)
    body = submit(client, tenant.submitter, booking_id, manifest, ref, idempotency_key).json()
    assert body["ok"], body
    run_id: str = body["data"]["run_id"]
    return run_id
