"""``python -m orchestrator.api > docs/openapi.json`` regenerates the committed schema."""

from orchestrator.api.app import openapi_document

print(openapi_document(), end="")
