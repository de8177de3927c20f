"""Request bodies (strict, extra fields forbidden)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_ID = r"^[A-Za-z0-9_.:-]{1,128}$"
_DIGEST = r"^[0-9a-fA-F]{64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfirmationRequest(_Body):
    action: Literal["train", "cancel", "cleanup", "release", "restart"]
    booking_id: str = Field(pattern=_ID)
    manifest_b64: str | None = Field(default=None, max_length=4 << 20)
    manifest_digest: str | None = Field(default=None, pattern=_DIGEST)
    run_id: str | None = Field(default=None, pattern=_ID)
    proposal_id: str | None = Field(default=None, pattern=_ID)
    cost_usd: float = Field(ge=0, le=1e12)
    ttl_s: int | None = Field(default=None, description="default 600, at most 900")


class PlanRequest(_Body):
    booking_id: str = Field(pattern=_ID)
    manifest_b64: str = Field(max_length=4 << 20)
    manifest_digest: str = Field(pattern=_DIGEST)


class RunRequest(PlanRequest):
    confirmation_ref: str = Field(max_length=256)


class MutationRequest(_Body):
    confirmation_ref: str = Field(max_length=256)
