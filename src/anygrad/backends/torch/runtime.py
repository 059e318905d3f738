"""TorchBackend and its executable: a compiled graph run with torch tensor operations.

Compiling a graph asks each node's lowering (`lowering.LOWERINGS`) for a torch kernel. A node
without one (an op, mode or dtype no lowering covers) runs the op's numpy reference kernel on
host copies of its inputs: correct, but a round trip through the CPU on a GPU device, so the
executable lists those ops (`fallback_ops`) and `anygrad info`/logs can say so. An op with
neither a lowering nor a reference kernel is refused by `supports`, before anything runs.

Values live as torch tensors on the device; values of dtypes torch cannot hold (uint32: the
RNG state) stay numpy arrays on the host. Every step is functional: kernels never write over
their inputs, state updates rebind the state store's tensors after the step.

Compiling makes a flat plan: a list of (kernel, input slots, output slots, output dtypes) over
one list of values indexed by integers, so a step is one tight loop, with no name lookups or
per-value checks. Optimizer updates with a grouped lowering (`GROUP_LOWERINGS`) run as one
torch._foreach_* kernel for all parameters. Host values a kernel needs are uploaded once, through
pinned memory on a GPU (no wait for the queued work), or first mapped by the kernel's host
function (`host_inputs`, lowering.py). The step runs in torch's inference mode (no autograd
dispatch per op); nothing in it reads a device value back (`benchmarks/torch_overhead.py`
measures the host time per step and the torch ops per step against PyTorch eager).

On CUDA (unless `cuda_graph=False` or ANYGRAD_TORCH_CUDA_GRAPH=0), the step's device work is
captured as a CUDA graph on its third run and replayed after: one launch per step. The step is a
fixed program over fixed shapes, which is what a CUDA graph holds; without it the founding CNN's
step is bound by the host's ~160 kernel launches (PyTorch's autograd launches ~80). Its inputs are
static buffers: the state tensors (the store then holds those buffers, updated in place by copies
at the end of the graph) and the uploaded batch. Possible when no numpy fallback reads a value a
torch kernel makes; a capture that fails (an op that syncs) leaves the step eager, with a warning.

With `torch_compile=True` (`anygrad train --compile`, or ANYGRAD_TORCH_COMPILE=1), each maximal
run of lowered nodes between two fallbacks becomes one function traced by `torch.compile`
(inductor, default mode; a string names another torch.compile backend, e.g. "aot_eager", which
needs no C++ compiler). Not torch's own CUDA graphs ("reduce-overhead"): those reuse their output
buffers on the next call, and the step's outputs are the next step's state. With `cuda_graph` as
well, the compiled functions' kernels are captured by the CUDA graph above, on the third run, once
the first has compiled them.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import settings
from ...errors import ConfigError, DataError, DeviceError, ShapeError, UnsupportedOpError
from ...ir.graph import Graph, Node
from ...ir.passes import resolve_attributes
from ...ir.registry import get_op
from ...ops import collective
from ..base import Backend, HostExecutable
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
from .convert import TORCH_DTYPES, WIDENED, is_tensor, to_numpy, to_torch, torch_dtype
from .lowering import GROUP_LOWERINGS, LOWERINGS, Site


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ConfigError("the torch backend needs PyTorch: pip install 'anygrad-train[torch]' "
                          "(or choose device='cpu' or 'wgpu')") from e
    return torch


def resolve_device(device: str) -> str:
    """'torch' / 'torch:cuda[:N]' / 'torch:mps' / 'torch:cpu' -> a torch device string, checked."""
    torch = _torch()
    want = device.partition(":")[2] or "best"
    if want == "best":
        return best_torch_device() or "cpu"
    kind = want.split(":")[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{device}': torch sees no CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build {torch.version.cuda}); use torch:cpu, wgpu or cpu")
        index = want.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise DeviceError(f"device '{device}': there are {torch.cuda.device_count()} CUDA devices "
                              f"(torch:cuda:0 to :{torch.cuda.device_count() - 1})")
        return want
    if kind == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"device '{device}': torch's MPS (Apple GPU) is not available here; "
                              "use torch:cpu, wgpu or cpu")
        return "mps"
    if want == "cpu":
        return "cpu"
    raise ConfigError(f"unknown torch device '{device}'; use torch, torch:cuda, torch:cuda:N, torch:mps "
                      "or torch:cpu")


def best_torch_device() -> str | None:
    """'cuda' or 'mps' when torch has that GPU, else None (the caller decides about the CPU)."""
    torch = _torch()
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


# Ops that take class-index targets (slot): a target fed as a graph input is range-checked on the
# host before it is uploaded, so the kernel need not read a verdict back from the device (a sync
# per step on a GPU); a bad index would otherwise be a device-side assert there.
TARGET_SLOTS = {"CrossEntropy": 1, "NegativeLogLikelihoodLoss": 1, "SoftmaxCrossEntropyLoss": 1,
                "CrossEntropyMetrics": 1}


# Ops that pass every element of their first input through unchanged (only the shape moves), so
# a range check on a fed tensor holds for what they make of it: a flattened (N*T,) target
# checked as the (N, T) batch the user fed.
SAME_VALUES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def fed_source(graph: Graph, value: str, producers: dict[str, Node] | None = None) -> str | None:
    """The graph input `value` holds the elements of, through SAME_VALUES ops, or None."""
    producers = producers if producers is not None else graph.producers()
    while value not in graph.inputs:
        node = producers.get(value)
        if node is None or node.op not in SAME_VALUES:
            return None
        value = node.inputs[0]
    return value


def node_site(graph: Graph, node: Node, memo: dict | None = None,
              producers: dict[str, Node] | None = None) -> Site:
    slot = TARGET_SLOTS.get(node.op)
    fed = slot is not None and fed_source(graph, node.input(slot), producers) is not None
    return Site(node, [graph.info.get(i) if i else None for i in node.inputs],
                [graph.info.get(o) if o else None for o in node.outputs],
                frozenset({slot}) if fed else frozenset(), memo)


def lower(site: Site) -> Callable | None:
    """The torch kernel for a node, or None: no lowering, a dtype torch cannot hold, an empty tensor,
    or the lowering declines this node's configuration."""
    fn = LOWERINGS.get(site.node.op)
    if fn is None:
        return None
    for k, info in enumerate(site.ins + site.outs):
        if info is None:
            continue
        dtype = np.dtype(info.dtype)
        # unsigned inputs up to 32 bits reach a kernel as int64 (exact); no output may be one
        held = dtype in TORCH_DTYPES or (k < len(site.ins) and dtype in WIDENED)
        if not held or not all(isinstance(d, int) for d in info.shape):
            return None
        # an empty tensor, but for an empty constant operand (a shape [] or no axes), which the
        # lowerings read at compile time (Site.const)
        if 0 in tuple(info.shape) and not (0 < k < len(site.ins) and info.const is not None):
            return None
    return fn(site)


@dataclass
class _Step:
    """One unit of the step: a lowered node, a group of nodes (one grouped kernel), or a fallback."""

    nodes: list[Node]
    kernel: Callable  # torch kernel, grouped kernel, or the op's numpy reference kernel (fallback)
    lowered: bool
    grouped: bool = False
    torch_dtypes: list[Any] = field(default_factory=list)  # of the outputs, for lowered steps
    host_dtypes: list[np.dtype | None] = field(default_factory=list)  # of the inputs, for fallbacks

    @property
    def inputs(self) -> list[str]:
        return [i for n in self.nodes for i in n.inputs]

    @property
    def outputs(self) -> list[str]:
        return [o for n in self.nodes for o in n.outputs]


def _fuse_bias(graph: Graph, steps: list[_Step]) -> list[_Step]:
    """MatMul(a, W) followed by Add(., bias) with a 1-D bias over W's columns (every Linear, as
    ONNX writes it) becomes one torch.addmm step, at the Add's place, where the matmul's output has
    no other reader: the bias is added in the GEMM's epilogue instead of by a pass of its own over
    the output (24 launches per step of the GPT benchmark). Both kernels must be lowered."""
    readers: dict[str, int] = {}
    for st in steps:
        for i in st.inputs:
            if i:
                readers[i] = readers.get(i, 0) + 1
    pinned = set(graph.outputs) | set(graph.state_updates)
    at = {o: k for k, st in enumerate(steps) for o in st.outputs if o}
    fused: dict[int, _Step] = {}
    dropped: set[int] = set()
    for k, st in enumerate(steps):
        node = st.nodes[0]
        if not st.lowered or st.grouped or node.op != "Add" or len(node.inputs) != 2:
            continue
        for mm_out, bias in (node.inputs, node.inputs[::-1]):
            j = at.get(mm_out)
            if j is None or j in dropped or readers.get(mm_out) != 1 or mm_out in pinned:
                continue
            mm = steps[j]
            a, w = (mm.nodes[0].inputs + ["", ""])[:2]
            if not mm.lowered or mm.grouped or mm.nodes[0].op != "MatMul" or not (a and w and bias):
                continue
            ia, iw, ib, io = (graph.info.get(n) for n in (a, w, bias, node.outputs[0]))
            if None in (ia, iw, ib, io) or len(iw.shape) != 2 or len(ia.shape) < 2 or \
                    tuple(ib.shape) != (iw.shape[1],) or tuple(io.shape) != tuple(ia.shape[:-1]) + (iw.shape[1],) or \
                    len({np.dtype(x.dtype) for x in (ia, iw, ib)}) != 1 or np.dtype(ia.dtype).kind != "f":
                continue
            fused[k] = _Step([Node("MatMul+Add", [a, w, bias], list(node.outputs), name=node.name)], _addmm, True,
                             torch_dtypes=st.torch_dtypes)
            dropped.add(j)
            break
    return [fused.get(k, st) for k, st in enumerate(steps) if k not in dropped]


def _addmm(ins: list) -> list:
    a, w, bias = ins
    rows = _torch().addmm(bias, a.reshape(-1, a.shape[-1]), w)
    return [rows.reshape(*a.shape[:-1], w.shape[1])]


# An action of the precompiled plan: fn(list of input values) -> list of output values, the input
# and output slots (integers into the step's value list), and per output the torch dtype the value
# is cast to (None: keep). Slot 0 holds None (absent optional inputs), slot 1 takes unused outputs.
_Action = tuple[Callable, list[int], list[int], list[Any]]
_NONE, _DROP = 0, 1


class TorchExecutable(HostExecutable):
    def __init__(self, backend: TorchBackend, graph: Graph, torch_compile: bool = False,
                 cuda_graph: bool = False):
        self.backend = backend
        self.graph = graph
        self.device = backend.device
        self.fallback_ops: list[str] = []
        self.target_checks: list[tuple[str, int, int | None, str]] = []  # (input, classes, ignore, node)
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
                                           node.attrs.get("ignore_index"), node.label))
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
            self.actions = host_first + self._compiled(actions)
        self.n_lowered = sum(len(st.nodes) for st in steps if st.lowered)

    def _compiled(self, actions: list[_Action]) -> list[_Action]:
        """Each maximal run of lowered actions as one function traced by torch.compile. A function
        returns only the values something after it reads (a later action, the step's outputs or
        state updates): every other value is inductor's to fuse away, not to materialise."""
        torch = _torch()
        out: list[_Action] = []
        run: list[_Action] = []
        at_end = {self.slot[o] for o in self.graph.outputs if o in self.slot} | {k for k, _ in self.update_slots}
        read_after: list[set[int]] = [set() for _ in range(len(actions) + 1)]  # read at or after action p
        for p in range(len(actions) - 1, -1, -1):
            read_after[p] = read_after[p + 1] | set(actions[p][1])
        self.compiled_keep = set(at_end)

        def flush(end: int) -> None:
            if not run:
                return
            made: set[int] = set()
            reads: list[int] = []
            for _, ins, outs, _ in run:
                reads += [i for i in ins if i not in made and i not in reads and i != _NONE]
                made.update(outs)
            writes = sorted((made - {_DROP}) & (read_after[end] | at_end))
            self.compiled_keep.update(writes)
            fn = torch.compile(_segment_fn(list(run), reads, writes), dynamic=False,
                               backend=self.backend.compile_backend)
            out.append((lambda ins, fn=fn: fn(*ins), reads, writes, [None] * len(writes)))
            run.clear()

        for p, a in enumerate(actions):
            if _is_host(a):
                flush(p)
                out.append(a)
            else:
                run.append(a)
        flush(len(actions))
        return out

    def _split_for_graph(self, steps: list[_Step], host: set[str]) -> bool:
        """A CUDA graph holds the device work only: possible when no fallback reads a value a
        lowered step makes (fallbacks then run on the host before the graph's replay)."""
        made_on_device = {o for st in steps if st.lowered for o in st.outputs if o}
        return all(not (set(st.inputs) & made_on_device) for st in steps if not st.lowered)

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

    # -- CUDA graphs ---------------------------------------------------------------------------
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


def _is_host(action: _Action) -> bool:
    return getattr(action[0], "host", False)


def _execute(actions: list[_Action], vals: list, counts: list[int] | None = None) -> None:
    """The hot loop: every action's kernel on its input slots; results cast to the output dtypes.
    `counts`: a list to append the number of values each kernel returned to."""
    for fn, ins, outs, casts in actions:
        res = fn([vals[i] for i in ins])
        if counts is not None:
            counts.append(len(res))
        for o, v, want in zip(outs, res, casts):
            vals[o] = v if want is None or v.dtype == want else v.to(want)


def _straight_line(actions: list[_Action], counts: list[int]) -> Callable[[list], None]:
    """_execute's loop unrolled into one generated function, a statement per kernel call and per
    result, slots and dtypes as literals and names: the same calls and casts, without the loop's
    list building, zip and tuple unpacking, which cost ~1.5 us per action (a step has hundreds).
    `counts`: how many values each kernel returns (fixed: a kernel's outputs are its node's)."""
    env: dict[str, Any] = {}
    lines = ["def step(v):"]
    for a, ((fn, ins, outs, casts), n) in enumerate(zip(actions, counts)):
        env[f"k{a}"] = fn
        call = f"k{a}([{', '.join(f'v[{i}]' for i in ins)}])"
        pairs = list(zip(outs, casts))[:n]
        if len(pairs) == 1 and pairs[0][1] is None:
            lines.append(f"    v[{pairs[0][0]}] = {call}[0]")
            continue
        lines.append(f"    r = {call}")
        for j, (o, want) in enumerate(pairs):
            if want is None:
                lines.append(f"    v[{o}] = r[{j}]")
            else:  # torch dtypes are singletons: `is` is their equality
                env[f"c{a}_{j}"] = want
                lines.append(f"    x = r[{j}]; v[{o}] = x if x.dtype is c{a}_{j} else x.to(c{a}_{j})")
    lines.append("    return None")
    exec(compile("\n".join(lines), "<anygrad torch step>", "exec"), env)  # noqa: S102 - our own code
    return env["step"]


def _host_fn(fn: Callable) -> Callable:
    """A host function of one host value as a host action's kernel."""
    def run(ins: list) -> list:
        return [fn(ins[0])]
    run.host = True  # type: ignore[attr-defined]
    return run


def _grouped_fn(kernel: Callable, sizes: list[int]) -> Callable:
    """A grouped kernel over the flat input list of its nodes, returning their outputs flat."""
    bounds = np.cumsum([0] + sizes).tolist()

    def run(ins: list) -> list:
        groups = [ins[a:b] for a, b in itertools.pairwise(bounds)]
        return [v for outs in kernel(groups) for v in outs]
    return run


def _segment_fn(actions: list[_Action], reads: list[int], writes: list[int]) -> Callable:
    """Lowered actions as one function of their outside inputs (the unit torch.compile traces)."""
    def run(*values: Any) -> tuple:
        env: dict[int, Any] = dict(zip(reads, values))
        env[_NONE] = None
        for fn, ins, outs, casts in actions:
            res = fn([env[i] for i in ins])
            for o, v, want in zip(outs, res, casts):
                env[o] = v if want is None or v.dtype == want else v.to(want)
        return tuple(env[w] for w in writes)
    return run


def _check_targets(target: np.ndarray, classes: int, ignore: int | None, label: str) -> None:
    """ops.loss's check of class-index targets, on the host copy the caller fed."""
    bad = ((target < 0) | (target >= classes)) & (target != ignore if ignore is not None else True)
    if bad.any():
        raise DataError(f"{label}: target class index {int(target[bad].flat[0])} is outside [0, {classes}); "
                        "check the labels or the model's number of classes")


class TorchBackend(Backend):
    """A torch device (CUDA, MPS or CPU). State tensors live on it, shared by all executables."""

    name = "torch"

    def __init__(self, device: str = "torch", torch_compile: bool | str | None = None,
                 cuda_graph: bool | None = None):
        """`device`: torch, torch:cuda[:N], torch:mps or torch:cpu (torch: CUDA, else MPS, else CPU).
        `torch_compile`: trace the step with torch.compile (True: inductor; a string: that
        torch.compile backend, e.g. "aot_eager"); None: ANYGRAD_TORCH_COMPILE (1 or a backend name).
        `cuda_graph`: on CUDA, capture each step's device work as a CUDA graph on its third run and
        replay it after; None: yes, unless ANYGRAD_TORCH_CUDA_GRAPH=0."""
        self.torch = _torch()
        self.device = self.torch.device(resolve_device(device))
        if torch_compile is None:
            torch_compile = settings.get("ANYGRAD_TORCH_COMPILE")
            torch_compile = torch_compile if torch_compile not in ("0", "1") else torch_compile == "1"
        if cuda_graph is None:
            cuda_graph = settings.get("ANYGRAD_TORCH_CUDA_GRAPH")
        self.set_torch_compile(torch_compile)
        self.cuda_graph = bool(cuda_graph)
        self.state: dict[str, Any] = {}
        self.name = f"torch:{self.device.type}"

    def set_torch_compile(self, torch_compile: bool | str) -> None:
        """Whether (and with which torch.compile backend, default inductor) the executables this
        backend compiles from now on trace their steps with torch.compile."""
        backend = torch_compile if isinstance(torch_compile, str) else "inductor"
        if backend != "inductor":
            from torch._dynamo import list_backends
            known = list_backends(exclude_tags=())
            if backend not in known:
                raise ConfigError(f"torch.compile has no backend '{backend}'; use one of {', '.join(sorted(known))}")
        self.torch_compile = bool(torch_compile)
        self.compile_backend = backend

    @property
    def description(self) -> str:
        what = self.device.type
        if self.device.type == "cuda":
            what = f"cuda: {self.torch.cuda.get_device_name(self.device)}"
        compiled = ", torch.compile" if self.torch_compile else ""
        compiled += f" ({self.compile_backend})" if self.torch_compile and self.compile_backend != "inductor" else ""
        compiled += ", CUDA graphs" if self.cuda_graph and self.device.type == "cuda" else ""
        return f"torch {self.torch.__version__} ({what}{compiled})"

    def supports(self, op: str | Node) -> bool:
        """Every registered op: a torch kernel, else the numpy reference kernel on the host."""
        return get_op(op.op if isinstance(op, Node) else op) is not None

    def lowered(self, op: str | Node) -> bool:
        """Whether an op has a torch kernel (some node configurations may still fall back)."""
        return (op.op if isinstance(op, Node) else op) in LOWERINGS

    def compile(self, graph: Graph) -> TorchExecutable:
        resolve_attributes(graph)  # the lowerings read explicit attributes (ir/passes.py)
        for name in graph.state_names:
            if name not in self.state and name in graph.initializers:
                self.set_state(name, graph.initializers[name])
        return TorchExecutable(self, graph, torch_compile=self.torch_compile, cuda_graph=self.cuda_graph)

    def get_state(self, name: str) -> np.ndarray:
        return np.array(to_numpy(self.state[name]))

    def held(self, value: Any) -> Any:
        """How the store holds a value: a tensor on the device, or a host array for dtypes torch lacks."""
        if is_tensor(value) or np.asarray(value).dtype not in TORCH_DTYPES:
            return value
        return to_torch(value, self.device)

    def upload(self, value: Any) -> Any:
        """A host value (or a tensor) as a tensor on the device; dtypes torch lacks but int64 holds
        (WIDENED) become int64. To a GPU through pinned memory, asynchronously: a copy from pageable
        memory would wait for every kernel queued before it, once per step and per input."""
        if is_tensor(value):
            return value if value.device == self.device else value.to(self.device)
        if self.device.type != "cuda":
            return to_torch(value, self.device)
        arr = np.asarray(value)
        if arr.dtype in WIDENED:
            arr = arr.astype(np.int64)
        pinned = self.torch.empty(arr.shape, dtype=torch_dtype(arr.dtype), pin_memory=True)
        pinned.numpy()[...] = arr  # the caching host allocator reuses it once the copy is done
        return pinned.to(self.device, non_blocking=True)

    def set_state(self, name: str, value: np.ndarray) -> None:
        # an inference tensor, as every value a step makes (and then stores) is: torch.compile
        # guards on that difference, and would trace each compiled part a second time on step 2
        with self.torch.inference_mode():
            self.state[name] = self.held(np.array(value))

    def has_state(self, name: str) -> bool:
        return name in self.state

    def release(self) -> None:
        super().release()
        if self.device.type == "cuda":  # torch's caching allocator keeps freed blocks: give them back
            self.torch.cuda.empty_cache()
