"""`python -m strata`: the same CLI as the `strata` command."""

from strata.cli import main

raise SystemExit(main())
