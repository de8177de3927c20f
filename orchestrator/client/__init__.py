"""The canonical client: the `ito` CLI, its HTTP client, the manifest reader, credentials."""
