"""``python -m stages.data_prep``: see stages/data_prep/cli.py."""

import sys

from stages.data_prep.cli import main

sys.exit(main())
