"""The store: SQLite (WAL) and its versioned schema; only the API server writes it."""
