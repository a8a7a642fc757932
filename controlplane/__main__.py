"""`python -m controlplane serve|put ...`: the same as the `bcd-controlplane` console script."""

import sys

from .cli import main

sys.exit(main())
