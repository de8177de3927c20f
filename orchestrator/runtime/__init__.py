"""Runs on Ray: the supervisor inside the API server, the per-run driver,
the pipeline built from a manifest."""
