"""LSTM / GRU / RNN (ONNX semantics) forward and gradients against PyTorch in float64, exported
PyTorch models, ONNX-only attributes, and the unrolled graph on wgpu."""
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import anygrad
from anygrad.autodiff import gradients
from anygrad.backends import NumpyBackend
from anygrad.errors import AnygradError
from anygrad.ir import Builder, Graph, Node, TensorInfo, specialize

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
# ONNX gate blocks -> PyTorch's order: LSTM iofc -> ifgo (g = c), GRU zrh -> rzn (n = h)
TORCH_ORDER = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}
STATE = {"LSTM": 2, "GRU": 1, "RNN": 1}  # outputs besides Y


# -- running one node on anygrad -------------------------------------------------------------------------
def run_node(op, inputs, attrs, n_out, seed=0, skip=()):
    """Outputs and gradients of sum(out_k * R_k) over every output, for every float input.

    skip: output slots left absent ("") in the node; they come back as None."""
    g = Graph(name=op)
    names, diff = [], []
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if a.dtype.kind == "f":
            g.inputs.append(name)
            g.info[name] = TensorInfo(a.dtype, a.shape)
            diff.append(i)
        else:
            g.initializers[name] = a
    slots = [k for k in range(n_out) if k not in skip]
    outs = [f"out{k}" for k in slots]
    g.nodes = [Node(op, names, [f"out{k}" if k in slots else "" for k in range(n_out)], attrs, name="rnn")]
    g.outputs = list(outs)
    s = specialize(g, {})
    assert op not in {n.op for n in s.nodes}
    b = Builder(s, prefix="check")
    rng = np.random.default_rng(seed)
    rs = [rng.standard_normal(b.shape(o)).astype(b.dtype(o)) for o in outs]
    terms = [b.op("ReduceSum", [b.op("Mul", [o, b.const(r, b.dtype(o))])], keepdims=0) for o, r in zip(outs, rs)]
    loss = b.add_all(terms)
    gr = gradients(s, loss, [f"in{i}" for i in diff])
    s.outputs = outs + [gr[f"in{i}"] for i in diff]
    res = NumpyBackend().compile(s).run({f"in{i}": inputs[i] for i in diff})
    got = {k: res[o] for k, o in zip(slots, outs)}
    weights = dict(zip(slots, rs))
    return ([got.get(k) for k in range(n_out)], {i: res[gr[f"in{i}"]] for i in diff},
            [weights.get(k) for k in range(n_out)])


# -- the PyTorch reference: torch.nn.LSTM/GRU/RNN run on the ONNX tensors ------------------------------
def _to_torch(op, w, hidden):
    """(D, G*H, ...) ONNX blocks -> per direction torch (G*H, ...) in torch's gate order."""
    blocks = w.reshape(w.shape[0], GATES[op], hidden, *w.shape[2:])
    return [blocks[d][TORCH_ORDER[op]].reshape(GATES[op] * hidden, *w.shape[2:]) for d in range(w.shape[0])]


def _reverse_within(x, lens):
    """Reverse each batch column's first lens[b] steps (T, B, ...); the padding stays put."""
    t, nb = x.shape[:2]
    idx = torch.tensor([[lens[b] - 1 - i if i < lens[b] else i for b in range(nb)] for i in range(t)])
    return x.gather(0, idx.reshape(t, nb, *([1] * (x.dim() - 2))).expand_as(x))


def torch_reference(op, x, w, r, bias, lens, h0, c0, *, hidden, direction, layout, nonlinearity="tanh"):
    """ONNX outputs (Y, Y_h[, Y_c]) computed with torch's own recurrent modules (float64)."""
    dirs = 2 if direction == "bidirectional" else 1
    if layout == 1:
        x = x.transpose(0, 1)
        h0 = None if h0 is None else h0.transpose(0, 1)
        c0 = None if c0 is None else c0.transpose(0, 1)
    t, nb, n_in = x.shape
    cls = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}[op]
    kwargs = {"nonlinearity": nonlinearity} if op == "RNN" else {}
    module = cls(n_in, hidden, bidirectional=dirs == 2, bias=bias is not None, dtype=torch.float64, **kwargs)
    params = {}
    for d, (wd, rd) in enumerate(zip(_to_torch(op, w, hidden), _to_torch(op, r, hidden))):
        suffix = "_l0" + ("_reverse" if d else "")
        params["weight_ih" + suffix], params["weight_hh" + suffix] = wd, rd
    if bias is not None:  # ONNX B = [Wb, Rb] per direction
        wbs, rbs = (_to_torch(op, bias.reshape(dirs, 2, -1)[:, k], hidden) for k in (0, 1))
        for d in range(dirs):
            suffix = "_l0" + ("_reverse" if d else "")
            params["bias_ih" + suffix], params["bias_hh" + suffix] = wbs[d], rbs[d]
    lens = [t] * nb if lens is None else [int(v) for v in lens]
    reverse = direction == "reverse"
    if reverse:
        x = _reverse_within(x, lens)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lens, enforce_sorted=False)
    zeros = torch.zeros(dirs, nb, hidden, dtype=torch.float64)
    h0 = zeros if h0 is None else h0
    state = (h0, zeros if c0 is None else c0) if op == "LSTM" else h0
    y, state = torch.func.functional_call(module, params, (packed, state))
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=t)
    if reverse:
        y = _reverse_within(y, lens)
    y = y.reshape(t, nb, dirs, hidden).transpose(1, 2)  # (T, D, B, H)
    states = list(state) if op == "LSTM" else [state]
    if layout == 1:
        y = y.permute(2, 0, 1, 3)
        states = [s.transpose(0, 1) for s in states]
    return [y] + states


@dataclass(frozen=True)
class Case:
    op: str
    direction: str = "forward"
    layout: int = 0
    t: int = 3           # sequence length
    nb: int = 2          # batch
    n_in: int = 3
    hidden: int = 3
    bias: bool = True
    h0: bool = False     # initial_h given
    c0: bool = False     # initial_c given (LSTM)
    lens: bool = False   # sequence_lens given
    relu: bool = False   # RNN with activations=[Relu]
    skip_y: bool = False  # the Y output absent


@st.composite
def rnn_cases(draw):
    op = draw(st.sampled_from(["LSTM", "GRU", "RNN"]))
    direction = draw(st.sampled_from(["forward", "reverse", "bidirectional"]))
    return Case(op, direction, layout=draw(st.sampled_from([0, 0, 1])),
                t=draw(st.integers(1, 4)), nb=draw(st.integers(1, 3)), n_in=draw(st.integers(1, 3)),
                hidden=draw(st.integers(1, 3)), bias=draw(st.booleans()), h0=draw(st.booleans()),
                c0=draw(st.booleans()), lens=draw(st.booleans()),
                relu=op == "RNN" and draw(st.booleans()), skip_y=draw(st.integers(0, 5)) == 0)


def make_inputs(case, rng):
    op, t, nb, n_in, hidden = case.op, case.t, case.nb, case.n_in, case.hidden
    dirs = 2 if case.direction == "bidirectional" else 1
    gh = GATES[op] * hidden

    def randn(*shape):
        return (rng.standard_normal(shape) * 0.7).astype(np.float32)

    x = randn(t, nb, n_in) if case.layout == 0 else randn(nb, t, n_in)
    state = (dirs, nb, hidden) if case.layout == 0 else (nb, dirs, hidden)
    lens = rng.integers(1, t + 1, nb).astype(np.int32) if case.lens else None
    return [x, randn(dirs, gh, n_in), randn(dirs, gh, hidden), randn(dirs, 2 * gh) if case.bias else None,
            lens, randn(*state) if case.h0 else None,
            randn(*state) if case.c0 and op == "LSTM" else None]


def check_against_torch(case, seed):
    rng = np.random.default_rng(seed)
    op = case.op
    inputs = make_inputs(case, rng)
    attrs = {"hidden_size": case.hidden, "direction": case.direction, "layout": case.layout}
    if op == "GRU":
        attrs["linear_before_reset"] = 1  # what PyTorch computes (and exports)
    if op == "RNN" and case.relu:
        attrs["activations"] = ["Relu"] * (2 if case.direction == "bidirectional" else 1)
    n_out = 1 + STATE[op]
    while inputs and inputs[-1] is None:
        inputs.pop()
    outs, grads, rs = run_node(op, inputs, attrs, n_out, seed, skip=(0,) if case.skip_y else ())
    tensors = [None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=True)
               if a.dtype.kind == "f" else a for a in inputs]
    tensors += [None] * (7 - len(tensors))
    want = torch_reference(op, *tensors, hidden=case.hidden, direction=case.direction,
                           layout=case.layout, nonlinearity="relu" if case.relu else "tanh")
    for k, (got, w) in enumerate(zip(outs, want)):
        if got is None:
            continue
        np.testing.assert_allclose(got, w.detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=f"{op} output {k}")
    sum((w * torch.tensor(r, dtype=torch.float64)).sum() for w, r in zip(want, rs) if r is not None).backward()
    for i, got in grads.items():
        ref = tensors[i].grad
        ref = np.zeros_like(got) if ref is None else ref.numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(ref).max()),
                                   err_msg=f"{op} gradient of input {i}")


@settings(max_examples=40, deadline=None)
@given(rnn_cases(), st.integers(0, 2**31 - 1))
def test_matches_torch(case, seed):
    check_against_torch(case, seed)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_bidirectional_with_everything(op):
    check_against_torch(Case(op, "bidirectional", t=5, nb=3, n_in=4, h0=True, c0=True, lens=True), seed=1)


# -- ONNX-only attributes: an independent numpy loop, gradients by central differences -------------------
def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def numpy_reference(op, x, w, r, b, h0, c0, p, *, clip=None, lbr=0, input_forget=0, acts=None):
    """Forward direction, layout 0, float64: the ONNX operator definitions, step by step."""
    t, nb, _ = x.shape
    hid = r.shape[-1]
    w, r = w[0], r[0]
    b = np.zeros(2 * GATES[op] * hid) if b is None else b[0]
    wb, rb = b[:GATES[op] * hid], b[GATES[op] * hid:]
    f, g, hact = (tuple(acts) + (np.tanh,))[:3] if acts else (_sigmoid, np.tanh, np.tanh)
    h = np.zeros((nb, hid)) if h0 is None else h0[0]
    c = np.zeros((nb, hid)) if c0 is None else c0[0]
    cl = (lambda v: np.clip(v, -clip, clip)) if clip is not None else (lambda v: v)
    ys = []
    for step in range(t):
        xt = x[step]
        if op == "LSTM":
            gates = xt @ w.T + h @ r.T + wb + rb
            gi, go, gf, gc = np.split(gates, 4, axis=1)
            pi, po, pf = np.split(p[0], 3) if p is not None else (0, 0, 0)
            i = f(cl(gi + pi * c))
            fg = 1 - i if input_forget else f(cl(gf + pf * c))
            c = fg * c + i * g(cl(gc))
            o = f(cl(go + po * c))
            h = o * hact(c)
        else:  # GRU
            wz, wr, wh = np.split(w, 3)
            rz, rr, rh = np.split(r, 3)
            bz, br, bh = np.split(wb, 3)
            cz, cr, ch = np.split(rb, 3)
            z = f(cl(xt @ wz.T + h @ rz.T + bz + cz))
            rs = f(cl(xt @ wr.T + h @ rr.T + br + cr))
            if lbr:
                hh = g(cl(xt @ wh.T + rs * (h @ rh.T + ch) + bh))
            else:
                hh = g(cl(xt @ wh.T + (rs * h) @ rh.T + ch + bh))
            h = (1 - z) * hh + z * h
        ys.append(h)
    return np.stack(ys)[:, None], h[None], c[None]


ONNX_ONLY = {
    "gru_reset_before_linear": ("GRU", {"linear_before_reset": 0}, {"lbr": 0}),
    "lstm_peepholes_clip": ("LSTM", {"clip": 0.8}, {"clip": 0.8}),
    "lstm_input_forget": ("LSTM", {"input_forget": 1}, {"input_forget": 1}),
    "gru_hardsigmoid_affine": (
        "GRU", {"activations": ["HardSigmoid", "Affine"], "activation_alpha": [0.3, 0.5],
                "activation_beta": [0.4, 0.1], "linear_before_reset": 1},
        {"lbr": 1, "acts": (lambda v: np.clip(0.3 * v + 0.4, 0, 1), lambda v: 0.5 * v + 0.1)}),
}


@pytest.mark.parametrize("name", sorted(ONNX_ONLY))
def test_onnx_only_attributes(name):
    op, attrs, ref_kwargs = ONNX_ONLY[name]
    rng = np.random.default_rng(0)
    t, nb, n_in, hid = 3, 2, 3, 2
    gh = GATES[op] * hid
    x, w, r = rng.standard_normal((t, nb, n_in)), rng.standard_normal((1, gh, n_in)), rng.standard_normal((1, gh, hid))
    b, h0 = rng.standard_normal((1, 2 * gh)), rng.standard_normal((1, nb, hid))
    if op == "LSTM":
        c0, p = rng.standard_normal((1, nb, hid)), rng.standard_normal((1, 3 * hid))
        inputs = [x, w, r, b, None, h0, c0, p]
    else:
        c0 = p = None
        inputs = [x, w, r, b, None, h0]
    attrs = {"hidden_size": hid, **attrs}
    n_out = 1 + STATE[op]
    outs, grads, rs = run_node(op, inputs, attrs, n_out)
    want = numpy_reference(op, x, w, r, b, h0, c0, p, **ref_kwargs)
    for got, ref in zip(outs, want):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    assert outs[0].dtype == np.float64  # float64 stays float64 through the expansion

    def loss(args):
        return sum((o * rr).sum() for o, rr in zip(numpy_reference(op, *args, **ref_kwargs), rs))

    base = [x, w, r, b, h0, c0, p]
    slots = {0: 0, 1: 1, 2: 2, 3: 3, 5: 4, 6: 5, 7: 6}  # node input -> reference argument
    for i, got in grads.items():
        num = np.zeros_like(got)
        for idx in np.ndindex(got.shape):
            args = [None if a is None else a.copy() for a in base]
            args[slots[i]][idx] += 1e-6
            up = loss(args)
            args[slots[i]][idx] -= 2e-6
            num[idx] = (up - loss(args)) / 2e-6
        np.testing.assert_allclose(got, num, rtol=1e-5, atol=1e-6, err_msg=f"{name} gradient of input {i}")


def test_unknown_activation_is_named():
    x = np.zeros((2, 1, 3), np.float32)
    with pytest.raises(AnygradError, match="activation 'Swish'"):
        run_node("RNN", [x, np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 2), np.float32)],
                 {"hidden_size": 2, "activations": ["Swish"]}, 2)


# -- exported PyTorch models ----------------------------------------------------------------------------
class _Seq(torch.nn.Module):
    def __init__(self, kind, **kwargs):
        super().__init__()
        self.rnn = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}[kind](3, 4, **kwargs)
        self.kind = kind

    def forward(self, x):
        y, state = self.rnn(x)
        return (y,) + (tuple(state) if self.kind == "LSTM" else (state,))


EXPORTED = {
    "lstm_bidir_2layers": ("LSTM", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    "gru_batch_first": ("GRU", {"batch_first": True}),
    "gru_bidir": ("GRU", {"bidirectional": True}),
    "rnn_relu_nobias": ("RNN", {"nonlinearity": "relu", "bias": False}),
}


def _export(net, x, path, dynamo):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {} if dynamo else {"do_constant_folding": False}
        torch.onnx.export(net, (x,), str(path), dynamo=dynamo, opset_version=17, input_names=["x"], **kwargs)


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_exported_module_outputs_and_parameter_gradients(tmp_path, name):
    """TorchScript export without constant folding keeps PyTorch's parameter names, so each
    gradient is compared by name (through the exporter's gate reordering Slices/Concats)."""
    kind, kwargs = EXPORTED[name]
    torch.manual_seed(0)
    net = _Seq(kind, **kwargs)
    x = torch.randn(2, 5, 3) if kwargs.get("batch_first") else torch.randn(5, 2, 3)
    _export(net, x, tmp_path / "m.onnx", dynamo=False)
    model = anygrad.load_onnx(tmp_path / "m.onnx")
    assert kind in {n.op for n in model.graph.nodes}
    g = specialize(model.graph, {model.input_name: tuple(x.shape)})
    b = Builder(g, prefix="t")
    rng = np.random.default_rng(0)
    rs = [rng.standard_normal(g.info[o].shape).astype(np.float32) for o in g.outputs]
    loss = b.add_all([b.op("ReduceSum", [b.op("Mul", [o, b.const(r)])], keepdims=0) for o, r in zip(g.outputs, rs)])
    params = list(g.params)
    grads = gradients(g, loss, params)
    outputs = list(g.outputs)
    g.outputs = outputs + [grads[p] for p in params]
    res = NumpyBackend().compile(g).run({model.input_name: x.numpy()})
    net.double()
    want = net(x.double())
    for o, w in zip(outputs, want):
        np.testing.assert_allclose(res[o], w.detach().numpy(), rtol=1e-4, atol=1e-5)
    sum((w * torch.tensor(r, dtype=torch.float64)).sum() for w, r in zip(want, rs)).backward()
    named = dict(net.named_parameters())
    assert sorted(params) == sorted(named)
    for p in params:
        np.testing.assert_allclose(res[grads[p]], named[p].grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=p)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_dynamo_export_runs(tmp_path, kind):
    torch.manual_seed(0)
    net = _Seq(kind, bidirectional=True, batch_first=True)
    x = torch.randn(2, 4, 3)
    _export(net, x, tmp_path / "m.onnx", dynamo=True)
    model = anygrad.load_onnx(tmp_path / "m.onnx")
    g = specialize(model.graph, {model.input_name: tuple(x.shape)})
    res = NumpyBackend().compile(g).run({model.input_name: x.numpy()})
    for o, w in zip(g.outputs, net(x)):
        np.testing.assert_allclose(res[o], w.detach().numpy(), rtol=1e-4, atol=1e-5)


# -- wgpu --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_unrolled_graph_trains_on_wgpu_like_numpy(op):
    """Forward and every input gradient (X, W, R, B, initial states) agree on wgpu and numpy."""
    from wgpu_util import check_wgpu
    case = Case(op, "bidirectional", hidden=4, h0=True, c0=True, lens=op == "GRU")
    inputs = make_inputs(case, np.random.default_rng(0))
    attrs = {"hidden_size": 4, "direction": "bidirectional"}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    while inputs[-1] is None:
        inputs.pop()
    check_wgpu(op, inputs, attrs, n_outputs=1 + STATE[op], rtol=2e-4, atol=1e-5)


class _Classifier(torch.nn.Module):
    """A GRU over the sequence, then a bidirectional LSTM, last step -> class logits."""

    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(3, 5, batch_first=True)
        self.lstm = torch.nn.LSTM(5, 4, batch_first=True, bidirectional=True)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.gru(x)
        y, _ = self.lstm(y)
        return self.fc(y[:, -1])


def test_sequence_classifier_trains_like_torch_on_cpu_and_wgpu(tmp_path):
    """8 SGD steps from the same weights: PyTorch, anygrad on numpy, anygrad on wgpu."""
    from wgpu_util import wgpu_backend
    torch.manual_seed(0)
    net = _Classifier()
    _export(net, torch.zeros(4, 4, 3), tmp_path / "clf.onnx", dynamo=False)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 4, 3)).astype(np.float32) for _ in range(8)]
    ys = [rng.integers(0, 3, 4).astype(np.int64) for _ in range(8)]
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    want = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        opt.step()
        want.append(loss.item())
    for device, rtol in (("cpu", 1e-4), (wgpu_backend(), 3e-4)):
        model = anygrad.load_onnx(tmp_path / "clf.onnx")
        model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.5), device=device)
        got = [model.train_on_batch(x, y) for x, y in zip(xs, ys)]
        np.testing.assert_allclose(got, want, rtol=rtol, err_msg=str(device))


def test_onnx_attributes_on_wgpu():
    """layout 1, a fed (not constant) sequence_lens, peepholes, clip; GRU reset-before-linear in
    reverse with other activations: the primitives they expand to all run on wgpu."""
    from wgpu_util import check_wgpu
    rng = np.random.default_rng(0)

    def randn(*shape):
        return (rng.standard_normal(shape) * 0.7).astype(np.float32)

    t, nb, n_in, h = 3, 2, 3, 2
    lstm = [randn(nb, t, n_in), randn(1, 4 * h, n_in), randn(1, 4 * h, h), randn(1, 8 * h),
            np.array([2, 3], np.int32), randn(nb, 1, h), randn(nb, 1, h), randn(1, 3 * h)]
    check_wgpu("LSTM", lstm, {"hidden_size": h, "layout": 1, "clip": 0.9}, n_outputs=3, feed=[4], rtol=2e-4)
    gru = [randn(t, nb, n_in), randn(1, 3 * h, n_in), randn(1, 3 * h, h), randn(1, 6 * h)]
    check_wgpu("GRU", gru, {"hidden_size": h, "direction": "reverse", "activations": ["HardSigmoid", "Softsign"]},
               n_outputs=2, rtol=2e-4)
