"""What every command shares: the exit codes, and how a message names a path (on one line, a
very long one elided; a folder given where a file belongs refused). Apart so that the commands,
the parser and main() use one copy without importing each other."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

EXIT_ERROR = 2
EXIT_UNSUPPORTED = 1
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C after writing a checkpoint
EXIT_DIVERGED = 3       # --on-nan stop ended the run: a loss or weight was not finite
EXIT_BROKEN_PIPE = 141  # stdout closed by its reader (`| head -1`): 128 + SIGPIPE, as a Unix tool ends


def _not_a_folder(path: Path, what: str) -> Path:
    """`path` for a file argument; a folder there is an error that says so (the loaders would
    report it as missing)."""
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not {what}; give the file itself")
    return path


def _one_line(text: str) -> str:
    """A message on one line: its lines joined ("; ", or a space after a colon)."""
    out = ""
    for line in filter(None, (line.strip() for line in str(text).splitlines())):
        out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def _elide_words(text: str) -> str:
    """A message with each very long word (a 100k-character path) shortened as _short does."""
    import re
    return re.sub(r"\S{201,}", lambda m: _short(m[0]), _short(text, 100_000))


def _short(path: Any, limit: int = 200) -> str:
    """A path for a message, its middle elided when very long (a 100k-character argument), and
    printable (an undecodable byte of a file name shown as \\udcff, not a UnicodeEncodeError)."""
    text = str(path).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]} ({len(text):,} characters)"
