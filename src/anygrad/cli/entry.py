"""main(), the `anygrad` command's entry point: parse, run the command, and turn whatever
escapes it (an AnygradError, Ctrl-C, a closed stdout, an OSError) into one `anygrad: ...` line
on stderr and an exit code, never a traceback."""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ..errors import AnygradError
from .common import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, _elide_words, _one_line, _short
from .parser import build_parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        if not (sys.argv[1:] if argv is None else list(argv)):  # `anygrad` alone: what it can do
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
        return args.run(args)
    except AnygradError as e:
        print(f"anygrad: error: {_elide_words(_one_line(e))}", file=sys.stderr)
    except KeyboardInterrupt:  # before training started (a run checkpoints and returns 130 itself)
        print("anygrad: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError as e:
        if e.filename is not None:  # a file the command writes, not its output: an error as any other
            print(f"anygrad: error: {_short(e.filename)}: {e.strerror or e}", file=sys.stderr)
            return EXIT_ERROR
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as e:  # a file the command had to write or read, failing outside its own checks
        where = f"{_short(e.filename)}: " if e.filename else ""
        print(f"anygrad: error: {where}{e.strerror or e}; check the path and its folder's permissions and free "
              "space", file=sys.stderr)
    except RecursionError:
        print("anygrad: error: an input is nested too deeply to read", file=sys.stderr)
    return EXIT_ERROR


def _drop_stdout() -> None:
    """Point stdout at the null device: its reader is gone (`anygrad info M | head -1`), and the
    interpreter's last flush at exit would report the broken pipe once more."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no real file behind sys.stdout: nothing is flushed
        pass
