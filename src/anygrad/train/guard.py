"""Watching a run for divergence: a non-finite loss, parameter or statistic (--on-nan).

The loop already reads the device's metric sums every `log_every` steps; at each read (and
before every checkpoint) the guard also reads the parameters and buffers back and checks them.
A BatchNorm running variance that overflows while the loss still looks fine is caught too.

- stop (default): the run ends before writing anything non-finite; the last checkpoint (finite)
  stays the newest, and the caller exits non-zero saying what happened.
- skip: the state goes back to the last finite read point (a copy kept on the host) and the
  run goes on; the batches in between are skipped and counted.
- warn: one warning, and the run goes on (the behaviour before this guard existed).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

ON_NAN = ("stop", "skip", "warn")


class Diverged(Exception):
    """Raised inside the loop when --on-nan stop sees a non-finite value; Learner.fit catches it."""


def nonfinite_entries(state: dict[str, np.ndarray]) -> list[str]:
    """Names of the floating-point arrays in `state` that hold a NaN or an infinity."""
    return [k for k, v in state.items() if np.asarray(v).dtype.kind == "f" and not np.isfinite(v).all()]


def describe(loss: float | None, names: list[str]) -> str:
    """What is not finite, in words: 'the loss is nan', 'bn.running_var holds inf or NaN', ..."""
    parts = [f"the loss is {loss}"] if loss is not None and not np.isfinite(loss) else []
    if names:
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{listed} hold{'s' * (len(names) == 1)} NaN or infinite values")
    return " and ".join(parts)


@dataclass
class Guard:
    """Per-run divergence state. `read_state` reads parameters and buffers (Model.state_dict);
    `full_state`/`load_full_state` copy and restore all device state (skip mode only)."""

    mode: str
    read_state: Callable[[], dict[str, np.ndarray]]
    full_state: Callable[[], dict[str, np.ndarray]]
    load_full_state: Callable[[dict[str, np.ndarray]], None]
    warned: bool = False
    skipped_steps: int = 0
    _snapshot: dict[str, np.ndarray] | None = None
    _snapshot_step: int = 0
    _snapshot_micro: int = 0

    # micro_step (batches into an accumulation group) lives on the host: kept beside the copy

    def problem(self, loss: float | None) -> str | None:
        """What is non-finite now (the loss of the last read, then the state), or None."""
        names = nonfinite_entries(self.read_state())
        bad_loss = loss is not None and not np.isfinite(loss)
        return describe(loss, names) if bad_loss or names else None

    def remember(self, global_step: int, micro_step: int = 0) -> None:
        """In skip mode, keep a copy of the (finite) state to go back to."""
        if self.mode == "skip":
            self._snapshot = {k: np.array(v, copy=True) for k, v in self.full_state().items()}
            self._snapshot_step, self._snapshot_micro = global_step, micro_step

    def restore(self, global_step: int) -> tuple[str, int]:
        """Skip mode: back to the last finite state; returns what was skipped, in words, and the
        micro_step to go on with."""
        if self._snapshot is None:
            raise Diverged("no finite state to go back to")
        self.load_full_state(self._snapshot)
        skipped = global_step - self._snapshot_step
        self.skipped_steps += skipped
        return f"{skipped} step{'s' * (skipped != 1)} after global step {self._snapshot_step}", self._snapshot_micro
