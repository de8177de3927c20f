"""checkpointing stage."""
