"""data_prep stage."""
