"""The driver side of the engine: the fleet of ranks, made, supervised and handed on.

Nothing here runs on a rank; importing it pulls in neither Ray nor torch.
"""
