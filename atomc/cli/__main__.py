"""`python -m atomc.cli ...` runs the `atomc` command (the bench sweep starts servers this way)."""

import sys

from atomc.cli.main import main

sys.exit(main())
