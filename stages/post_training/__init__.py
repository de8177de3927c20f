"""post_training stage."""
