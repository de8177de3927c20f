"""The run's secret: made once per run by its driver, handed to the run's actors through
Ray, proven on the run's own listeners (``stages.netsec``) and never sent there."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunSecret:
    """32 random bytes made once per run by its driver and handed to the run's actors
    through Ray. Never logged, stored, put in an event or in an environment."""

    value: bytes = field(repr=False)

    @classmethod
    def new(cls) -> RunSecret:
        return cls(secrets.token_bytes(32))

    def derive(self, purpose: str) -> bytes:
        """A key for one purpose (``"weight-sync"``, ``"heal"``, ``"store"``...)."""
        return hmac.new(self.value, b"ito-run-key:" + purpose.encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "RunSecret(<hidden>)"
