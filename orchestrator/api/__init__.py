"""The canonical HTTP API (FastAPI): ``create_app(settings, runtime=None)``."""

from orchestrator.api.app import create_app

__all__ = ["create_app"]
