"""Graph rewrites before lowering (on a copy): fewer, bigger kernels.

- Elementwise fusion groups elementwise nodes of one output shape into a `wgpu.Fused` node
  evaluated per element in registers. A group is emitted at the position of its last member, so
  a node may join a group only when no node outside the group, placed before it, reads a value
  the group produces (that reader would otherwise run before the group's kernel); this also rules
  out cycles. Independent groups of one shape then merge the same way (horizontal fusion).
- Transposes, Slices, Concats and constant scales around a MatMul/Gemm become its operand and
  result layouts (gemm_layout.py): the GEMM's loads and stores do the data movement.
- GEMM -> Add(bias) -> activation and Conv -> Relu: bias and activation run in the GEMM's
  epilogue (a third input, attrs `_epilogue`/`_epilogue_attrs`). Under float16 each fused step
  whose result the graph holds in float16 rounds to f16 there (attr `_round`), so the fused
  kernel gives the bits the separate kernels would (ANYGRAD_WGPU_F16_EPILOGUES=0: float32 only).
- Optimizer updates of one kind become one `wgpu.FusedUpdate` over arenas (see group_updates).
- Under float16 (ANYGRAD_WGPU_F16_ARENA): the loss scaler's test (FoundInf) reads each gradient
  arena in one reduction (arena_finite_check), and the weights' float16 copies are one cast of the
  parameter arena (arena_weight_casts).
- Dropout outside training becomes an Identity, which the planner aliases.
- Graph inputs of 1-byte elements (uint8 images) are uploaded four per u32 word and unpacked by an
  elementwise node, which fuses into whatever elementwise chain reads them (see pack_byte_inputs).

prepare() (here) runs the passes in order; each kind lives in its module: elementwise.py (groups
into wgpu.Fused, horizontal merging), gemm_epilogues.py (epilogues and operand-load prologues),
gemm_layout.py (layouts), casts.py (float casts on the float32 islands' edges), arenas.py
(optimizer updates over parameter arenas, the float16 arena passes). The small rewrites (BatchNorm
split, identities, 1-byte inputs) are here.
"""
from __future__ import annotations

import numpy as np

from .... import settings
from ....ir.graph import Graph, Node, TensorInfo
from ....ir.passes import resolve_attributes
from ....ir.private_attrs import check_graph
from ..kernels.kernel import AdapterCaps
from ..kernels.kernels_elementwise import UNPACK_BYTES
from ..kernels.kernels_nn import BN_APPLY, BN_STATS
from ..kernels.kernels_optim import FUSED_UPDATE
from ..kernels.wgsl import shape_of
from .arenas import arena_finite_check, arena_weight_casts, group_updates
from .casts import fold_float_casts
from .elementwise import fold_elementwise_views, fuse_elementwise
from .gemm_epilogues import fuse_epilogues, fuse_prologues
from .gemm_layout import (
    canonical_transposes,
    fold_concats,
    fold_result_layouts,
    fold_scales,
    fold_transposes,
    fold_views,
    scale_fold_enabled,
    slice_views_enabled,
)


def split_batchnorm(graph: Graph) -> None:
    """Every training BatchNormalization as its statistics (BN_STATS, a reduction) and its
    normalisation (BN_APPLY, an elementwise op), so that fuse_elementwise runs the normalisation
    in the kernel of the ReLU or residual Add after it: one pass over the activation instead of
    two, and the BN output is stored only when something outside that kernel reads it (the
    backward reads the BN input and the ReLU output). ANYGRAD_WGPU_BN_SPLIT=0 keeps the node
    whole (A/B runs)."""
    if not settings.get("ANYGRAD_WGPU_BN_SPLIT"):
        return
    nodes = []
    for n in graph.nodes:
        x = n.input(0)
        if n.op != "BatchNormalization" or not n.attr("training_mode", 0) or len(shape_of(graph, x)) < 2:
            nodes.append(n)
            continue
        shape = shape_of(graph, x)
        channels, spatial = shape[1], int(np.prod(shape[2:], dtype=np.int64))
        stats = f"{n.outputs[0]}@bnstats"
        graph.info[stats] = TensorInfo(np.dtype(np.float32), (2 * channels,))
        running = (list(n.outputs[1:3]) + ["", ""])[:2]
        origin = {"_origin": n.label}  # errors name the model's node (planner._label)
        nodes.append(Node(BN_STATS, list(n.inputs[:5]), [stats] + running, {**n.attrs, **origin}, name=n.name))
        nodes.append(Node(BN_APPLY, [x, n.inputs[1], n.inputs[2], stats], [n.outputs[0]],
                          {"channels": channels, "spatial": spatial, **origin}, name=f"{n.name}/apply"))
    graph.nodes = nodes


def inference_dropout_to_identity(graph: Graph) -> None:
    """Dropout outside training (no training flag, or a constant false one) is the identity: make it
    an Identity, which the planner turns into an alias (no kernel), when its mask is unused."""
    users = graph.consumers()
    for n in graph.nodes:
        if n.op != "Dropout" or any(users.get(o) or o in graph.outputs for o in n.outputs[1:] if o):
            continue
        flag = n.input(2)
        if flag and (flag not in graph.initializers or bool(np.asarray(graph.initializers[flag]).reshape(()))):
            continue
        n.op, n.inputs, n.outputs, n.attrs = "Identity", [n.inputs[0]], [n.outputs[0]], {}


def whole_slices_to_identity(graph: Graph) -> None:
    """A Slice that takes all of its input in order (and the SliceGrad of one) is the identity:
    make it an Identity, which the planner aliases. Hugging Face's causal LMs slice the last
    hidden state this way for `logits_to_keep=0`, a copy of (batch, tokens, d) each way."""
    for n in graph.nodes:
        if n.op not in ("Slice", "SliceGrad") or not n.inputs or not n.outputs[0]:
            continue
        steps = n.attrs.get("steps")
        if (steps is not None and all(int(k) == 1 for k in steps)
                and shape_of(graph, n.inputs[0]) == shape_of(graph, n.outputs[0])
                and graph.info[n.inputs[0]].dtype == graph.info[n.outputs[0]].dtype):
            n.op, n.inputs, n.outputs, n.attrs = "Identity", [n.inputs[0]], [n.outputs[0]], {}


# -- 1-byte graph inputs ----------------------------------------------------------------------------
PACKED = "@u8x4:"   # prefix of the packed input standing in for a 1-byte graph input
BYTE_DTYPES = frozenset({np.dtype(np.uint8), np.dtype(np.int8), np.dtype(np.bool_)})


def packed_name(name: str) -> str:
    return PACKED + name


def pack_byte_inputs(graph: Graph) -> None:
    """Upload uint8/int8/bool graph inputs as they are stored, four elements per u32 word.

    The input becomes '@u8x4:<name>' (the array's bytes seen as u32 words, padded to a whole word,
    so a batch uploads x.nbytes rounded up to 4), and a wgpu.UnpackBytes node in front of the graph
    recomputes <name> as one u32/i32 per element, the kernel contract every consumer expects. The
    unpack is elementwise, so it fuses into the elementwise chain reading the input (the Cast ->
    Sub -> Div of an in-graph normalisation reads the words directly); any other consumer reads it
    from a temporary it writes. The runtime writes the feed of <name> into '@u8x4:<name>'."""
    unpack = []
    for k, name in enumerate(graph.inputs):
        info = graph.info[name]
        if np.dtype(info.dtype) not in BYTE_DTYPES or info.size == 0:
            continue
        packed = packed_name(name)
        graph.info[packed] = TensorInfo(np.dtype(np.uint32), (-(-info.size // 4),))
        graph.inputs[k] = packed
        unpack.append(Node(UNPACK_BYTES, [packed], [name], name=f"unpack {name}"))
    graph.nodes = unpack + graph.nodes


def prepare(graph: Graph, caps: AdapterCaps, supports_epilogue: set[str], fuse: bool = True) -> Graph:
    """A copy of graph rewritten for lowering (its attributes resolved: what the lowerings read)."""
    g = resolve_attributes(graph.copy())
    protected = set(g.outputs) | set(g.state_updates)
    inference_dropout_to_identity(g)
    whole_slices_to_identity(g)
    pack_byte_inputs(g)  # not an optimisation: the runtime uploads those inputs packed either way
    if fuse:
        # first, so that the optimizer grouping sees the GEMMs that now read the weights directly
        if scale_fold_enabled():
            canonical_transposes(g, protected)
        fold_transposes(g, protected)
        if scale_fold_enabled():
            fold_scales(g, protected)        # a scale between a Transpose and a MatMul, once the
            fold_transposes(g, protected)    # MatMuls read through the others, then that Transpose
        if slice_views_enabled():
            fold_views(g, protected, caps)
        group_updates(g, caps)
        arena_finite_check(g)  # after group_updates: the gradient arenas it reduces
        arena_weight_casts(g)
        # Gradients computed into their arena slice are read only through FusedUpdate's attrs.
        claimed = {v for n in g.nodes if n.op == FUSED_UPDATE for v in n.attrs["grads"]}
        protected = set(g.outputs) | set(g.state_updates) | claimed
        fuse_epilogues(g, protected, supports_epilogue)
        fuse_prologues(g, protected, caps)
        fold_float_casts(g, protected)
        split_batchnorm(g)
        fuse_elementwise(g, caps, protected)
        if slice_views_enabled():
            fold_elementwise_views(g, protected, caps)
        if slice_views_enabled():
            fold_result_layouts(g, protected)  # after the epilogues, which it must not meet
            fold_concats(g, protected, caps)   # last: it gives a value several writers
    check_graph(g.nodes)  # every private attribute the rewrites (and pins) set is declared
    return g
