"""torch.compile over the plan (`torch_compile=True`: `anygrad train --compile`, or
ANYGRAD_TORCH_COMPILE=1): each maximal run of lowered actions between two host actions becomes
one function traced by `torch.compile`
(inductor, default mode; a string names another torch.compile backend, e.g. "aot_eager", which
needs no C++ compiler). Not torch's own CUDA graphs ("reduce-overhead"): those reuse their output
buffers on the next call, and the step's outputs are the next step's state. With `cuda_graph` as
well, the compiled functions' kernels are captured by the CUDA graph (cuda_graph.py), on the third
run, once the first has compiled them.

Separate because it is an optional rewrite of a finished plan: it reads the actions and gives
back actions, and nothing else in the executable depends on how the runs were traced.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .actions import _DROP, _NONE, _Action, _is_host
from .device import _torch


def _compile_runs(actions: list[_Action], at_end: set[int], backend: str) -> tuple[list[_Action], set[int]]:
    """Each maximal run of lowered actions as one function traced by torch.compile (with that
    torch.compile backend), and the slots the step keeps (the compiled functions' returns, and
    `at_end`: the step's outputs and state updates). A function returns only the values
    something after it reads (a later action, or `at_end`): every other value is inductor's to
    fuse away, not to materialise."""
    torch = _torch()
    out: list[_Action] = []
    run: list[_Action] = []
    read_after: list[set[int]] = [set() for _ in range(len(actions) + 1)]  # read at or after action p
    for p in range(len(actions) - 1, -1, -1):
        read_after[p] = read_after[p + 1] | set(actions[p][1])
    keep = set(at_end)

    def flush(end: int) -> None:
        if not run:
            return
        made: set[int] = set()
        reads: list[int] = []
        for _, ins, outs, _ in run:
            reads += [i for i in ins if i not in made and i not in reads and i != _NONE]
            made.update(outs)
        writes = sorted((made - {_DROP}) & (read_after[end] | at_end))
        keep.update(writes)
        fn = torch.compile(_segment_fn(list(run), reads, writes), dynamic=False, backend=backend)
        out.append((lambda ins, fn=fn: fn(*ins), reads, writes, [None] * len(writes)))
        run.clear()

    for p, a in enumerate(actions):
        if _is_host(a):
            flush(p)
            out.append(a)
        else:
            run.append(a)
    flush(len(actions))
    return out, keep


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
