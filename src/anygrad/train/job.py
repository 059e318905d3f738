"""A run as one rank of a torchrun job: what train.run.run does when this process is one.

- `joined(group)`: the caller's ProcessGroup, or the one of the job torchrun's variables describe
  (opened here, and closed when the run ends); None for a plain run.
- `elastic_resume`: a rank torchrun restarted (--max-restarts) continues the run from its last
  checkpoint: the same settings, resuming their artifacts folder when a checkpoint is there.
- `rank_output`: only rank 0 speaks; the other ranks say nothing but errors (stderr).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import settings
from . import checkpoint as ckpt


@contextlib.contextmanager
def joined(group: Any = None) -> Iterator[Any]:
    """`group` itself, else the job's ProcessGroup when torchrun (or the like) started this process."""
    if group is not None:
        yield group
        return
    from ..distributed import ProcessGroup, world_from_env
    world = world_from_env()
    if world is None:
        yield None
        return
    opened = ProcessGroup(world)
    try:
        yield opened
    finally:
        opened.close()


def restarted() -> bool:
    """Whether torchrun restarted this rank after a failure of the job (TORCHELASTIC_RESTART_COUNT)."""
    try:
        return int(settings.external("TORCHELASTIC_RESTART_COUNT") or 0) > 0
    except ValueError:
        return False


def elastic_resume(folder: str | os.PathLike | None, resume: bool, overwrite: bool) -> tuple[bool, bool]:
    """(resume, overwrite) for a rank torchrun restarted: resume the run in `folder` (the one the
    settings name; a default folder is new on every start) when it has a checkpoint; else the job
    died before its first one, and what the folder holds is this job's own start (overwrite)."""
    if not restarted() or resume or not folder:
        return resume, overwrite
    if ckpt.latest(Path(folder) / "checkpoints") is not None:
        return True, overwrite
    return resume, True


@contextlib.contextmanager
def rank_output(group: Any) -> Iterator[bool]:
    """Run the body with stdout to the null device on every rank but the writer (rank 0); yields
    whether this rank speaks."""
    if group is None or group.is_writer:
        yield True
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        yield False
