"""The compiled plan's form and the loops that run it: an action is (kernel, input slots, output
slots, output dtypes) over one flat list of values indexed by integers, so a step is one tight
loop with no name lookups or per-value checks (`_execute`), or the same loop unrolled into one
generated function (`_straight_line`); and the small wrappers that make host functions and
grouped kernels into actions.

Separate because every way of running the plan (eager, torch.compile'd runs, CUDA-graph capture)
shares this form and these loops, and none of them needs the executable to do so.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

# An action of the precompiled plan: fn(list of input values) -> list of output values, the input
# and output slots (integers into the step's value list), and per output the torch dtype the value
# is cast to (None: keep). Slot 0 holds None (absent optional inputs), slot 1 takes unused outputs.
_Action = tuple[Callable, list[int], list[int], list[Any]]
_NONE, _DROP = 0, 1


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
