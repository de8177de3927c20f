"""parallelism stage."""
