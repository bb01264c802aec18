"""`python -m strata` and the `strata` command.

Importing a command's modules loads torch (a second or two; strata/cli imports the chosen
command's module while it parses the command line); Ctrl-C meanwhile is one line and exit 130, not
a traceback: the process leaves at once from the signal handler, because a KeyboardInterrupt raised
inside an import can land in a C++ call that calls back into Python (torch.distributed's
`_c10d_init`), where pybind11 turns it into std::terminate and an abort. Nothing has started yet
that would need cleaning up. Everything after that is strata/cli's. An interrupted run leaves
through os._exit: a Ctrl-C that landed inside an import can otherwise make the interpreter's
shutdown end the process by SIGINT after all (exit -2 instead of 130).
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
_importing = True


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    if _importing:
        print("interrupted", file=sys.stderr)
        _leave(130)
    raise KeyboardInterrupt


def _imports_done() -> None:
    """The command's modules are imported: from here on a Ctrl-C is a KeyboardInterrupt."""
    global _importing
    _importing = False
    if _interrupted:  # a Ctrl-C during the imports that some library's bare except swallowed
        raise KeyboardInterrupt


def main() -> int:
    # remember that Ctrl-C came: a KeyboardInterrupt raised inside a C++ or numba call can reach us
    # as another exception (or none), and the answer must still be one line and exit 130
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        from strata.cli import (
            main as cli_main,  # after the SIGINT handler: a Ctrl-C while importing is one line
        )

        code = cli_main(imported=_imports_done)  # prints "interrupted" itself for a KeyboardInterrupt it sees
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
