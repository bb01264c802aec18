"""`python -m strata` and the `strata` command.

Importing the CLI loads torch (a second or two); Ctrl-C meanwhile is one line and exit 130, not a
traceback. Everything after that is strata/cli.py's. An interrupted run leaves through os._exit:
a Ctrl-C that landed inside an import can otherwise make the interpreter's shutdown end the
process by SIGINT after all (exit -2 instead of 130).
"""

from __future__ import annotations

import os
import signal
import sys


def _leave(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_interrupted = False


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def main() -> int:
    # remember that Ctrl-C came: a KeyboardInterrupt raised inside a C++ or numba call can reach us
    # as another exception (or none), and the answer must still be one line and exit 130
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        from strata.cli import main as cli_main

        if _interrupted:  # a Ctrl-C during the imports that some library's bare except swallowed
            raise KeyboardInterrupt
        code = cli_main()  # prints "interrupted" itself for a KeyboardInterrupt it sees
    except BaseException as e:
        if not (_interrupted or isinstance(e, KeyboardInterrupt)):
            raise
        print("interrupted", file=sys.stderr)
        code = 130
    if _interrupted and code != 130:  # swallowed later on: still the one line
        print("interrupted", file=sys.stderr)
        code = 130
    if code == 130:
        _leave(130)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
