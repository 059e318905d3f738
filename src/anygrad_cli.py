"""The `anygrad` console command, outside the anygrad package so that it runs before the package
imports: `import anygrad` takes seconds (numpy, onnx, the op registry), and a Ctrl-C in them would
print a KeyboardInterrupt traceback. Here it ends with one line and exit status 130, as a Ctrl-C
later in the command does (anygrad.cli.main). The library itself installs no SIGINT handler:
Python users keep their own.
"""
from __future__ import annotations

import os
import signal
import sys

EXIT_INTERRUPTED = 130  # as anygrad.cli.EXIT_INTERRUPTED (not imported: that is what this module avoids)


def _interrupted(signum: int, frame: object) -> None:
    # Nothing has been written yet, so nothing to clean up; _exit, not an exception, so that no
    # import along the way can catch it (a bare except) and go on.
    os.write(2, b"anygrad: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def main() -> int:
    """Import anygrad.cli with Ctrl-C ending the process quietly, then run it with the SIGINT
    handling it had (KeyboardInterrupt, which it catches; a run installs its own)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:  # not when SIGINT is ignored (nohup, `&`) or someone else's
        signal.signal(signal.SIGINT, _interrupted)
    try:
        from anygrad.cli import main as cli_main
    finally:
        if previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous)
    return cli_main()


if __name__ == "__main__":  # python -m anygrad_cli ..., as the console script does
    sys.exit(main())
