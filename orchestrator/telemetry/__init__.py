"""Goodput telemetry: computed from persisted events, exported for Prometheus and `ito metrics`."""
