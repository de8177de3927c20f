"""The store (SQLite embedded, or PostgreSQL shared by API replicas) and its versioned
schema; only the control plane (API replicas, the lease-holding supervisor) writes it."""
