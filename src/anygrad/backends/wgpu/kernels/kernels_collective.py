"""AllReduceSum (ops/collective.py) on wgpu: a host step inside the compiled step.

The lowering is one copy kernel named "host:AllReduceSum:<mode>". Alone (a run without an
Exchange.reduce) the executor dispatches it like any kernel: the sum over one replica is the value.
With one (DataParallel with --sync-batchnorm) the executor ends the compute pass before it, reads
its input back, lets the reducer meet the other replicas on the host, writes the result where the
kernel would have, and goes on with the rest of the step (runtime/encode.py: _encode_dispatches).
"""
from __future__ import annotations

import numpy as np

from ....ir.graph import Graph, Node
from .kernel import AdapterCaps, Kernel, lowering
from .wgsl import bindings, flat_id, grid, shader

HOST_PREFIX = "host:"


@lowering("AllReduceSum")
def _all_reduce_sum(node: Node, g: Graph, caps: AdapterCaps) -> list[Kernel]:
    n = max(1, int(np.prod(g.info[node.outputs[0]].shape, dtype=np.int64)))
    body = f"{flat_id()}\n  if (i < {n}u) {{ y[i] = x[i]; }}"
    wgsl = shader(bindings([("x", "f32")], [("y", "f32")]), body)
    return [Kernel(f"{HOST_PREFIX}AllReduceSum:{node.attr('mode', 'sum')}", wgsl, grid(n),
                   (node.inputs[0],), (node.outputs[0],))]
