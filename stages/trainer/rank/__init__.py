"""One rank of one replica group: its actor, its training loop and what it reports."""
