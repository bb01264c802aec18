"""`python -m strata.cli` (as `strata`, without strata/__main__.py's Ctrl-C handling during imports)."""

import sys

from strata.cli import main

if __name__ == "__main__":
    sys.exit(main())
