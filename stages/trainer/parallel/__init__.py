"""The layout inside a replica group: FSDP2, TP, PP, CP, recompute and precision."""
