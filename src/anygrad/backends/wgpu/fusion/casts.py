"""Float casts on the edges of mixed precision's float32 islands (norms, softmax) folded into the
row kernels' loads and stores (fold_float_casts): no kernel of their own.
"""
from __future__ import annotations

import numpy as np

from .... import settings
from ....ir.graph import Graph

# Row kernels of mixed precision's float32 islands (autocast computes norms and softmax in f32):
# the float16 values on their edges are read and written through halfstore.py's conversions.
FLOAT_ISLANDS = frozenset({"LayerNormalization", "LayerNormGrad", "RMSNormalization", "RMSNormGrad",
                           "Softmax", "SoftmaxGrad", "LogSoftmax", "LogSoftmaxGrad"})


def cast_fold_enabled() -> bool:
    """ANYGRAD_WGPU_CAST_FOLD=0: float Casts on the edges of the float32 islands stay kernels."""
    return settings.get("ANYGRAD_WGPU_CAST_FOLD")


def fold_float_casts(graph: Graph, protected: set[str]) -> None:
    """Casts between float32 and float16 on the edges of the float32 islands cost no kernel:
    - a row kernel whose float32 result only a Cast to float16 reads stores the float16 value
      itself (its store rounds as the Cast would: the same conversion, the same bits);
    - a float16 value widened by a Cast that only row kernels read is read by them directly (the
      widening is exact, and their reads convert).
    26 of the d-256 GPT's 34 f16 Cast kernels (the 34 took 3% of its H200 step)."""
    if not cast_fold_enabled():
        return
    producers = graph.producers()
    users = {v: [r for r, _ in rs] for v, rs in graph.consumers().items()}
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    dropped: set[int] = set()
    for n in graph.nodes:
        if n.op != "Cast" or len(n.inputs) != 1 or n.inputs[0] not in graph.info or n.outputs[0] not in graph.info:
            continue
        x, y = n.inputs[0], n.outputs[0]
        src, dst = np.dtype(graph.info[x].dtype), np.dtype(graph.info[y].dtype)
        p = producers.get(x)
        if (src, dst) == (f32, f16) and p is not None and p.op in FLOAT_ISLANDS and x not in protected \
                and [id(r) for r in users.get(x, [])] == [id(n)]:
            p.outputs[p.outputs.index(x)] = y
            producers[y] = p
        elif (src, dst) == (f16, f32) and y not in protected and users.get(y) \
                and all(r.op in FLOAT_ISLANDS for r in users[y]):
            for r in users[y]:
                r.inputs[:] = [x if v == y else v for v in r.inputs]
            users[x] = [r for r in users.get(x, []) if r is not n] + users[y]
        else:
            continue
        dropped.add(id(n))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
