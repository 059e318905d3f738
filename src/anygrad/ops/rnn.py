"""Recurrent ops: LSTM, GRU, RNN (ONNX semantics), as composites unrolled over the sequence.

Once shapes are static the sequence length is a number, so each op expands into one Gemm for
the input projections of all time steps, then per step a Gemm against R and elementwise gate
math (Split, Add, Mul, Sigmoid, Tanh...). Autodiff and every backend then only see primitives:
backpropagation through time is ordinary reverse mode over the unrolled graph.

Supported: direction forward / reverse / bidirectional, layout 0 and 1, optional B,
sequence_lens (steps past a sequence's end keep its state and output zeros), initial_h /
initial_c, LSTM peepholes (P) and input_forget, GRU linear_before_reset, clip, and the ONNX
activation functions with activation_alpha / activation_beta.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.builder import Builder
from ..ir.composite import defcomposite
from ..ir.graph import Node, TensorInfo


@dataclass(frozen=True)
class Cell:
    """What distinguishes the three recurrent ops."""

    gates: int                  # blocks in W / R (LSTM iofc, GRU zrh, RNN one)
    activations: tuple[str, ...]  # defaults, per direction (LSTM f g h, GRU f g, RNN f)
    has_cell: bool              # LSTM: a second state, initial_c input and Y_c output


CELLS = {"LSTM": Cell(4, ("Sigmoid", "Tanh", "Tanh"), True),
         "GRU": Cell(3, ("Sigmoid", "Tanh"), False),
         "RNN": Cell(1, ("Tanh",), False)}


# -- activation functions: name -> (takes alpha, takes beta, default alpha, default beta, builder) --
Act = Callable[[Builder, str, float, float], str]


def _scalar(b: Builder, x: str, value: float) -> str:
    return b.const(value, b.dtype(x), "scalar")


def _affine(b, x, alpha, beta):
    return b.op("Add", [b.op("Mul", [x, _scalar(b, x, alpha)]), _scalar(b, x, beta)])


def _scaled_tanh(b, x, alpha, beta):
    return b.op("Mul", [b.op("Tanh", [b.op("Mul", [x, _scalar(b, x, beta)])]), _scalar(b, x, alpha)])


def _thresholded_relu(b, x, alpha, beta):
    keep = b.op("Cast", [b.op("Greater", [x, _scalar(b, x, alpha)])], to=_onnx_float(b.dtype(x)))
    return b.op("Mul", [x, keep])


def _onnx_float(dtype: np.dtype) -> int:
    return {np.dtype(np.float16): 10, np.dtype(np.float32): 1, np.dtype(np.float64): 11}[np.dtype(dtype)]


def _plain(op: str) -> Act:
    return lambda b, x, alpha, beta: b.op(op, [x])


ACTIVATIONS: dict[str, tuple[bool, bool, float, float, Act]] = {
    "sigmoid": (False, False, 0.0, 0.0, _plain("Sigmoid")),
    "tanh": (False, False, 0.0, 0.0, _plain("Tanh")),
    "relu": (False, False, 0.0, 0.0, _plain("Relu")),
    "softsign": (False, False, 0.0, 0.0, _plain("Softsign")),
    "softplus": (False, False, 0.0, 0.0, _plain("Softplus")),
    "leakyrelu": (True, False, 0.01, 0.0, lambda b, x, a, _: b.op("LeakyRelu", [x], alpha=a)),
    "elu": (True, False, 1.0, 0.0, lambda b, x, a, _: b.op("Elu", [x], alpha=a)),
    "thresholdedrelu": (True, False, 1.0, 0.0, _thresholded_relu),
    "hardsigmoid": (True, True, 0.2, 0.5, lambda b, x, a, be: b.op("HardSigmoid", [x], alpha=a, beta=be)),
    "affine": (True, True, 1.0, 0.0, _affine),
    "scaledtanh": (True, True, 1.0, 1.0, _scaled_tanh),
}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- attributes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    cell: Cell
    hidden: int
    directions: tuple[bool, ...]          # per direction: runs backwards in time
    layout: int
    acts: tuple[tuple[Callable[[Builder, str], str], ...], ...]  # per direction, per slot
    clip: float | None
    input_forget: bool
    linear_before_reset: bool


def _bind(fn: Act, alpha: float, beta: float) -> Callable[[Builder, str], str]:
    return lambda b, x: fn(b, x, alpha, beta)


def config(node: Node, r_shape) -> Config:
    cell = CELLS[node.op]
    direction = _text(node.attr("direction", "forward"))
    directions = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}.get(direction)
    if directions is None:
        raise ShapeError(f"{node.label}: unknown direction '{direction}'")
    hidden = int(node.attr("hidden_size", r_shape[-1]))
    if tuple(r_shape[1:]) != (cell.gates * hidden, hidden) or r_shape[0] != len(directions):
        raise ShapeError(f"{node.label}: R has shape {tuple(r_shape)}, expected "
                         f"{(len(directions), cell.gates * hidden, hidden)}")
    layout = int(node.attr("layout", 0))
    if layout not in (0, 1):
        raise ShapeError(f"{node.label}: layout {layout} must be 0 or 1")
    names = [_text(a) for a in (node.attr("activations") or cell.activations * len(directions))]
    per_dir = len(cell.activations)
    if len(names) != per_dir * len(directions):
        raise ShapeError(f"{node.label}: {len(names)} activations {names}, expected {per_dir} per direction")
    alphas, betas = list(node.attr("activation_alpha") or []), list(node.attr("activation_beta") or [])
    bound = []
    for name in names:  # alphas / betas are consumed in order by the functions that take them
        entry = ACTIVATIONS.get(name.lower())
        if entry is None:
            raise UnsupportedOpError(f"{node.label}: activation '{name}' is not supported "
                                     f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        takes_a, takes_b, alpha, beta, fn = entry
        if takes_a and alphas:
            alpha = float(alphas.pop(0))
        if takes_b and betas:
            beta = float(betas.pop(0))
        bound.append(_bind(fn, alpha, beta))
    acts = tuple(tuple(bound[d * per_dir:(d + 1) * per_dir]) for d in range(len(directions)))
    clip = node.attr("clip")
    return Config(cell, hidden, directions, layout, acts, None if clip is None else float(clip),
                  bool(node.attr("input_forget", 0)), bool(node.attr("linear_before_reset", 0)))


def _infer(node: Node, ins: list[TensorInfo]) -> list[TensorInfo]:
    x, w, r = ins[0], ins[1], ins[2]
    if x.rank != 3 or w.rank != 3 or r.rank != 3:
        raise ShapeError(f"{node.label}: X, W and R must be 3-D, got {tuple(x.shape)}, {tuple(w.shape)}, "
                         f"{tuple(r.shape)}")
    cfg = config(node, r.shape)
    if tuple(w.shape[:2]) != (len(cfg.directions), cfg.cell.gates * cfg.hidden) or w.shape[2] != x.shape[2]:
        raise ShapeError(f"{node.label}: W has shape {tuple(w.shape)}, expected "
                         f"{(len(cfg.directions), cfg.cell.gates * cfg.hidden, x.shape[2])}")
    seq, batch = (x.shape[0], x.shape[1]) if cfg.layout == 0 else (x.shape[1], x.shape[0])
    d, h = len(cfg.directions), cfg.hidden
    y = (seq, d, batch, h) if cfg.layout == 0 else (batch, seq, d, h)
    state = (d, batch, h) if cfg.layout == 0 else (batch, d, h)
    outs = [TensorInfo(x.dtype, y), TensorInfo(x.dtype, state), TensorInfo(x.dtype, state)]
    if len(node.outputs) > 2 and not cfg.cell.has_cell:
        raise ShapeError(f"{node.label}: {node.op} has 2 outputs, got {len(node.outputs)}")
    return outs[:max(1, len(node.outputs))]


# -- expansion ----------------------------------------------------------------------------------
class Unroller:
    """Builds one recurrent node's expansion; layout-0 tensors throughout."""

    def __init__(self, b: Builder, node: Node):
        self.b, self.node = b, node
        self.cfg = config(node, b.shape(node.inputs[2]))
        x = node.inputs[0]
        if self.cfg.layout == 1:
            x = b.op("Transpose", [x], perm=[1, 0, 2])
        self.x = x
        self.seq, self.batch, self.input = b.shape(x)
        self.dtype = b.dtype(x)
        self.masks = self._masks(node.input(4))

    # -- helpers --
    def const(self, value, hint="const") -> str:
        return self.b.const(np.asarray(value, self.dtype), self.dtype, hint)

    def per_direction(self, name: str, state: bool = False) -> list[str | None]:
        """Direction slices of W / R / B / P (dim 0) or of an initial state; None when absent."""
        if not name:
            return [None] * len(self.cfg.directions)
        b = self.b
        if state and self.cfg.layout == 1:
            name = b.op("Transpose", [name], perm=[1, 0, 2])
        parts = b.ops("Split", [name], len(self.cfg.directions), axis=0) if len(self.cfg.directions) > 1 else [name]
        return [b.reshape(p, b.shape(p)[1:]) for p in parts]

    def split(self, v: str, n: int) -> list[str]:
        return self.b.ops("Split", [v], n, axis=1) if n > 1 else [v]

    def _masks(self, lens: str) -> list[str] | None:
        """Per step (B, 1) 1/0 masks of the steps inside each sequence; None when all are full."""
        if not lens:
            return None
        b = self.b
        info = b.info(lens)
        if info.const is not None:
            lens_v = np.asarray(info.const).reshape(-1)
            if np.all(lens_v >= self.seq):
                return None
            return [self.const((t < lens_v).reshape(-1, 1), "mask") for t in range(self.seq)]
        masks = []
        for t in range(self.seq):
            inside = b.op("Less", [b.const(t, info.dtype, "step"), lens])
            m = b.op("Cast", [inside], to=_onnx_float(self.dtype))
            masks.append(b.reshape(m, (self.batch, 1)))
        return masks

    # -- the unroll --
    def run(self) -> list[str]:
        node, b, cfg = self.node, self.b, self.cfg
        ws, rs, bs = (self.per_direction(node.input(i)) for i in (1, 2, 3))
        h0s = self.per_direction(node.input(5), state=True)
        c0s = self.per_direction(node.input(6), state=True) if cfg.cell.has_cell else [None] * len(ws)
        ps = self.per_direction(node.input(7)) if cfg.cell.has_cell else [None] * len(ws)
        ys, hs, cs = [], [], []
        flat_x = b.reshape(self.x, (self.seq * self.batch, self.input))
        for d, backwards in enumerate(cfg.directions):
            y, h, c = self.direction(d, backwards, flat_x, ws[d], rs[d], bs[d], h0s[d], c0s[d], ps[d])
            ys.append(y)
            hs.append(h)
            cs.append(c)
        outs = []
        if node.outputs[0]:
            y = ys[0] if len(ys) == 1 else b.op("Concat", ys, axis=1)  # (T, D, B, H)
            outs.append(b.op("Transpose", [y], perm=[2, 0, 1, 3]) if cfg.layout == 1 else y)
        else:
            outs.append("")
        for want, states in zip(node.outputs[1:], (hs, cs)):
            if not want:
                outs.append("")
                continue
            parts = [b.reshape(s, (1, self.batch, cfg.hidden)) for s in states]
            s = parts[0] if len(parts) == 1 else b.op("Concat", parts, axis=0)
            outs.append(b.op("Transpose", [s], perm=[1, 0, 2]) if cfg.layout == 1 else s)
        return outs

    def direction(self, d, backwards, flat_x, w, r, bias, h0, c0, p):
        b, cfg = self.b, self.cfg
        H, G = cfg.hidden, cfg.cell.gates
        # Input projections of every step at once; both biases folded in, except GRU's Rbh
        # when the reset gate multiplies (h R_h^T + Rbh).
        rbh = None
        if bias is not None:
            wb, rb = b.ops("Split", [bias], 2, axis=0)
            if self.node.op == "GRU" and cfg.linear_before_reset:
                rzr, rbh = b.ops("Split", [rb], 2, axis=0, split=[2 * H, H])
                rb = b.op("Concat", [rzr, self.const(np.zeros(H), "zeros")], axis=0)
            xw = b.op("Gemm", [flat_x, w, b.op("Add", [wb, rb])], transB=1)
        else:
            xw = b.op("Gemm", [flat_x, w], transB=1)
        xw = b.reshape(xw, (self.seq, self.batch, G * H))
        steps = b.ops("Split", [xw], self.seq, axis=0) if self.seq > 1 else [xw]
        steps = [b.reshape(s, (self.batch, G * H)) for s in steps]
        h = h0 if h0 is not None else self.const(np.zeros((self.batch, H)), "h0")
        c = c0 if c0 is not None else self.const(np.zeros((self.batch, H)), "c0")
        # Per-direction pieces every step uses, cut once: R blocks, peephole vectors.
        if self.node.op == "GRU" and not cfg.linear_before_reset:
            r = tuple(b.ops("Split", [r], 2, axis=0, split=[2 * H, H]))
        if p is not None:
            p = self.split(b.reshape(p, (1, 3 * H)), 3)
        order = range(self.seq - 1, -1, -1) if backwards else range(self.seq)
        outputs: dict[int, str] = {}
        step = {"LSTM": self.lstm_step, "GRU": self.gru_step, "RNN": self.rnn_step}[self.node.op]
        for t in order:
            h_new, c_new = step(d, steps[t], h, c, r, rbh, p)
            if self.masks is None:
                outputs[t], h, c = h_new, h_new, c_new
            else:  # past a sequence's end: state kept, output zero
                m = self.masks[t]
                outputs[t] = b.op("Mul", [h_new, m])
                h = b.op("Add", [h, b.op("Mul", [b.op("Sub", [h_new, h]), m])])
                if cfg.cell.has_cell:
                    c = b.op("Add", [c, b.op("Mul", [b.op("Sub", [c_new, c]), m])])
        if self.node.outputs[0]:
            parts = [b.reshape(outputs[t], (1, 1, self.batch, H)) for t in range(self.seq)]
            y = parts[0] if len(parts) == 1 else b.op("Concat", parts, axis=0)
        else:
            y = None
        return y, h, c

    def pre(self, v: str) -> str:
        """Clip pre-activations (the `clip` attribute)."""
        if self.cfg.clip is None:
            return v
        lim = self.cfg.clip
        return self.b.op("Clip", [v, self.const(-lim, "lo"), self.const(lim, "hi")])

    def lstm_step(self, d, xw, h, c, r, rbh, p):
        b = self.b
        f_act, g_act, h_act = self.cfg.acts[d]
        gates = b.op("Add", [xw, b.op("Gemm", [h, r], transB=1)])
        i, o, f, cc = self.split(gates, 4)
        pi, po, pf = p if p is not None else (None,) * 3
        if pi is not None:
            i = b.op("Add", [i, b.op("Mul", [pi, c])])
            f = b.op("Add", [f, b.op("Mul", [pf, c])])
        i = f_act(b, self.pre(i))
        f = b.op("Sub", [self.const(1.0, "one"), i]) if self.cfg.input_forget else f_act(b, self.pre(f))
        c_new = b.op("Add", [b.op("Mul", [f, c]), b.op("Mul", [i, g_act(b, self.pre(cc))])])
        if po is not None:
            o = b.op("Add", [o, b.op("Mul", [po, c_new])])
        o = f_act(b, self.pre(o))
        return b.op("Mul", [o, h_act(b, c_new)]), c_new

    def gru_step(self, d, xw, h, c, r, rbh, p):
        b = self.b
        f_act, g_act = self.cfg.acts[d]
        xz, xr, xh = self.split(xw, 3)
        if self.cfg.linear_before_reset:
            hz, hr, hh = self.split(b.op("Gemm", [h, r], transB=1), 3)
            if rbh is not None:
                hh = b.op("Add", [hh, rbh])
        else:
            r_zr, r_h = r
            hz, hr = self.split(b.op("Gemm", [h, r_zr], transB=1), 2)
        z = f_act(b, self.pre(b.op("Add", [xz, hz])))
        reset = f_act(b, self.pre(b.op("Add", [xr, hr])))
        if self.cfg.linear_before_reset:
            cand = b.op("Add", [xh, b.op("Mul", [reset, hh])])
        else:
            cand = b.op("Add", [xh, b.op("Gemm", [b.op("Mul", [reset, h]), r_h], transB=1)])
        cand = g_act(b, self.pre(cand))
        # (1 - z) * cand + z * h, with one multiply
        return b.op("Add", [cand, b.op("Mul", [z, b.op("Sub", [h, cand])])]), c

    def rnn_step(self, d, xw, h, c, r, rbh, p):
        b = self.b
        (f_act,) = self.cfg.acts[d]
        return f_act(b, self.pre(b.op("Add", [xw, b.op("Gemm", [h, r], transB=1)]))), c


def _expand(b: Builder, node: Node) -> list[str]:
    return Unroller(b, node).run()


for _name in CELLS:
    defcomposite(_name, infer=_infer, expand=_expand, nondiff=[4])
