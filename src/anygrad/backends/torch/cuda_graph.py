"""CUDA graphs for the torch executable: on CUDA (unless `cuda_graph=False` or
ANYGRAD_TORCH_CUDA_GRAPH=0), the step's device work is captured as a CUDA graph on its third run
and replayed after: one launch per step. The step is a fixed program over fixed shapes, which is
what a CUDA graph holds; without it the founding CNN's step is bound by the host's ~160 kernel
launches (PyTorch's autograd launches ~80). Its inputs are static buffers: the state tensors (the
store then holds those buffers, updated in place by copies at the end of the graph) and the
uploaded batch. Possible when no numpy fallback reads a value a torch kernel makes; a capture
that fails (an op that syncs) leaves the step eager, with a warning.

Separate from runtime.py because it is a second way of running the same plan, with its own
buffer bookkeeping; TorchExecutable takes it as a base class (its state lives on the executable).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .actions import _NONE, _execute, _is_host
from .device import _torch
from .steps import _Step


class _CudaGraphs:
    """The CUDA-graph half of TorchExecutable: whether a plan can be captured, capturing it,
    replaying it. Uses the executable's plan (actions, slots, consts), backend and `_values`."""

    # set by TorchExecutable
    actions: list
    consts: dict[int, Any]
    slot: dict[str, int]
    state_slots: list[tuple[str, int]]
    update_slots: list[tuple[int, str]]
    feed_slots: list[tuple[str, int]]
    backend: Any
    device: Any
    cuda_graph: bool
    _graph: Any
    _values: Callable[[Mapping[str, np.ndarray]], list]
    _eager: Callable[[list], None]

    def _split_for_graph(self, steps: list[_Step], host: set[str]) -> bool:
        """A CUDA graph holds the device work only: possible when no fallback reads a value a
        lowered step makes (fallbacks then run on the host before the graph's replay)."""
        made_on_device = {o for st in steps if st.lowered for o in st.outputs if o}
        return all(not (set(st.inputs) & made_on_device) for st in steps if not st.lowered)

    def _run_graph(self, feeds: Mapping[str, np.ndarray]) -> list:
        """The step's device work as one captured CUDA graph, replayed: its inputs are static
        buffers (state tensors the store then holds, uploads copied in), its state updates are
        copies into the state buffers at the end of the graph, inside it. Host actions (fallbacks,
        uploads) run first, eagerly."""
        if self._graph is None:
            try:
                return self._capture(feeds)
            except Exception as e:  # noqa: BLE001 - an op that syncs or allocates on the host: stay eager
                import warnings
                warnings.warn(f"torch backend: CUDA graph capture failed ({type(e).__name__}: {e}); "
                              "running this step eagerly", RuntimeWarning, stacklevel=3)
                self.cuda_graph = False
                self._graph = None
                vals = self._values(feeds)
                self._eager(vals)
                return vals
        g = self._graph
        vals = self._values(feeds)
        _execute(g["host"], vals)
        state = self.backend.state
        for name, k in self.state_slots:
            buf = g["static"].get(k)
            if buf is not None and state.get(name) is not buf:  # rebound since: set_state, another program
                buf.copy_(vals[k])
                state[name] = buf
        for k, buf in g["static"].items():
            if k not in g["state_bufs"]:
                buf.copy_(vals[k], non_blocking=True)
        g["graph"].replay()
        out = g["vals"]
        for k in g["host_slots"]:
            out[k] = vals[k]
        for k, buf in g["update_bufs"]:
            out[k] = buf  # the store keeps holding the buffers the graph writes
        return out

    @staticmethod
    def _graphs_on(device: Any) -> bool:
        return device.type == "cuda"

    def _record(self, body: Callable[[], None]) -> Any:
        """A CUDA graph of what body() launches (replay() runs it again on the same buffers)."""
        torch = _torch()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph):
            body()
        return graph

    def _capture(self, feeds: Mapping[str, np.ndarray]) -> list:
        host = [a for a in self.actions if _is_host(a)]
        device = [a for a in self.actions if not any(a is h for h in host)]
        vals = self._values(feeds)
        _execute(host, vals)
        made = {o for a in device for o in a[2]}
        ext = sorted({i for a in device for i in a[1] if i not in made and i != _NONE and i not in self.consts})
        state_slot = {k: name for name, k in self.state_slots}
        static: dict[int, Any] = {}
        for k in ext:
            static[k] = vals[k].clone()
        updates = [(k, target) for k, target in self.update_slots if k in made]
        state_bufs: dict[int, Any] = {}
        for k, target in updates:
            ts = self.slot[target]
            if ts not in static:
                static[ts] = vals[ts].clone() if vals[ts] is not None else None
            state_bufs[ts] = static[ts]
        state_bufs.update({k: static[k] for k in ext if k in state_slot})
        gvals = list(vals)
        for k, buf in static.items():
            gvals[k] = buf

        def body() -> None:
            _execute(device, gvals)
            for k, target in updates:
                buf = static[self.slot[target]]
                src = gvals[k]
                if src is buf:
                    continue
                if any(src.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                       for b in state_bufs.values()):
                    src = src.clone()  # a state buffer (or a view of one) another copy may overwrite
                buf.copy_(src)

        graph = self._record(body)
        for k, buf in static.items():
            if k in state_slot:
                self.backend.state[state_slot[k]] = buf
        host_slots = sorted({o for a in host for o in a[2]} | set(self.consts) |
                            {k for _, k in self.feed_slots})
        self._graph = {"graph": graph, "static": static, "state_bufs": state_bufs, "vals": gvals,
                       "host": host, "host_slots": [k for k in host_slots if k not in static],
                       "update_bufs": [(k, static[self.slot[t]]) for k, t in updates]}
        graph.replay()
        out = gvals
        for k in self._graph["host_slots"]:
            out[k] = vals[k]
        for k, buf in self._graph["update_bufs"]:
            out[k] = buf  # run() rebinds the store's state to these: the buffers
        return out
