"""What every backend provides: a state store shared by its executables, and `compile`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _parallel
from ..ir.graph import Graph, Node
from ..ir.registry import get_op


def _nothing() -> None:
    pass


@dataclass
class Exchange:
    """The one hook through which a caller takes part in a run (Executable.run's `exchange`): a
    data-parallel strategy exchanging gradient buckets (ready -> reduced -> written back) and
    summing over replicas inside the step. Every field is optional; no exchange: a plain run.

    - `reduce(x, mode)`: AllReduceSum's sum of `x` over the replicas (ops.collective's modes),
      called where the step holds one; None: the identity (the sum over one replica).
    - `ready`: {kernel index (Executable.ready_step): fn(encoder)}: right after that kernel the
      caller encodes its copies (a bucket of gradients, final there) and that much of the step is
      submitted, so the host reads them while the rest runs. An executable without kernel
      indices (ready_step None) runs whole; the caller reads after the run.
    - `encoded()`: called once the whole step is encoded, before its held parts are submitted
      (the caller's reader of the `ready` copies starts there).
    - `hold_parts`: parts held back so that those copies map mid-step, where the device's poll
      thread blocks (Executable.holds_parts); 0: every map asked after the last part."""

    reduce: Callable[[np.ndarray, str], np.ndarray] | None = None
    ready: dict[int, Callable[[Any], None]] = field(default_factory=dict)
    encoded: Callable[[], None] | None = None
    hold_parts: int = 0


NO_EXCHANGE = Exchange()


class Executable(ABC):
    """One compiled graph (fixed input shapes). Running it updates the backend's state in place."""

    graph: Graph
    holds_parts = True   # whether Exchange.hold_parts may change a run (False: it never does)
    upload_s = 0.0       # host seconds the last run spent writing its inputs
    upload_at = 0.0      # when (perf_counter) that began

    @abstractmethod
    def run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None = None,
            exchange: Exchange | None = None) -> dict[str, np.ndarray]:
        """Execute once; return the fetched values (graph outputs when fetch is None) as numpy.
        `exchange`: a caller's part in this run (Exchange)."""

    def ready_step(self, states: Sequence[str]) -> int | None:
        """The kernel after which these states are final in this run (an Exchange.ready index), or
        None: only once the run is over (the default: a step run whole)."""
        return None


class HostExecutable(Executable):
    """An executable whose ops run on the calling thread (numpy, torch): the run's
    Exchange.reduce is held in `_reduce` while it runs, for its AllReduceSum nodes
    (ops.collective.reduce_forward). Subclasses implement `_run`."""

    _reduce: Callable[[np.ndarray, str], np.ndarray] | None = None

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None = None,
            exchange: Exchange | None = None) -> dict[str, np.ndarray]:
        self._reduce = (exchange or NO_EXCHANGE).reduce
        try:
            return self._run(feeds, fetch)
        finally:
            self._reduce = None

    @abstractmethod
    def _run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None) -> dict[str, np.ndarray]:
        """The run itself (`_reduce` set)."""


class Backend(ABC):
    """A device. State (parameters, buffers) lives here, by name, shared by all executables."""

    name: str = "?"
    state: dict  # the store: state name -> the backend's tensor (or record) of it

    @property
    def description(self) -> str:
        """One line naming the device, for logs and the dashboard."""
        return self.name

    def supports(self, op: str | Node) -> bool:
        """Whether this backend can run (and train) an op, asked before anything is compiled
        (Model, `anygrad info`). The default: every registered op, each of which has a numpy
        reference kernel; a backend that lacks some overrides it."""
        return get_op(op.op if isinstance(op, Node) else op) is not None

    def check_precision(self, precision: str) -> str:
        """The precision ("f32", "f16") this device trains at when asked for `precision`: the
        same, or "f32" when its f16 kernels fail a self-test (it says so); a DeviceError naming
        the device when it cannot at all. numpy and torch compute float16 ops in float32 and
        round them, so the default accepts."""
        return precision

    @abstractmethod
    def compile(self, graph: Graph) -> Executable:
        """Compile a specialized graph. State it names that the store lacks is initialised from
        the graph's initializers."""

    @abstractmethod
    def get_state(self, name: str) -> np.ndarray:
        """A host copy of one state tensor."""

    @abstractmethod
    def set_state(self, name: str, value: np.ndarray) -> None:
        """Overwrite one state tensor (creates it when new)."""

    @abstractmethod
    def has_state(self, name: str) -> bool: ...

    def release(self) -> None:
        """Drop every state tensor: a backend nothing trains on any more (device='auto''s
        slower candidate) gives its device memory back."""
        self.state.clear()

    def get_states(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: self.get_state(n) for n in names}

    # Gradient exchange (anygrad.distributed): float32 state tensors as one flat host vector.
    def export_states(self, names: Sequence[str], out: np.ndarray) -> None:
        """Write the float32 states `names`, flattened back to back, into `out` (their total size)."""
        off = 0
        for n in names:
            v = self.get_state(n).reshape(-1)
            out[off:off + v.size] = v
            off += v.size

    def export_view_async(self, names: Sequence[str], out: np.ndarray,
                          encoder: Any = None) -> Callable[[], tuple[np.ndarray, Callable[[], None]]]:
        """export_states split into a start (this call) and a wait (the function it returns), for
        backends that read back asynchronously (wgpu: `encoder`, a command encoder being built,
        takes the copies mid-step). The wait gives the float32 vector, laid out as `out`, and a
        release to call once it has been read (also after an error): on wgpu the vector is the
        mapped staging memory itself, valid until then, so that gradients are summed straight
        from it. Here the whole copy into `out` happens now and `out` is the vector."""
        self.export_states(names, out)
        return lambda: (out, _nothing)

    def export_states_async(self, names: Sequence[str], out: np.ndarray, encoder: Any = None) -> Callable[[], None]:
        """export_view_async landing in `out`: the returned function waits, copies (over the host's
        threads), releases."""
        wait = self.export_view_async(names, out, encoder)

        def finish() -> None:
            view, release = wait()
            try:
                if view is not out:
                    _parallel.copy(out[:view.size], view)
            finally:
                release()
        return finish

    def import_states(self, names: Sequence[str], flat: np.ndarray) -> None:
        """The inverse of export_states: set each state from its slice of `flat`."""
        off = 0
        for n in names:
            shape = self.get_state_shape(n)
            size = int(np.prod(shape, dtype=np.int64))
            self.set_state(n, flat[off:off + size].reshape(shape))
            off += size

    def drop_transfer_buffers(self) -> None:
        """Forget the staging memory export_view_async and import_view keep per list of names (the
        lists changed: data parallelism cut its gradient buckets anew). Here there is none."""

    def import_view(self, names: Sequence[str]) -> tuple[np.ndarray, Callable[[], None]] | None:
        """import_states in two halves, for backends that upload from memory the host writes
        directly (wgpu's mapped upload buffers): a writable float32 vector laid out as `flat`, and
        the function that puts it into the states (which must be called, also after an error).
        That function's `cancel` attribute gives the memory back instead, leaving the states as
        they are (memory mapped ahead of its values, which never came). None where there is no
        such memory: use import_states."""
        return None

    def get_state_shape(self, name: str) -> tuple:
        return tuple(self.get_state(name).shape)
