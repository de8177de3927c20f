"""``python -m orchestrator.admin``: the ``ito-backend`` command."""

from orchestrator.admin import main

main()
