"""curriculum stage."""
