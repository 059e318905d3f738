"""The exchange's settings chosen by timing whole steps: the gradient bucket size and how many
parts of a wgpu step are held back (hold_parts). _Choice times each candidate over a few updates
and keeps the fastest; ExchangeTuning is DataParallel's half that says which value each update
uses and which one it times (the candidates and the trial counts are set in parallel.py, where
DataParallel makes its two _Choices). Separate from the exchange itself: the sums do not change
with the setting, only how long a step takes.
"""
from __future__ import annotations

from typing import Any

from .launch import ProcessGroup


class _Choice:
    """A setting of the exchange whose best value depends on the model, the batch and the machine,
    chosen by timing whole steps: each candidate in turn over `trials` updates, then the one with
    the lowest (lower) median is kept, the first on a tie. Ranks keep rank 0's choice: choosing is
    a collective, which every rank reaches at the same update. `value` is None until chosen."""

    def __init__(self, candidates: tuple, trials: int, value: Any = None):
        self.candidates, self.trials = tuple(candidates), trials
        self.value = self.candidates[0] if value is None and len(self.candidates) == 1 else value
        self.times: list[tuple[Any, float]] = []

    def now(self, may_time: bool, group: ProcessGroup | None) -> tuple[Any, bool]:
        """(the value for this update, whether this update times it). Without `may_time` (the
        first update, which compiles; another setting timed in it) the chosen value or the
        first candidate, untimed."""
        if self.value is None and may_time:
            if len(self.times) < self.trials * len(self.candidates):
                return self.candidates[len(self.times) % len(self.candidates)], True
            self._choose(group)
        return (self.candidates[0] if self.value is None else self.value), False

    def _choose(self, group: ProcessGroup | None) -> None:
        def median(c: Any) -> float:
            times = sorted(t for v, t in self.times if v == c)
            return times[(len(times) - 1) // 2]
        best = min(self.candidates, key=lambda c: (median(c), c != self.candidates[0]))
        if group is not None and group.size > 1:
            best = type(best)(group.gather_strings(str(best))[0])
        self.value = best


class ExchangeTuning:
    """Which bucket size and hold_parts each update uses, for DataParallel (which owns the state:
    its _bucket and _hold choices, the update it times in _timed)."""

    @property
    def hold_parts(self) -> int | None:
        """How many parts of a wgpu step are held back (None: still being timed)."""
        return self._hold.value

    @hold_parts.setter
    def hold_parts(self, value: int | None) -> None:
        self._hold.value = value

    @property
    def bucket_bytes(self) -> int:
        """The gradient bucket size in use (chosen over the first updates unless ANYGRAD_BUCKET_MB)."""
        return self._bucket_bytes

    def _timing_choice(self, choice: _Choice) -> Any:
        """`choice`'s value for this update, timed if it is still being chosen, nothing else is
        timed in this update, this is not the first update (it compiles) and the devices do not
        run one after the other (balance()). With other ranks, balanced updates are timed too:
        every rank must try the same value at the same update (its buckets are all-reduced with
        theirs), and another rank may have no devices to balance."""
        balancing = self._timing and (self.group is None or self.group.size == 1)
        value, timed = choice.now(self.updates >= 1 and self._timed is None and not balancing, self.group)
        if timed:
            self._timed = (choice, value)
        return value

    def _cut_buckets(self) -> None:
        """This update's bucket size; a new size re-cuts the buckets, and the devices' staging
        buffers of the old ones are dropped."""
        size = self._timing_choice(self._bucket)
        if size != self._bucket_bytes:
            self._bucket_bytes, self._buckets = size, None
            for r in self.replicas:
                r.backend.drop_transfer_buffers()

    def _hold_for_this_update(self, exe: Any) -> int | None:
        """hold_parts for this update's gradient phases (timed over the first updates unless
        fixed); None where the executable holds nothing back (a device whose mappings resolve
        mid-step)."""
        if not exe.holds_parts:
            return None
        return self._timing_choice(self._hold)
