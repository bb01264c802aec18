"""`python -m strata` and the `strata` command.

Importing the CLI loads torch (a second or two); Ctrl-C meanwhile is one line and exit 130, not a
traceback. Everything after that is strata/cli.py's.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from strata.cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
