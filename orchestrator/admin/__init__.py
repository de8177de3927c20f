"""``ito-backend``: the API server and its admin commands (operators only).

Admin commands write the store directly (same host as the server, ``--db`` or
``ITO_DB``); with ``--json`` each prints one envelope. ``keys issue`` prints the
key exactly once; only its hash is stored. The server is ``serve.py``, the registry
commands ``registry.py``, what they share ``common.py``.
"""

from __future__ import annotations

import typer

from orchestrator.admin.registry import accounts_app, bookings_app, keys_app, runs_app
from orchestrator.admin.serve import serve

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="ito-train backend: API server and admin commands",
)
app.add_typer(accounts_app, name="accounts")
app.add_typer(keys_app, name="keys")
app.add_typer(bookings_app, name="bookings")
app.add_typer(runs_app, name="runs")
app.command()(serve)


def main() -> None:
    app()
