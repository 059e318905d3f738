"""TorchExecutable: a compiled graph run with torch tensor operations.

Compiling a graph asks each node's lowering (`lowering.LOWERINGS`, through sites.lower) for a torch
kernel. A node without one (an op, mode or dtype no lowering covers) runs the op's numpy reference
kernel on host copies of its inputs: correct, but a round trip through the CPU on a GPU device, so
the executable lists those ops (`fallback_ops`) and `anygrad info`/logs can say so. An op with
neither a lowering nor a reference kernel is refused by `supports`, before anything runs.

Values live as torch tensors on the device; values of dtypes torch cannot hold (uint32: the
RNG state) stay numpy arrays on the host. Every step is functional: kernels never write over
their inputs, state updates rebind the state store's tensors after the step.

Compiling makes a flat plan (actions.py): a list of (kernel, input slots, output slots, output
dtypes) over one list of values indexed by integers, so a step is one tight loop, with no name
lookups or per-value checks. Optimizer updates with a grouped lowering (`GROUP_LOWERINGS`) run as
one torch._foreach_* kernel for all parameters. Host values a kernel needs are uploaded once,
through pinned memory on a GPU (no wait for the queued work), or first mapped by the kernel's host
function (`host_inputs`, lowering.py). The step runs in torch's inference mode (no autograd
dispatch per op); nothing in it reads a device value back (`benchmarks/torch_overhead.py`
measures the host time per step and the torch ops per step against PyTorch eager).

On CUDA the step's device work is captured as a CUDA graph and replayed (cuda_graph.py); with
`torch_compile=True` runs of lowered nodes are traced by torch.compile (compiled.py).

This module owns building the plan from the graph (steps, grouping, slots, uploads) and running
it eagerly; the backend that makes executables and holds the state is backend.py.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import DeviceError, ShapeError, UnsupportedOpError
from ...ir.graph import Graph, Node
from ...ir.registry import get_op
from ...ops import collective
from ..base import HostExecutable
from . import (  # noqa: F401
    kernels_attention,
    kernels_elementwise,
    kernels_image,
    kernels_index,
    kernels_loss,
    kernels_nn,
    kernels_optim,
    kernels_quant,
    kernels_resize,
    kernels_shape,
)
from .actions import _DROP, _NONE, _Action, _execute, _grouped_fn, _host_fn, _straight_line
from .compiled import _compile_runs
from .convert import TORCH_DTYPES, to_numpy, to_torch, torch_dtype
from .cuda_graph import _CudaGraphs
from .device import _torch
from .lowering import GROUP_LOWERINGS
from .sites import _check_targets, fed_source, lower, node_site
from .steps import _fuse_bias, _Step

if TYPE_CHECKING:
    from .backend import TorchBackend


class TorchExecutable(_CudaGraphs, HostExecutable):
    def __init__(self, backend: TorchBackend, graph: Graph, torch_compile: bool = False,
                 cuda_graph: bool = False):
        self.backend = backend
        self.graph = graph
        self.device = backend.device
        self.fallback_ops: list[str] = []
        self.target_checks: list[tuple[str, int, int | None, str]] = []  # (input, classes, ignore, op)
        self.torch_compile = torch_compile
        steps = self._group(_fuse_bias(graph, self._steps(graph)))
        self.step_ops = ["+".join(n.op for n in st.nodes) if st.grouped else st.nodes[0].op for st in steps]
        self.input_info = {name: graph.info[name] for name in graph.inputs}
        self._plan(steps)
        self.cuda_graph = bool(cuda_graph and self._graphs_on(self.device) and self._graphable)
        self.graph_capable = self._graphable
        self._graph: Any = None      # the captured CUDA graph, once captured
        self._calls = 0
        self._inference_mode = _torch().inference_mode
        self._template: list | None = None
        self._step_fn: Callable[[list], None] | None = None  # the plan as one Python function

    # -- compiling ---------------------------------------------------------------------------
    def _steps(self, graph: Graph) -> list[_Step]:
        steps: list[_Step] = []
        memo = None if self.torch_compile else {}  # values one kernel leaves for another (Site.memo)
        producers = graph.producers()
        for node in graph.nodes:
            op = get_op(node.op)
            if op is None:
                raise UnsupportedOpError(f"{node.label}: the torch backend cannot run op {node.op} "
                                         "(no torch kernel and no reference kernel)")
            site = node_site(graph, node, memo, producers)
            for slot in site.host_checked:
                x = graph.info[node.inputs[0]]
                self.target_checks.append((fed_source(graph, node.inputs[slot], producers), int(x.shape[1]),
                                           node.attrs.get("ignore_index"), node.op))
            out_dtypes = [None if o is None else np.dtype(o.dtype) for o in site.outs]
            kernel = lower(site)
            if kernel is None:
                if node.op not in self.fallback_ops:
                    self.fallback_ops.append(node.op)
                run = self._exchanged if node.op == collective.OP else op.run
                steps.append(_Step([node], run, False, host_dtypes=[
                    np.dtype(graph.info[i].dtype) if i and i in graph.info else None for i in node.inputs]))
            else:
                steps.append(_Step([node], kernel, True,
                                   torch_dtypes=[None if d is None else torch_dtype(d) for d in out_dtypes]))
        return steps

    def _group(self, steps: list[_Step]) -> list[_Step]:
        """Lowered nodes of one op with a grouped lowering (GROUP_LOWERINGS), equal attributes and
        the same shared inputs become one step, placed where the last of them was. Only nodes whose
        outputs no node of the step reads (an optimizer's new parameters and slots, which go to
        the state store): moving them later then changes nothing."""
        read = {i for st in steps for i in st.inputs if i}
        groups: dict[tuple, list[int]] = {}
        for k, st in enumerate(steps):
            node = st.nodes[0]
            entry = GROUP_LOWERINGS.get(node.op)
            if not st.lowered or entry is None or any(o in read for o in node.outputs if o):
                continue
            shared = tuple(node.inputs[s] for s in entry[1]) if len(node.inputs) >= len(entry[1]) else None
            if shared is None or not all(shared):
                continue
            attrs = repr(sorted((k_, repr(v)) for k_, v in node.attrs.items()))
            layout = tuple(bool(i) for i in node.inputs), tuple(bool(o) for o in node.outputs)
            groups.setdefault((node.op, attrs, shared, layout), []).append(k)
        replace: dict[int, _Step] = {}
        dropped: set[int] = set()
        for (op, *_), members in groups.items():
            if len(members) < 2:
                continue
            sites = [node_site(self.graph, steps[k].nodes[0]) for k in members]
            kernel = GROUP_LOWERINGS[op][0](sites)
            if kernel is None:
                continue
            replace[members[-1]] = _Step([steps[k].nodes[0] for k in members], kernel, True, grouped=True,
                                         torch_dtypes=[d for k in members for d in steps[k].torch_dtypes])
            dropped.update(members[:-1])
        return [replace.get(k, st) for k, st in enumerate(steps) if k not in dropped]

    def _plan(self, steps: list[_Step]) -> None:
        """Steps -> a flat list of actions over integer slots (no name lookups while running).
        Values a lowered step reads but the host holds (feeds, state and constants of dtypes torch
        lacks, fallback outputs) get a device twin, uploaded once, right after they are made."""
        graph = self.graph
        slot: dict[str, int] = {}

        def at(name: str) -> int:
            if name not in slot:
                slot[name] = len(slot) + 2
            return slot[name]

        state = set(graph.state_names)
        host: set[str] = set()  # names whose values are numpy arrays on the host
        self.consts: dict[int, Any] = {}
        for k, v in graph.initializers.items():
            if k not in state:
                v = np.asarray(v)
                self.consts[at(k)] = to_torch(v, self.device) if v.dtype in TORCH_DTYPES else v
                if v.dtype not in TORCH_DTYPES:
                    host.add(k)
        self.feed_slots = [(name, at(name)) for name in graph.inputs]
        for name in list(graph.state_names) + list(graph.inputs):
            at(name)
            if name in graph.info and np.dtype(graph.info[name].dtype) not in TORCH_DTYPES:
                host.add(name)
        for st in steps:
            for name in st.inputs + st.outputs:
                if name:
                    at(name)
            if not st.lowered:
                host.update(o for o in st.outputs if o)
        def prep_of(st: _Step, j: int, name: str) -> Callable | None:
            """The host function a lowered kernel wants applied to input j when the host holds
            it (kernel.host_inputs), e.g. the dropout key from the uint32 RNG state."""
            if not st.lowered or st.grouped or name not in host:
                return None
            return getattr(st.kernel, "host_inputs", {}).get(j)

        device_read = {i for st in steps if st.lowered for j, i in enumerate(st.inputs)
                       if i in host and prep_of(st, j, i) is None}
        preps = list(dict.fromkeys((i, fn) for st in steps for j, i in enumerate(st.inputs)
                                   if i and (fn := prep_of(st, j, i)) is not None))
        fresh = itertools.count(len(slot) + 2)
        twin: dict[Any, int] = {}  # name, or (name, host function): its device twin's slot

        def upload_action(name: str) -> _Action:
            twin[name] = next(fresh)
            return (self._upload_fn, [slot[name]], [twin[name]], [None])

        def prep_actions(name: str, fn: Callable) -> list[_Action]:
            made, twin[(name, fn)] = next(fresh), next(fresh)
            return [(_host_fn(fn), [slot[name]], [made], [None]), (self._upload_fn, [made], [twin[(name, fn)]], [None])]

        actions: list[_Action] = []
        host_first: list[_Action] = []   # uploads of host values known before the step
        fallback_made = {o for st in steps if not st.lowered for o in st.outputs}
        for name in sorted(device_read - fallback_made):
            action = upload_action(name)
            if slot[name] in self.consts:   # a constant: uploaded once, here
                self.consts[twin[name]] = self.backend.upload(self.consts[slot[name]])
            else:
                host_first.append(action)
        for name, fn in preps:
            if name in fallback_made:
                continue
            prepared = prep_actions(name, fn)
            if slot[name] in self.consts:
                self.consts[twin[(name, fn)]] = self.backend.upload(fn(self.consts[slot[name]]))
            else:
                host_first += prepared
        for st in steps:
            ins = [_NONE if not i else twin[(i, fn)] if (fn := prep_of(st, j, i)) is not None
                   else twin[i] if st.lowered and i in twin else slot[i] for j, i in enumerate(st.inputs)]
            outs = [slot[o] if o else _DROP for o in st.outputs]
            if not st.lowered:
                actions.append((self._fallback_fn(st), ins, outs, [None] * len(outs)))
                actions += [upload_action(o) for o in st.outputs if o and o in device_read]
                for name, fn in preps:
                    if name in st.outputs:
                        actions += prep_actions(name, fn)
            elif st.grouped:
                sizes = [len(n.inputs) for n in st.nodes]
                actions.append((_grouped_fn(st.kernel, sizes), ins, outs, st.torch_dtypes))
            else:
                actions.append((st.kernel, ins, outs, st.torch_dtypes))
        self.n_slots = next(fresh)
        self.slot = slot
        self.actions = host_first + actions
        self.state_slots = [(name, slot[name]) for name in graph.state_names]
        self.update_slots = [(slot[p], target) for p, target in graph.state_updates.items()]
        self._graphable = self._split_for_graph(steps, host)
        if self.torch_compile:
            at_end = {slot[o] for o in graph.outputs if o in slot} | {k for k, _ in self.update_slots}
            compiled, self.compiled_keep = _compile_runs(actions, at_end, self.backend.compile_backend)
            self.actions = host_first + compiled
        self.n_lowered = sum(len(st.nodes) for st in steps if st.lowered)


    def _fallback_fn(self, st: _Step) -> Callable:
        node, kernel, dtypes = st.nodes[0], st.kernel, st.host_dtypes

        def fallback(ins: list) -> list:
            """The op's numpy reference kernel on host copies of its inputs."""
            return kernel(node, [None if v is None else to_numpy(v, d) for v, d in zip(ins, dtypes)])
        fallback.host = True  # type: ignore[attr-defined]
        return fallback

    @property
    def _upload_fn(self) -> Callable:
        upload = self.backend.upload

        def run(ins: list) -> list:
            return [upload(ins[0])]
        run.host = True  # type: ignore[attr-defined]
        return run

    # -- running -----------------------------------------------------------------------------
    def _check_feed(self, name: str, value: Any) -> Any:
        inf = self.input_info[name]
        shape = tuple(value.shape)
        if shape != tuple(inf.shape):
            raise ShapeError(f"input '{name}' has shape {shape}; this executable was compiled for "
                             f"{tuple(inf.shape)}")
        dtype = np.dtype(inf.dtype)
        if dtype not in TORCH_DTYPES:
            return to_numpy(value, dtype)
        return self.backend.upload(np.asarray(value).astype(dtype, copy=False))

    def _values(self, feeds: Mapping[str, np.ndarray]) -> list:
        template = self._template
        if template is None:  # the constants in their slots, copied per step (one C-level copy)
            template = self._template = [None] * self.n_slots
            for k, v in self.consts.items():
                template[k] = v
        vals = list(template)
        state = self.backend.state
        for name, k in self.state_slots:
            vals[k] = state.get(name)
        for name, classes, ignore, label in self.target_checks:
            _check_targets(np.asarray(feeds[name]), classes, ignore, label)
        for name, k in self.feed_slots:
            vals[k] = self._check_feed(name, feeds[name])
        return vals

    def _exchanged(self, node: Node, ins: list) -> list:
        """AllReduceSum on the host, through the run's reducer (ops.collective)."""
        return collective.reduce_forward(self._reduce, node, ins)

    def _run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None) -> dict[str, np.ndarray]:
        # Inference mode: no tensor here ever needs torch.autograd (the graph has its own
        # gradients), and torch ops then skip autograd's dispatch (~0.4 us per op on a CPU).
        # Values made here are inference tensors, which may be changed in place only in this
        # mode: the CUDA graph's copies into its state buffers run inside it too.
        with self._inference_mode():
            self._calls += 1
            if self.cuda_graph and self._calls > 2:
                vals = self._run_graph(feeds)
            else:
                vals = self._values(feeds)
                self._eager(vals)
            state, held = self.backend.state, self.backend.held
            for k, target in self.update_slots:
                state[target] = held(vals[k])
            names = fetch if fetch is not None else self.graph.outputs
            if self.torch_compile:
                gone = [f for f in names if f in self.slot and self.slot[f] not in self.compiled_keep
                        and vals[self.slot[f]] is None]
                if gone:
                    raise DeviceError(f"value(s) {gone} live inside a torch.compile'd part of the step and are not "
                                      "kept; fetch the step's outputs, or compile without --compile")
            return {f: to_numpy(vals[self.slot[f]]) for f in names}

    def _eager(self, vals: list) -> None:
        """The plan's actions in order: the first time through the loop, which records how many
        values each kernel returns, then as the straight-line function written from that."""
        if self._step_fn is None:
            counts: list[int] = []
            _execute(self.actions, vals, counts)
            self._step_fn = _straight_line(self.actions, counts)
        else:
            self._step_fn(vals)
