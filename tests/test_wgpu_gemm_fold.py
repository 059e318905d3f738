"""GEMMs reading transposed operands, writing transposed results, and applying bias and activation
epilogues on wgpu, against the numpy backend (forward and gradients). The graphs are the patterns
the exporters produce: `x @ W.T` over (batch, tokens, d), attention's `Q @ K^T`, a Gemm fed by a
Transpose, and Linear -> bias -> activation."""
from __future__ import annotations

import numpy as np
import pytest
from wgpu_util import assert_close, run_both

from anygrad.autodiff import gradients
from anygrad.ir import Builder, Graph, Node, TensorInfo, specialize

pytestmark = pytest.mark.wgpu
F32 = np.dtype(np.float32)


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _graph(inputs: dict[str, np.ndarray], nodes: list[Node], out: str, grad: bool, consts: dict | None = None):
    """A specialized graph of `nodes` (and the gradients of sum(out * R) for every input)."""
    g = Graph(name="fold")
    for name, a in inputs.items():
        g.inputs.append(name)
        g.info[name] = TensorInfo(F32, a.shape)
    g.initializers.update(consts or {})
    g.nodes = nodes
    g.outputs = [out]
    s = specialize(g, {})
    if grad:
        b = Builder(s, prefix="check")
        r = rnd(*b.shape(out), seed=99)
        loss = b.op("ReduceSum", [b.op("Mul", [out, b.const(r)])], keepdims=0)
        gr = gradients(s, loss, list(inputs))
        s.outputs = [out] + [gr[n] for n in inputs]
    return s


def _kernel_names(exe) -> list[str]:
    return [st.kernel.name for st in exe.plan.steps]


def _run(graph: Graph, feeds: dict):
    want, got, exe = run_both(graph, feeds)
    assert_close(want, got, rtol=2e-4, atol=2e-5)
    return exe


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_transposed_weight_has_no_transpose_kernel(bias):
    """y = x @ W.T (+ b) over (batch, tokens, d), as both exporters write a Linear on 3-D input;
    its input gradient reads W transposed, and dW = (x^T dy)^T is computed as dy^T x directly."""
    feeds = {"x": rnd(2, 5, 6, seed=1), "W": rnd(7, 6, seed=2)} | ({"b": rnd(7, seed=3)} if bias else {})
    nodes = [Node("Transpose", ["W"], ["Wt"], {"perm": [1, 0]}, name="t"),
             Node("MatMul", ["x", "Wt"], ["xw"], name="mm")]
    if bias:
        nodes.append(Node("Add", ["xw", "b"], ["y"], name="add"))
    exe = _run(_graph(feeds, nodes, "y" if bias else "xw", grad=True), feeds)
    names = _kernel_names(exe)
    assert not any(n.startswith("Transpose") for n in names), names
    assert not any(n.op == "Transpose" for n in exe.prepared.nodes)
    if bias:  # the bias Add runs in the forward GEMM's epilogue
        (mm,) = [n for n in exe.prepared.nodes if n.outputs[0] == "y"]
        assert mm.op == "MatMul" and mm.inputs[2] == "b"


def test_attention_scores_read_k_transposed():
    """Q @ K^T with K^T a Transpose of the last two axes of (B, H, T, d); gradients included."""
    feeds = {"q": rnd(2, 3, 5, 4, seed=4), "k": rnd(2, 3, 6, 4, seed=5), "v": rnd(2, 3, 6, 8, seed=6)}
    nodes = [Node("Transpose", ["k"], ["kt"], {"perm": [0, 1, 3, 2]}, name="t"),
             Node("MatMul", ["q", "kt"], ["s"], name="qk"),
             Node("MatMul", ["s", "v"], ["o"], name="sv")]
    exe = _run(_graph(feeds, nodes, "o", grad=True), feeds)
    names = _kernel_names(exe)
    assert not any(n.startswith("Transpose") for n in names), names
    assert any(n.op == "MatMul" and n.attr("_permB") == [0, 1, 3, 2] for n in exe.prepared.nodes)


@pytest.mark.parametrize("k_perm", [[0, 2, 3, 1], None])
def test_attention_head_split_and_merge_fold(k_perm):
    """The exporters' multi-head attention: (B, T, H*d) -> Reshape -> Transpose(0, 2, 1, 3) into the
    score and value MatMuls (K^T as one Transpose(0, 2, 3, 1), or a head split then a swap), and
    the context's Transpose(0, 2, 1, 3) -> Reshape back: no Transpose kernel forward or backward."""
    B, T, H, d = 2, 5, 3, 4
    feeds = {"q": rnd(B, T, H * d, seed=30), "k": rnd(B, T, H * d, seed=31), "v": rnd(B, T, H * d, seed=32)}
    nodes = []
    for x in "qkv":
        nodes.append(Node("Reshape", [x, "heads"], [f"{x}4"], name=f"r{x}"))
        if x == "k" and k_perm:
            nodes.append(Node("Transpose", ["k4"], ["kt"], {"perm": k_perm}, name="tk"))
        else:
            nodes.append(Node("Transpose", [f"{x}4"], [f"{x}h"], {"perm": [0, 2, 1, 3]}, name=f"t{x}"))
    if not k_perm:
        nodes.append(Node("Transpose", ["kh"], ["kt"], {"perm": [0, 1, 3, 2]}, name="tkt"))
    nodes += [Node("MatMul", ["qh", "kt"], ["s"], name="qk"),
              Node("Softmax", ["s"], ["p"], {"axis": -1}, name="softmax"),
              Node("MatMul", ["p", "vh"], ["o"], name="pv"),
              Node("Transpose", ["o"], ["ot"], {"perm": [0, 2, 1, 3]}, name="to"),
              Node("Reshape", ["ot", "merged"], ["y"], name="ry")]
    consts = {"heads": np.array([B, T, H, d], np.int64), "merged": np.array([B, T, H * d], np.int64)}
    exe = _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds)
    names = _kernel_names(exe)
    assert not any(n.startswith("Transpose") for n in names), names


@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm_fed_by_transposes(ta, tb):
    """Transposed operands flip the Gemm's own transA/transB; a transposed result swaps operands."""
    feeds = {"a": rnd(5, 7, seed=7), "b": rnd(7, 3, seed=8) if not tb else rnd(3, 7, seed=8)}
    a_in = "a"
    nodes = []
    if ta:  # feed A^T and let Gemm transpose it back
        nodes.append(Node("Transpose", ["a"], ["at"], {"perm": [1, 0]}, name="ta"))
        a_in = "at"
    nodes += [Node("Gemm", [a_in, "b"], ["g"], {"transA": ta, "transB": tb, "alpha": 0.5}, name="gemm"),
              Node("Transpose", ["g"], ["y"], {"perm": [1, 0]}, name="ty")]
    exe = _run(_graph(feeds, nodes, "y", grad=True), feeds)
    assert not any(n.startswith("Transpose") for n in _kernel_names(exe))


def test_transpose_read_elsewhere_is_kept():
    """A Transpose whose result something else reads still runs (its readers need it stored)."""
    feeds = {"x": rnd(4, 6, seed=9), "W": rnd(5, 6, seed=10)}
    nodes = [Node("Transpose", ["W"], ["Wt"], {"perm": [1, 0]}, name="t"),
             Node("MatMul", ["x", "Wt"], ["y"], name="mm"),
             Node("Relu", ["Wt"], ["r"], name="relu"),
             Node("ReduceSum", ["r"], ["rs"], {"keepdims": 0}, name="rs"),
             Node("Add", ["y", "rs"], ["z"], name="add")]
    _run(_graph(feeds, nodes, "z", grad=False), feeds)


ACTIVATIONS = [("Relu", {}), ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Sigmoid", {}), ("Tanh", {}),
               ("LeakyRelu", {"alpha": 0.1}), ("Elu", {"alpha": 0.7}), ("Softplus", {}), ("HardSwish", {})]


@pytest.mark.parametrize("variant", ["register", "shared", "dot"])
@pytest.mark.parametrize("act,attrs", ACTIVATIONS, ids=[a + str(k) for a, k in ACTIVATIONS])
def test_matmul_bias_activation_epilogue(act, attrs, variant):
    """Linear -> Add(bias) -> activation at inference: one GEMM kernel, nothing else."""
    feeds = {"x": rnd(2, 3, 9, seed=11), "W": rnd(9, 10, seed=12), "b": rnd(10, seed=13)}
    nodes = [Node("MatMul", ["x", "W"], ["xw"], {"_gemm_variant": variant}, name="mm"),
             Node("Add", ["b", "xw"], ["pre"], name="add"),
             Node(act, ["pre"], ["y"], attrs, name="act")]
    exe = _run(_graph(feeds, nodes, "y", grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"]
    assert all(n.startswith("MatMul") for n in _kernel_names(exe))


@pytest.mark.parametrize("cshape", [(10,), (1, 10), (6, 1), (1,)])
def test_gemm_bias_add_and_gelu_fold_into_gemm(cshape):
    feeds = {"x": rnd(6, 9, seed=14), "W": rnd(10, 9, seed=15), "c": rnd(*cshape, seed=16)}
    nodes = [Node("Gemm", ["x", "W"], ["g"], {"transB": 1, "alpha": 1.5}, name="gemm"),
             Node("Add", ["g", "c"], ["pre"], name="add"),
             Node("Gelu", ["pre"], ["y"], name="act")]
    exe = _run(_graph(feeds, nodes, "y", grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["Gemm"]


def test_training_linear_gelu_fuses_bias_not_activation():
    """In training the pre-activation is read again by the Gelu gradient: the bias still fuses into
    the GEMM, the activation stays a separate (elementwise) kernel; all gradients match numpy."""
    feeds = {"x": rnd(2, 4, 8, seed=17), "W": rnd(8, 12, seed=18), "b": rnd(12, seed=19)}
    nodes = [Node("MatMul", ["x", "W"], ["xw"], name="mm"),
             Node("Add", ["xw", "b"], ["pre"], name="add"),
             Node("Gelu", ["pre"], ["y"], name="act")]
    exe = _run(_graph(feeds, nodes, "y", grad=True), feeds)
    (mm,) = [n for n in exe.prepared.nodes if n.outputs[0] == "pre"]
    assert mm.op == "MatMul" and mm.inputs[2:] == ["b"]


def _swap(x: str, rank: int, out: str) -> Node:
    return Node("Transpose", [x], [out], {"perm": list(range(rank - 2)) + [rank - 1, rank - 2]}, name=f"t{x}")


@pytest.mark.parametrize("variant", ["register", "shared", "dot"])
@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((2, 3, 5, 4), (4, 6), True, False),      # A's batch cannot fold into M when A is read transposed
    ((2, 3, 5, 4), (4, 6), True, True),
    ((2, 3, 5, 4), (3, 4, 6), False, True),   # B broadcast over the leading batch dim
    ((2, 1, 5, 4), (3, 4, 6), True, True),    # both broadcast
    ((5, 4), (2, 4, 6), True, False),
    ((8, 12), (12, 8), True, True),
    ((3, 7), (7,), True, False),              # a 1-D operand beside a transposed one
    ((7,), (2, 7, 5), False, True),
])
def test_matmul_transposed_operands(sa, sb, ta, tb, variant):
    """MatMul reading A and/or B through a Transpose of their last two axes (stored as the swap)."""
    swap = {True: lambda s: s[:-2] + (s[-1], s[-2]), False: lambda s: s}
    feeds = {"a": rnd(*swap[ta](sa), seed=20), "b": rnd(*swap[tb](sb), seed=21)}
    nodes = []
    if ta:
        nodes.append(_swap("a", len(sa), "at"))
    if tb:
        nodes.append(_swap("b", len(sb), "bt"))
    nodes.append(Node("MatMul", ["at" if ta else "a", "bt" if tb else "b"], ["y"], {"_gemm_variant": variant},
                      name="mm"))
    exe = _run(_graph(feeds, nodes, "y", grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"]


@pytest.mark.parametrize("variant", ["register", "shared", "dot"])
@pytest.mark.parametrize("sa,pa,sb,pb,py", [
    ((2, 5, 3, 4), [0, 2, 1, 3], (2, 6, 3, 4), [0, 2, 3, 1], [0, 2, 1, 3]),   # head split in, merge out
    ((5, 2, 4), [1, 0, 2], (4, 6), None, [1, 0, 2]),                          # (T, B, d) layouts
    ((4, 2, 5), [1, 2, 0], (3, 4), [1, 0], [2, 0, 1]),                        # no contiguous axis of A
    ((2, 3, 5, 8), None, (8, 4), None, [1, 0, 2, 3]),                         # batch folded into M, then permuted out
])
def test_matmul_any_operand_and_result_layout(sa, pa, sb, pb, py, variant):
    """MatMul reading its operands through any Transpose and storing its result permuted."""
    feeds = {"a": rnd(*sa, seed=22), "b": rnd(*sb, seed=23)}
    nodes = []
    ins = []
    for x, perm in (("a", pa), ("b", pb)):
        if perm is not None:
            nodes.append(Node("Transpose", [x], [x + "t"], {"perm": perm}, name="t" + x))
        ins.append(x + "t" if perm is not None else x)
    nodes += [Node("MatMul", ins, ["m"], {"_gemm_variant": variant}, name="mm"),
              Node("Transpose", ["m"], ["y"], {"perm": py}, name="ty")]
    exe = _run(_graph(feeds, nodes, "y", grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"]


@pytest.mark.parametrize("variant", ["register", "shared", "dot"])
@pytest.mark.parametrize("bias,act", [(True, None), (False, None), (True, "Relu")])
def test_matmul_residual_add_runs_in_the_epilogue(variant, bias, act):
    """A transformer block's x + Linear(h) (and ResNet-style relu(x + W h + b)): the residual Add
    runs in the GEMM's store, in the graph's order (bias, then residual, then activation); the
    same bits as numpy's chain within rounding, and no kernel of its own."""
    feeds = {"h": rnd(2, 5, 9, seed=30), "W": rnd(9, 12, seed=31), "x": rnd(2, 5, 12, seed=32)}
    nodes = [Node("MatMul", ["h", "W"], ["hw"], {"_gemm_variant": variant}, name="mm")]
    pre = "hw"
    if bias:
        feeds["b"] = rnd(12, seed=33)
        nodes.append(Node("Add", ["hw", "b"], ["hb"], name="bias"))
        pre = "hb"
    nodes.append(Node("Add", ["x", pre], ["y"], name="residual"))
    out = "y"
    if act:
        nodes.append(Node(act, ["y"], ["z"], name="act"))
        out = "z"
    exe = _run(_graph(feeds, nodes, out, grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"]
    (mm,) = exe.prepared.nodes
    assert mm.attr("_residual") and mm.inputs[2:] == (["b"] if bias else [""]) + ["x"]


def test_gemm_and_split_k_residual_and_training_gradients():
    """Gemm (with its own C) + residual, and a long-K MatMul whose K is split (the residual is added by the
    reducing kernel); in training every gradient matches numpy."""
    feeds = {"a": rnd(6, 9, seed=34), "W": rnd(10, 9, seed=35), "c": rnd(10, seed=44), "r": rnd(6, 10, seed=36)}
    nodes = [Node("Gemm", ["a", "W", "c"], ["g"], {"transB": 1, "alpha": 0.5, "beta": 0.25}, name="gemm"),
             Node("Add", ["g", "r"], ["y"], name="residual")]
    exe = _run(_graph(feeds, nodes, "y", grad=True), feeds)
    assert any(n.op == "Gemm" and n.attr("_residual") for n in exe.prepared.nodes)
    feeds = {"a": rnd(4, 3000, seed=37), "b": rnd(3000, 8, seed=38), "r": rnd(4, 8, seed=39)}
    nodes = [Node("MatMul", ["a", "b"], ["ab"], {"_gemm_variant": "shared"}, name="mm"),
             Node("Add", ["r", "ab"], ["y"], name="residual")]
    exe = _run(_graph(feeds, nodes, "y", grad=False), feeds)
    names = _kernel_names(exe)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"] and any("reduce" in n for n in names), names


def test_residual_read_elsewhere_or_broadcast_stays_an_add(monkeypatch):
    """A GEMM result read by something else, a broadcasting addend, or the switch off: the Add
    stays a kernel of its own."""
    feeds = {"h": rnd(4, 6, seed=40), "W": rnd(6, 5, seed=41), "x": rnd(4, 5, seed=42), "v": rnd(5, seed=43)}
    shared = [Node("MatMul", ["h", "W"], ["hw"], name="mm"), Node("Add", ["hw", "x"], ["y"], name="res"),
              Node("Mul", ["hw", "y"], ["z"], name="reuse")]
    exe = _run(_graph(feeds, shared, "z", grad=False), feeds)
    assert not any(n.attr("_residual") for n in exe.prepared.nodes)
    monkeypatch.setenv("ANYGRAD_WGPU_RESIDUAL", "0")
    plain = [Node("MatMul", ["h", "W"], ["hw"], name="mm"), Node("Add", ["hw", "x"], ["y"], name="res")]
    exe = _run(_graph(feeds, plain, "y", grad=False), feeds)
    assert not any(n.attr("_residual") for n in exe.prepared.nodes)


@pytest.mark.parametrize("variant", ["register", "shared", "dot", "split"])
@pytest.mark.parametrize("act", ["Gelu", "Relu", "LeakyRelu"])
def test_an_mlps_activation_gradient_runs_in_the_input_gradient_gemms_store(act, variant):
    """Linear -> activation -> Linear, trained: the second Linear's input gradient dy @ W2^T is
    followed by the activation's gradient (dy, h); the GEMM applies it in its store, reading h at
    its own index, so dy is neither stored nor read back (the GPT's GeluGrad: 4 kernels, 2% of its
    H100 step). Every gradient matches numpy, with each GEMM variant (split: the reducing kernel
    applies it)."""
    pin = {"_gemm_variant": "shared", "_gemm_splits": 2} if variant == "split" else {"_gemm_variant": variant}
    k = 300 if variant == "split" else 12
    feeds = {"x": rnd(2, 5, 9, seed=60), "W1": rnd(9, k, seed=61), "b1": rnd(k, seed=62), "W2": rnd(k, 7, seed=63)}
    attrs = {"approximate": "tanh"} if act == "Gelu" else {}
    nodes = [Node("MatMul", ["x", "W1"], ["xw"], name="fc1"), Node("Add", ["xw", "b1"], ["h"], name="bias"),
             Node(act, ["h"], ["a"], attrs, name="act"), Node("MatMul", ["a", "W2"], ["y"], dict(pin), name="fc2")]
    g = _graph(feeds, nodes, "y", grad=True)
    for n in g.nodes:  # the input gradient's GEMM takes the pin too
        if n.op == "MatMul" and n.outputs[0] not in ("xw", "y"):
            n.attrs.update(pin)
    exe = _run(g, feeds)
    grads = [n for n in exe.prepared.nodes if n.attr("_epilogue_arg")]
    assert [n.attr("_epilogue") for n in grads] == [act + "Grad"], [n.op for n in exe.prepared.nodes]
    assert not any(n.op == act + "Grad" or act + "Grad" in n.attrs.get("ops", ()) for n in exe.prepared.nodes
                   if not n.attr("_epilogue_arg"))


@pytest.mark.parametrize("variant", ["register", "shared", "dot", "split"])
@pytest.mark.parametrize("act", ["Gelu", "Relu", "Sigmoid"])
def test_an_activation_read_only_by_gemms_runs_in_their_operand_loads(act, variant):
    """Linear -> activation -> Linear, trained: the activation's output is read only by the second
    Linear (forward) and by its weight gradient (through a reshape), so both GEMMs apply it as
    they load that operand and it is never stored; the activation's gradient reads its input.
    Every gradient matches numpy, with each GEMM variant, and with an activation that is not 0
    at 0 (Sigmoid: the tiles' padding must stay 0, the operand's, not sigmoid(0))."""
    pin = {"_gemm_variant": "shared", "_gemm_splits": 2} if variant == "split" else {"_gemm_variant": variant}
    rows = 300 if variant == "split" else 5
    feeds = {"x": rnd(2, rows, 9, seed=70), "W1": rnd(9, 13, seed=71), "b1": rnd(13, seed=72), "W2": rnd(13, 7, seed=73)}
    nodes = [Node("MatMul", ["x", "W1"], ["xw"], name="fc1"), Node("Add", ["xw", "b1"], ["h"], name="bias"),
             Node(act, ["h"], ["a"], name="act"), Node("MatMul", ["a", "W2"], ["y"], dict(pin), name="fc2")]
    g = _graph(feeds, nodes, "y", grad=True)
    for n in g.nodes:
        if n.op in ("MatMul", "Gemm") and n.outputs[0] != "xw":
            n.attrs.update(pin)
    exe = _run(g, feeds)
    prepared = exe.prepared.nodes
    assert not [n for n in prepared if n.op == act or act in n.attrs.get("ops", ())], [n.op for n in prepared]
    applied = [n for n in prepared for k in ("_prologueA", "_prologueB") if n.attr(k) is not None]
    if act == "Gelu":  # its gradient reads h: h has other readers, so the activation goes forward
        assert len(applied) == 2 and all(n.attr("_prologueA", n.attr("_prologueB"))[0] == act for n in applied)
    else:  # Relu's and Sigmoid's gradients read their output: fc1 stores it (its epilogue)
        assert not applied and any(n.attr("_epilogue") in (act, "relu") for n in prepared)


@pytest.mark.parametrize("variant", ["register", "shared", "dot", "split"])
def test_an_operand_activation_that_is_not_zero_at_zero_keeps_the_tiles_padding_zero(variant):
    """sigmoid(h) @ W over shapes that do not divide the tiles: the loads past the operand's edge
    stay 0 (the activated operand's padding), not sigmoid(0) = 0.5."""
    pin = {"_gemm_variant": "shared", "_gemm_splits": 2} if variant == "split" else {"_gemm_variant": variant}
    feeds = {"h": rnd(37, 301 if variant == "split" else 45, seed=76), "W": rnd(301 if variant == "split" else 45, 19,
                                                                             seed=77)}
    nodes = [Node("Sigmoid", ["h"], ["a"], name="act"), Node("MatMul", ["a", "W"], ["y"], pin, name="mm")]
    exe = _run(_graph(feeds, nodes, "y", grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"] and exe.prepared.nodes[0].attr("_prologueA")[0] == "Sigmoid"


def test_an_activation_read_by_anything_but_gemms_stays_a_kernel(monkeypatch):
    feeds = {"h": rnd(4, 6, seed=74), "W": rnd(6, 5, seed=75)}
    nodes = [Node("Gelu", ["h"], ["a"], name="act"), Node("MatMul", ["a", "W"], ["y"], name="mm"),
             Node("Add", ["a", "h"], ["z"], name="other")]
    g = Graph(name="pro")
    exe = _run(_graph(feeds, nodes + [Node("Concat", ["y", "z"], ["o"], {"axis": 1}, name="cat")], "o", grad=False),
               feeds)
    assert not any(n.attr("_prologueA") is not None for n in exe.prepared.nodes)
    del g
    monkeypatch.setenv("ANYGRAD_WGPU_PROLOGUE", "0")
    exe = _run(_graph(feeds, nodes[:2], "y", grad=False), feeds)
    assert not any(n.attr("_prologueA") is not None for n in exe.prepared.nodes)
    monkeypatch.setenv("ANYGRAD_WGPU_PROLOGUE", "1")
    exe = _run(_graph(feeds, nodes[:2], "y", grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"] and exe.prepared.nodes[0].attr("_prologueA")[0] == "Gelu"


def test_an_activation_gradient_whose_dy_is_read_elsewhere_stays_a_kernel(monkeypatch):
    feeds = {"h": rnd(4, 6, seed=64), "W": rnd(6, 5, seed=65), "x": rnd(4, 5, seed=66)}
    shared = [Node("MatMul", ["h", "W"], ["dy"], name="mm"), Node("GeluGrad", ["dy", "x"], ["dx"], name="gg"),
              Node("Mul", ["dy", "dx"], ["z"], name="reuse")]
    exe = _run(_graph(feeds, shared, "z", grad=False), feeds)
    assert not any(n.attr("_epilogue_arg") for n in exe.prepared.nodes)
    monkeypatch.setenv("ANYGRAD_WGPU_GRAD_EPILOGUE", "0")
    plain = [Node("MatMul", ["h", "W"], ["dy"], name="mm"), Node("GeluGrad", ["dy", "x"], ["dx"], name="gg")]
    exe = _run(_graph(feeds, plain, "dx", grad=False), feeds)
    assert not any(n.attr("_epilogue_arg") for n in exe.prepared.nodes)
    monkeypatch.setenv("ANYGRAD_WGPU_GRAD_EPILOGUE", "1")
    exe = _run(_graph(feeds, plain, "dx", grad=False), feeds)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"] and exe.prepared.nodes[0].attr("_epilogue_arg")


@pytest.mark.parametrize("switch", ["1", "0"])
def test_pre_ln_block_gradients_with_residuals_fused(monkeypatch, switch):
    """A pre-LN transformer block, y = x + LN(x) @ W + b: forward, the residual in the GEMM's
    store; backward, the skip's gradient added in LayerNormGrad's dx store. Every gradient
    matches numpy with the fusions on and off."""
    monkeypatch.setenv("ANYGRAD_WGPU_RESIDUAL", switch)
    feeds = {"x": rnd(3, 5, 16, seed=50), "g": rnd(16, seed=51), "be": rnd(16, seed=52),
             "W": rnd(16, 16, seed=53), "b": rnd(16, seed=54)}
    nodes = [Node("LayerNormalization", ["x", "g", "be"], ["ln"], {"axis": -1, "epsilon": 1e-5}, name="ln"),
             Node("MatMul", ["ln", "W"], ["lw"], name="mm"),
             Node("Add", ["lw", "b"], ["lb"], name="bias"),
             Node("Add", ["x", "lb"], ["y"], name="residual")]
    exe = _run(_graph(feeds, nodes, "y", grad=True), feeds)
    fused = {n.op for n in exe.prepared.nodes if n.attr("_residual")}
    assert fused == ({"MatMul", "LayerNormGrad"} if switch == "1" else set())


def _qkv_attention() -> list[Node]:
    """GPT-style attention on a (B, T, 3d) qkv projection: q, k, v sliced off, heads split
    (the slice bounds and head shape: _qkv_consts). The projection is computed here, so that
    its gradient is not a graph output (one that may not be stored by several kernels)."""
    nodes = [Node("MatMul", ["inp", "wp"], ["x"], name="qkv")]
    for j, name in enumerate("qkv"):
        nodes += [Node("Slice", ["x", f"s{j}", f"e{j}", "ax"], [f"{name}s"], name=f"slice_{name}"),
                  Node("Reshape", [f"{name}s", "hshape"], [f"{name}h"], name=f"view_{name}"),
                  Node("Transpose", [f"{name}h"], [f"{name}t"], {"perm": [0, 2, 1, 3]}, name=f"heads_{name}")]
    nodes += [Node("Transpose", ["kt"], ["ktt"], {"perm": [0, 1, 3, 2]}, name="kT"),
              Node("MatMul", ["qt", "ktt"], ["scores"], name="qk"),
              Node("Softmax", ["scores"], ["p"], {"axis": -1}, name="softmax"),
              Node("MatMul", ["p", "vt"], ["o"], name="pv")]
    return nodes


def _qkv_consts(d: int, heads: int, t: int) -> dict:
    c = {"ax": np.array([2], np.int64), "hshape": np.array([0, t, heads, d // heads], np.int64)}
    for j in range(3):
        c[f"s{j}"], c[f"e{j}"] = np.array([j * d], np.int64), np.array([(j + 1) * d], np.int64)
    return c


@pytest.mark.parametrize("d,heads", [(8, 2), (6, 2)], ids=["aligned", "unaligned"])
def test_attention_reads_q_k_v_as_views_of_the_qkv_projection(d, heads):
    """q, k and v sliced off one (B, T, 3d) projection are read by the attention MatMuls as
    strided views of it, forward and backward: no Slice kernel; and the backward's dq, dk, dv
    are stored by their MatMuls straight into the projection's gradient: no Concat kernel. With
    d = 6 the views start at offsets that are not multiples of 4, so neither the loads nor the
    stores may use vec4 there. Forward and the gradients of the projection's input and weight
    match numpy."""
    t = 5
    feeds = {"inp": rnd(2, t, d, seed=80), "wp": rnd(d, 3 * d, seed=79)}
    exe = _run(_graph(feeds, _qkv_attention(), "o", grad=True, consts=_qkv_consts(d, heads, t)), feeds)
    assert not any(n.op in ("Slice", "Concat") for n in exe.prepared.nodes)
    views = [n for n in exe.prepared.nodes if n.op == "MatMul" and (n.attr("_viewA") or n.attr("_viewB"))]
    assert len(views) >= 5, [n.attrs for n in views]   # q k^T, p v, and the backward's reads of q, k, v
    into = [n.attr("_intoY")[2] for n in exe.prepared.nodes if n.attr("_intoY")]
    assert sorted(into) == [0, d, 2 * d]


def test_concat_of_matmul_results_read_elsewhere_stays_a_copy(monkeypatch):
    """A Concat along the last axis of two MatMul results (one reshaped on its way) is stored in
    place by the MatMuls; it stays a copy when a part is not a MatMul's result, when a result is
    also read elsewhere, or with the switch off. Forward and gradients match numpy."""
    feeds = {"a": rnd(2, 3, 4, seed=85), "b": rnd(4, 8, seed=86), "c": rnd(2, 3, 3, seed=87), "w": rnd(3, 5, seed=88)}
    consts = {"shape": np.array([2, 3, 5], np.int64), "s0": np.array([0], np.int64),
              "e3": np.array([3], np.int64), "ax": np.array([2], np.int64)}

    def graph(second: list[Node], outputs=("z",), grad=True):
        nodes = [Node("MatMul", ["a", "b"], ["ab"], name="mm1"), Node("MatMul", ["c", "w"], ["cw"], name="mm2"),
                 *second, Node("Concat", ["ab", "part"], ["y"], {"axis": -1}, name="cat"),
                 Node("Mul", ["y", "y"], ["z"], name="square")]   # y itself is not a graph output
        g = _graph(feeds, nodes, "z", grad=grad, consts=consts)
        g.outputs = list(outputs) + g.outputs[1:]
        return g

    reshaped = [Node("Reshape", ["cw", "shape"], ["part"], name="r")]
    exe = _run(graph(reshaped), feeds)
    assert not any(n.op == "Concat" for n in exe.prepared.nodes)
    assert sorted(n.attr("_intoY")[2] for n in exe.prepared.nodes if n.attr("_intoY")) == [0, 8]
    sliced = [Node("Slice", ["cw", "s0", "e3", "ax"], ["part"], name="cut")]
    assert any(n.op == "Concat" for n in _run(graph(sliced), feeds).prepared.nodes)
    assert any(n.op == "Concat" for n in _run(graph(reshaped, ("z", "ab"), grad=False), feeds).prepared.nodes)
    monkeypatch.setenv("ANYGRAD_WGPU_SLICE_VIEWS", "0")
    assert any(n.op == "Concat" for n in _run(graph(reshaped), feeds).prepared.nodes)


def test_slices_not_read_as_views_stay_copies(monkeypatch):
    """A slice reshaped across its gap (no strides can walk it) stays a Slice kernel, as does
    every slice with ANYGRAD_WGPU_SLICE_VIEWS=0; a stepped slice becomes a view (at inference:
    in training a 2-D weight gradient reads it through a Gemm, which takes no views). All match
    numpy."""
    feeds = {"x": rnd(2, 3, 8, seed=81), "w": rnd(12, 5, seed=82)}
    consts = {"s": np.array([0], np.int64), "e": np.array([4], np.int64), "ax": np.array([2], np.int64),
              "flat": np.array([2, 12], np.int64), "st": np.array([2], np.int64)}
    merged = [Node("Slice", ["x", "s", "e", "ax"], ["xs"], name="slice"),
              Node("Reshape", ["xs", "flat"], ["xf"], name="merge"),
              Node("MatMul", ["xf", "w"], ["y"], name="mm")]
    exe = _run(_graph(feeds, merged, "y", grad=True, consts=consts), feeds)
    assert any(n.op == "Slice" for n in exe.prepared.nodes)
    feeds = {"x": rnd(2, 3, 8, seed=83), "w": rnd(4, 5, seed=84)}
    consts["e"] = np.array([8], np.int64)
    stepped = [Node("Slice", ["x", "s", "e", "ax", "st"], ["xs"], name="slice"),
               Node("MatMul", ["xs", "w"], ["y"], name="mm")]
    exe = _run(_graph(feeds, stepped, "y", grad=False, consts=consts), feeds)
    assert not any(n.op == "Slice" for n in exe.prepared.nodes)
    assert any(n.attr("_viewA") == ((2, 3, 4), (24, 8, 2), 0) for n in exe.prepared.nodes)
    monkeypatch.setenv("ANYGRAD_WGPU_SLICE_VIEWS", "0")
    exe = _run(_graph(feeds, stepped, "y", grad=False, consts=consts), feeds)
    assert any(n.op == "Slice" for n in exe.prepared.nodes)


def test_reshaped_strides_agree_with_numpy_views():
    """views.reshaped_strides against numpy, which reshapes a view in place exactly when it
    can: the same strides where numpy can, None where numpy must copy."""
    from anygrad.backends.wgpu.fusion.views import reshaped_strides
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        shape = tuple(int(d) for d in rng.integers(1, 5, size=rng.integers(1, 5)))
        base = np.zeros(tuple(d * 2 for d in shape), np.float32)
        view = base[tuple(slice(int(rng.integers(0, d)), None, int(rng.integers(1, 3))) for d in shape)]
        view = view[tuple(slice(0, d) for d in shape)]
        sizes = [d for d in view.shape]
        flat = int(np.prod(sizes))
        cut = [f for f in range(1, flat + 1) if flat % f == 0]
        new_shape = (int(rng.choice(cut)),)
        new_shape = new_shape + (flat // new_shape[0],)
        if rng.random() < 0.5:
            new_shape = (1,) + new_shape
        got = reshaped_strides(view.shape, tuple(s // 4 for s in view.strides), new_shape)
        trial = view.view()
        try:
            trial.shape = new_shape
        except AttributeError:
            assert got is None, (view.shape, view.strides, new_shape)
            continue
        checked += 1
        assert got is not None, (view.shape, view.strides, new_shape)
        want = tuple(s // 4 for s in trial.strides)
        assert all(g == w for g, w, n in zip(got, want, new_shape) if n != 1), (got, want, new_shape)
    assert checked > 50


def test_exported_sdpa_scales_and_transposes_fold_into_the_matmuls(monkeypatch):
    """Scaled dot-product attention as the dynamo exporter writes it (Hugging Face GPT-2): q and
    K^T each multiplied by sqrt(scale), K^T taken as Reshape to 3-D -> Transpose -> Reshape back,
    the key behind an Identity (an empty KV-cache concat), the output's head merge behind a
    same-shape Reshape. The scales become the MatMuls' alpha and every Transpose folds into
    their loads and stores, forward and backward (with the scale fold off, into the
    multiplications' loads); everything matches numpy."""
    b, h, t, d = 2, 2, 5, 4
    feeds = {"q": rnd(b, t, h, d, seed=90), "k": rnd(b, t, h, d, seed=91), "v": rnd(b, t, h, d, seed=92)}
    consts = {"s": np.array(0.7, np.float32), "flat": np.array([b * h, t, d], np.int64),
              "back": np.array([b, h, d, t], np.int64), "same": np.array([b, h, t, d], np.int64)}
    nodes = [Node("Transpose", ["q"], ["qh"], {"perm": [0, 2, 1, 3]}, name="qh"),
             Node("Transpose", ["k"], ["kh"], {"perm": [0, 2, 1, 3]}, name="kh"),
             Node("Transpose", ["v"], ["vh"], {"perm": [0, 2, 1, 3]}, name="vh"),
             Node("Identity", ["kh"], ["kc"], name="cache"),
             Node("Reshape", ["kc", "flat"], ["k3"], name="k3"),
             Node("Transpose", ["k3"], ["k3t"], {"perm": [0, 2, 1]}, name="kT"),
             Node("Reshape", ["k3t", "back"], ["kt"], name="k4"),
             Node("Mul", ["qh", "s"], ["qs"], name="scale_q"),
             Node("Mul", ["kt", "s"], ["ks"], name="scale_k"),
             Node("MatMul", ["qs", "ks"], ["scores"], name="qk"),
             Node("Softmax", ["scores"], ["p"], {"axis": -1}, name="softmax"),
             Node("MatMul", ["p", "vh"], ["o"], name="pv"),
             Node("Reshape", ["o", "same"], ["o2"], name="rename"),
             Node("Transpose", ["o2"], ["out"], {"perm": [0, 2, 1, 3]}, name="merge")]
    exe = _run(_graph(feeds, nodes, "out", grad=True, consts=consts), feeds)
    ops = [n.op for n in exe.prepared.nodes]
    assert "Transpose" not in ops and "Identity" not in ops, ops
    scales = [v for n in exe.prepared.nodes if n.op == "wgpu.Fused" for v in n.attrs["literals"].values()]
    assert not any(np.isclose(float(v), 0.7) for v in scales), scales   # (the check's own sum(out * R) stays)
    alphas = sorted(round(n.attr("_alpha"), 6) for n in exe.prepared.nodes if n.attr("_alpha") is not None)
    assert alphas and all(a in (0.7, 0.49) for a in alphas) and 0.49 in alphas, alphas
    monkeypatch.setenv("ANYGRAD_WGPU_SCALE_FOLD", "0")
    exe = _run(_graph(feeds, nodes, "out", grad=False, consts=consts), feeds)
    # the scales stay multiplications; the transposes feeding them are read through views there
    assert not any(n.attr("_alpha") for n in exe.prepared.nodes)
    assert any(n.op == "wgpu.Fused" and n.attr("_views") for n in exe.prepared.nodes)


def test_scale_of_a_matmul_result_is_its_alpha_unless_read_elsewhere():
    """(a @ b) * 0.25 is one MatMul with alpha 0.25, its bias added after; a result read by
    something else, or a scale that is a tensor, stays a multiplication."""
    feeds = {"a": rnd(3, 6, seed=93), "b": rnd(6, 5, seed=94), "c": rnd(5, seed=95), "w": rnd(5, seed=96)}
    consts = {"s": np.array([0.25], np.float32)}
    nodes = [Node("MatMul", ["a", "b"], ["ab"], name="mm"), Node("Mul", ["ab", "s"], ["y"], name="scale"),
             Node("Add", ["y", "c"], ["z"], name="bias")]
    exe = _run(_graph(feeds, nodes, "z", grad=False, consts=consts), feeds)
    (mm,) = exe.prepared.nodes
    assert mm.attr("_alpha") == 0.25 and mm.input(2) == "c"
    shared = nodes[:2] + [Node("Add", ["y", "ab"], ["z"], name="reuse")]
    assert not any(n.attr("_alpha") for n in _run(_graph(feeds, shared, "z", grad=False, consts=consts), feeds).prepared.nodes)
    tensor = [nodes[0], Node("Mul", ["ab", "w"], ["z"], name="scale")]
    assert not any(n.attr("_alpha") for n in _run(_graph(feeds, tensor, "z", grad=True), feeds).prepared.nodes)


def test_a_slice_of_everything_is_an_alias():
    """x[:, -T:, :] of a (B, T, d) tensor (Hugging Face's logits_to_keep=0) and its gradient are
    Identities (no copy kernels); a slice that drops anything is still a Slice. Matches numpy."""
    feeds = {"x": rnd(2, 3, 4, seed=97), "w": rnd(4, 5, seed=98)}
    nodes = [Node("Slice", ["x", "s", "e", "ax"], ["xs"], name="keep"),
             Node("Reshape", ["xs", "flat"], ["rows"], name="flat"),
             Node("Gemm", ["rows", "w"], ["y"], name="head")]

    def ops(first: int, rows: int) -> set[str]:
        consts = {"s": np.array([first], np.int64), "e": np.array([2**62], np.int64),
                  "ax": np.array([1], np.int64), "flat": np.array([rows, 4], np.int64)}
        return {n.op for n in _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds).prepared.nodes}

    assert not ops(-3, 6) & {"Slice", "SliceGrad"}
    assert {"Slice", "SliceGrad"} <= ops(-2, 4)


def test_residual_after_a_reshaped_2d_linear_runs_in_its_store():
    """Hugging Face's Conv1D: a 2-D addmm over (B*T, d) viewed back as (B, T, d), then the skip
    connection's Add: the Gemm adds the residual in its store (no Add kernel, no reshape), in
    training too; every gradient matches numpy."""
    feeds = {"h": rnd(2, 3, 6, seed=99), "w": rnd(6, 6, seed=100), "c": rnd(6, seed=101), "x": rnd(2, 3, 6, seed=102)}
    consts = {"rows": np.array([6, 6], np.int64), "back": np.array([2, 3, 6], np.int64)}
    nodes = [Node("Reshape", ["h", "rows"], ["h2"], name="flat"),
             Node("Gemm", ["h2", "w", "c"], ["g"], name="addmm"),
             Node("Reshape", ["g", "back"], ["g3"], name="view"),
             Node("Add", ["x", "g3"], ["y"], name="skip")]
    exe = _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds)
    (gemm,) = [n for n in exe.prepared.nodes if n.outputs[0] == "y"]
    assert gemm.op == "Gemm" and gemm.attr("_residual") and gemm.inputs[2:] == ["c", "x"]


@pytest.mark.parametrize("variant", ["register", "shared", "dot"])
@pytest.mark.parametrize("mask_shape,fill_true", [((6, 7), True), ((2, 1, 6, 7), False), ((1, 7), True)])
def test_a_masked_fill_of_attention_scores_runs_in_their_gemms_store(variant, mask_shape, fill_true):
    """softmax(where(mask, -inf, q @ k^T)), attention's causal mask as both exporters write it: the
    Where runs in the scores GEMM's store, reading the mask where it broadcasts into (B, H, T, S)
    (a trailing T x S block; a mask per sample and not per head; one row for every query), with
    the fill as Where's true or false branch; forward and training gradients as numpy's."""
    feeds = {"q": rnd(2, 3, 6, 4, seed=60), "k": rnd(2, 3, 4, 7, seed=61)}
    mask = np.random.default_rng(62).random(mask_shape) < 0.4
    mask[..., 0] = not fill_true  # no row masked whole: softmax over nothing is nan either way
    fill = np.array(-np.inf if fill_true else -1e4, np.float32)
    branches = ["fill", "s"] if fill_true else ["s", "fill"]
    nodes = [Node("MatMul", ["q", "k"], ["s"], {"_gemm_variant": variant}, name="qk"),
             Node("Where", ["mask", *branches], ["m"], name="masked_fill"),
             Node("Softmax", ["m"], ["p"], {"axis": -1}, name="softmax")]
    consts = {"mask": mask, "fill": fill}
    g = _graph(feeds, nodes, "p", grad=False, consts=consts)
    exe = _run(g, feeds)
    (mm,) = [n for n in exe.prepared.nodes if n.op == "MatMul"]
    assert mm.outputs[0] == "m" and mm.attr("_where") is not None and mm.inputs[4] == "mask"
    assert not any(n.startswith("ew:") for n in _kernel_names(exe)), _kernel_names(exe)
    _run(_graph(feeds, nodes, "p", grad=True, consts=consts), feeds)


def test_a_masked_fill_after_a_split_k_gemm_is_applied_once_by_the_reduce(monkeypatch):
    """A long K split over workgroups: the partial sums are stored unmasked and the reducing kernel
    applies bias, then the fill; with ANYGRAD_WGPU_WHERE_EPILOGUE=0 the Where is a kernel again."""
    feeds = {"a": rnd(4, 3000, seed=63), "b": rnd(3000, 8, seed=64), "c": rnd(8, seed=65)}
    mask = np.random.default_rng(66).random((4, 8)) < 0.5
    nodes = [Node("MatMul", ["a", "b"], ["ab"], {"_gemm_variant": "shared"}, name="mm"),
             Node("Add", ["ab", "c"], ["abc"], name="bias"),
             Node("Where", ["mask", "fill", "abc"], ["y"], name="masked_fill")]
    consts = {"mask": mask, "fill": np.array(-3.5, np.float32)}
    exe = _run(_graph(feeds, nodes, "y", grad=False, consts=consts), feeds)
    names = _kernel_names(exe)
    assert [n.op for n in exe.prepared.nodes] == ["MatMul"] and any("reduce" in n for n in names), names
    monkeypatch.setenv("ANYGRAD_WGPU_WHERE_EPILOGUE", "0")
    exe = _run(_graph(feeds, nodes, "y", grad=False, consts=consts), feeds)
    assert any(n.startswith("ew:") for n in _kernel_names(exe)), _kernel_names(exe)


@pytest.mark.parametrize("variant", ["register", "shared"])
def test_a_masked_fill_by_a_mask_fed_each_step_runs_in_the_store(variant):
    """A padding mask fed as a bool graph input (B, 1, 1, S), as attention masks from a tokenizer
    arrive, not a constant, kept where true: the GEMM reads it as the device stores bools."""
    q, k = rnd(2, 3, 5, 4, seed=90), rnd(2, 3, 4, 6, seed=91)
    keep = np.random.default_rng(92).random((2, 1, 1, 6)) < 0.6
    keep[..., 0] = True
    g = Graph(name="masked")
    for name, a in (("q", q), ("k", k)):
        g.inputs.append(name)
        g.info[name] = TensorInfo(F32, a.shape)
    g.inputs.append("keep")
    g.info["keep"] = TensorInfo(np.dtype(np.bool_), keep.shape)
    g.initializers["fill"] = np.array(-1e9, np.float32)
    g.nodes = [Node("MatMul", ["q", "k"], ["s"], {"_gemm_variant": variant}, name="qk"),
               Node("Where", ["keep", "s", "fill"], ["m"], name="masked_fill"),
               Node("Softmax", ["m"], ["p"], {"axis": -1}, name="softmax")]
    g.outputs = ["p"]
    exe = _run(specialize(g, {}), {"q": q, "k": k, "keep": keep})
    (mm,) = [n for n in exe.prepared.nodes if n.op == "MatMul"]
    assert mm.attr("_where") == (-1e9, False)
    # the only elementwise kernel unpacks the bytes of the bool input (uploaded four to a word)
    assert [n for n in _kernel_names(exe) if n.startswith("ew:")] == ["ew:wgpu.UnpackBytes"], _kernel_names(exe)


def _f16_mlp_block(hidden: int, gelu_first: bool = False) -> tuple[Graph, dict]:
    """autocast(x + Linear2(GELU(Linear1(x)))) with the gradients of sum(out * R): under f16 the
    Linears are f16 GEMMs, the bias and GELU f16, the residual stream f32 (the GEMM's f16 result
    widened by a Cast), and the backward holds GELU's gradient after the GEMM computing dy.
    `gelu_first`: x + Linear2(Linear1(GELU(float16(x)))), whose GELU only GEMMs read (its forward
    and the weight gradient's): applied as they load it."""
    from anygrad.ir.autocast import autocast
    g = Graph(name="f16block")
    g.inputs = ["x"]
    g.info["x"] = TensorInfo(F32, (2, 8, 64))
    for name, value in {"W1": rnd(64, hidden, seed=11) * 0.2, "b1": rnd(hidden, seed=12),
                        "W2": rnd(hidden, 64, seed=13) * 0.1}.items():
        g.initializers[name] = value
        g.info[name] = TensorInfo(F32, value.shape)
        g.params.append(name)
    b = Builder(g, prefix="t")
    if gelu_first:
        h = b.op("Add", [b.op("MatMul", [b.op("Gelu", [b.op("Cast", ["x"], to=10)]), "W1"]), "b1"])  # f16 GELU
    else:
        h = b.op("Gelu", [b.op("Add", [b.op("MatMul", ["x", "W1"]), "b1"])])
    g.outputs = [b.op("Add", ["x", b.op("MatMul", [h, "W2"])])]
    s = autocast(specialize(g, {"x": (2, 8, 64)}))
    out = s.outputs[0]
    b = Builder(s, prefix="check")
    loss = b.op("ReduceSum", [b.op("Mul", [out, b.const(rnd(2, 8, 64, seed=99))])], keepdims=0)
    grads = gradients(s, loss, ["x", "W1", "b1", "W2"])
    s.outputs = [out] + [grads[n] for n in ("x", "W1", "b1", "W2")]
    return s, {"x": rnd(2, 8, 64, seed=10)}


@pytest.mark.parametrize("variant", ["shared", "split", "prologue"])
def test_f16_epilogues_round_each_step_as_its_kernel_would(variant, monkeypatch):
    """Under f16 a Linear's bias and GELU, the next Linear's residual add (through the Cast widening
    its f16 result), GELU's gradient after the GEMM computing dy, and GELU recomputed at a GEMM's
    operand load run inside the GEMMs, each fused step rounding to f16 where the graph holds
    float16 (gemm_spec.Output.rounds): the same bits as every node as a kernel of its own
    (fuse=False), and the numpy backend's numbers; with these fusions float32-only
    (ANYGRAD_WGPU_F16_EPILOGUES=0) GELU and its gradient are kernels of their own."""
    from wgpu_util import wgpu_backend

    from anygrad.backends.wgpu.fusion.gemm_layout import GEMM_OPS
    graph, feeds = _f16_mlp_block(256, gelu_first=variant == "prologue")
    pin = {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16}
    if variant == "split":
        pin["_gemm_splits"] = 2
    for n in graph.nodes:
        if n.op in GEMM_OPS:
            n.attrs.update(pin)
    want, fused, exe = run_both(graph, feeds)
    plain = wgpu_backend().compile(graph, fuse=False).run(feeds)
    for k, v in plain.items():
        np.testing.assert_array_equal(fused[k], v, err_msg=k)
    assert_close(want, fused, rtol=2e-2, atol=2e-3)   # float16 results, the numpy backend's own kernels
    names = _kernel_names(exe)
    assert not any(n.startswith("ew:") and "Gelu" in n for n in names), names
    assert any("splitK 2" in n for n in names) == (variant == "split")
    # a register's f16 rounding goes through halfstore.round_half: NVIDIA's compiler drops f32(f16(x))
    shaders = [st.kernel.wgsl for st in exe.plan.steps]
    assert any("anygrad_round_f16(" in w for w in shaders) and not any("f32(anygrad_to_f16(" in w for w in shaders)
    if variant == "prologue":
        assert sum(n.attr("_prologueA") is not None for n in exe.prepared.nodes) == 2  # forward, weight gradient
    monkeypatch.setenv("ANYGRAD_WGPU_F16_EPILOGUES", "0")
    _, off, exe_off = run_both(graph, feeds)
    assert any("Gelu" in n for n in _kernel_names(exe_off)), _kernel_names(exe_off)
    assert_close(want, off, rtol=2e-2, atol=2e-3)


def _mha_unpack(L: int, B: int, heads: int, d: int) -> tuple[list[Node], dict]:
    """nn.MultiheadAttention(batch_first=True) as dynamo exports it (torchvision's ViT): x
    (B, L, d) transposed to (L, B, d), one in-projection, then unflatten, unsqueeze, a 5-D
    transpose, squeeze and three Gathers for q, k, v, each head split as Reshape (L, B*H, D) ->
    Transpose(1, 0, 2) -> Reshape (B, H, L, D); q and k^T scaled by a constant; the heads merged
    back through the AV MatMul's result, Reshape (L*B, d), the out-projection and
    Transpose(1, 0, 2)."""
    D = d // heads
    c = {"unflat": np.array([L, B, 3, d], np.int64), "ax0": np.array([0], np.int64),
         "ax3": np.array([3], np.int64), "split": np.array([L, B * heads, D], np.int64),
         "bhld": np.array([B, heads, L, D], np.int64), "flat": np.array([L * B, d], np.int64),
         "lbd": np.array([L, B, d], np.int64), "scale": np.array(D ** -0.25, np.float32)}
    nodes = [Node("Transpose", ["x"], ["xt"], {"perm": [1, 0, 2]}, name="batch_first"),
             Node("MatMul", ["xt", "w_in"], ["proj"], name="in_proj"),
             Node("Reshape", ["proj", "unflat"], ["unf"], name="unflatten"),
             Node("Unsqueeze", ["unf", "ax0"], ["uns"], name="unsqueeze"),
             Node("Transpose", ["uns"], ["tr5"], {"perm": [3, 1, 2, 0, 4]}, name="transpose5"),
             Node("Squeeze", ["tr5", "ax3"], ["sq"], name="squeeze")]
    for j, name in enumerate("qkv"):
        c[f"i{j}"] = np.array(j, np.int64)
        nodes += [Node("Gather", ["sq", f"i{j}"], [f"{name}g"], {"axis": 0}, name=f"select_{name}"),
                  Node("Reshape", [f"{name}g", "split"], [f"{name}s"], name=f"view_{name}"),
                  Node("Transpose", [f"{name}s"], [f"{name}t"], {"perm": [1, 0, 2]}, name=f"heads_{name}"),
                  Node("Reshape", [f"{name}t", "bhld"], [f"{name}h"], name=f"bhld_{name}")]
    nodes += [Node("Transpose", ["kh"], ["kT"], {"perm": [0, 1, 3, 2]}, name="kT"),
              Node("Mul", ["qh", "scale"], ["q_scaled"], name="scale_q"),
              Node("Mul", ["kT", "scale"], ["k_scaled"], name="scale_k"),
              Node("MatMul", ["q_scaled", "k_scaled"], ["scores"], name="qk"),
              Node("Softmax", ["scores"], ["p"], {"axis": -1}, name="softmax"),
              Node("MatMul", ["p", "vh"], ["o"], name="pv"),
              Node("Transpose", ["o"], ["om"], {"perm": [2, 0, 1, 3]}, name="merge"),
              Node("Reshape", ["om", "flat"], ["of"], name="flatten"),
              Node("MatMul", ["of", "w_out"], ["out"], name="out_proj"),
              Node("Reshape", ["out", "lbd"], ["outl"], name="unflatten_out"),
              Node("Transpose", ["outl"], ["y"], {"perm": [1, 0, 2]}, name="batch_first_out")]
    return nodes, c


@pytest.mark.parametrize("d,heads", [(8, 2), (6, 3)], ids=["aligned", "unaligned"])
def test_multihead_attention_reads_its_heads_as_views_and_stores_their_gradients_in_place(d, heads, monkeypatch):
    """nn.MultiheadAttention's unpacking (_mha_unpack) costs no copy kernel: each attention MatMul
    reads q, k and v as strided views of the in-projection through the transposes, squeeze and
    gathers, forward and backward; the scales are the MatMuls' alpha; the backward's dq, dk, dv
    are stored through their Reshape -> Transpose -> Reshape in the layout the Gathers' gradients
    read. Forward and every gradient match numpy, with head dims that break vec4 alignment too."""
    L, B = 5, 2
    feeds = {"x": rnd(B, L, d, seed=90), "w_in": rnd(d, 3 * d, seed=91), "w_out": rnd(d, d, seed=92)}
    nodes, consts = _mha_unpack(L, B, heads, d)
    exe = _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds)
    ops = [n.op for n in exe.prepared.nodes]
    assert "Gather" not in ops and not any(n.op == "Mul" for n in exe.prepared.nodes), ops
    views = [n for n in exe.prepared.nodes if n.op == "MatMul" and (n.attr("_viewA") or n.attr("_viewB"))]
    assert len(views) >= 6, [n.attrs for n in views]   # q k^T, p v; the backward's reads of q, k, v
    stored = [n for n in exe.prepared.nodes if n.op == "MatMul" and n.attr("_intoY")]
    assert len(stored) >= 3, [n.attrs for n in exe.prepared.nodes if n.op == "MatMul"]   # dq, dk, dv
    # left: the batch_first transposes and their gradients (the in-projection's weight gradient
    # reads x^T through a Gemm, which takes no views; the output's is an elementwise kernel's
    # input) and the 5-D one's gradient
    assert ops.count("Transpose") <= 5, ops
    monkeypatch.setenv("ANYGRAD_WGPU_SLICE_VIEWS", "0")   # the switch: copies again, same numbers
    before = [n.op for n in _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds).prepared.nodes]
    assert before.count("Gather") == 3 and before.count("Transpose") >= ops.count("Transpose") + 6, before


def test_strided_views_agree_with_numpy():
    """views.StridedView through random chains of reshapes, transposes, stepped slices and
    one-index gathers, against numpy doing the same: where it gives a view, numpy's elements
    read at its shape, strides and offset in the base; it gives one for every chain whose
    result numpy can express as a view of the base (np.shares_memory and a reshape without a
    copy), and None only where some axis has no single stride."""
    from anygrad.backends.wgpu.fusion.views import StridedView
    rng = np.random.default_rng(11)
    viewed = refused = 0
    for _ in range(400):
        shape = tuple(int(d) for d in rng.integers(1, 5, size=rng.integers(1, 5)))
        base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
        arr, view = base, StridedView.of(shape)
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.integers(0, 4)
            if kind == 0:     # reshape to a random factorisation
                flat, dims = arr.size, []
                while flat > 1 and len(dims) < 4:
                    f = int(rng.choice([f for f in range(1, flat + 1) if flat % f == 0]))
                    dims.append(f)
                    flat //= f
                new = tuple(dims + ([flat] if flat > 1 else []))
                arr, view = arr.reshape(new), view.reshape(new) if view is not None else None
            elif kind == 1:   # transpose
                perm = [int(p) for p in rng.permutation(arr.ndim)]
                arr, view = arr.transpose(perm), view.transpose(perm) if view is not None else None
            elif kind == 2 and arr.ndim:   # stepped slice of one axis
                ax = int(rng.integers(0, arr.ndim))
                start, step = int(rng.integers(0, arr.shape[ax])), int(rng.integers(1, 3))
                cut = [slice(None)] * arr.ndim
                cut[ax] = slice(start, None, step)
                size = len(range(start, arr.shape[ax], step))
                arr = arr[tuple(cut)]
                view = view.sliced(ax, start, step, size) if view is not None else None
            elif arr.ndim:    # gather of one index
                ax = int(rng.integers(0, arr.ndim))
                i = int(rng.integers(0, arr.shape[ax]))
                arr = np.take(arr, i, axis=ax)
                view = view.taken(ax, i, keep=False) if view is not None else None
        got = view.strided() if view is not None else None
        if got is None:
            refused += 1
            continue
        s, st, off = got
        assert s == arr.shape
        read = np.lib.stride_tricks.as_strided(base.reshape(-1)[off:], s, tuple(8 * x for x in st))
        np.testing.assert_array_equal(read, arr)
        viewed += 1
    assert viewed > 200 and refused > 10, (viewed, refused)


@pytest.mark.parametrize("d", [8, 6], ids=["vec4", "scalar"])
def test_elementwise_kernels_read_and_store_through_transposes(d):
    """The batch-first transposes nn.MultiheadAttention puts around elementwise work (ViT's
    LayerNorm output into a cast, the out-projection's result into the residual Add, and their
    gradients out of elementwise kernels) are read and stored by the fused kernels through
    strided views: no Transpose kernel in the forward or backward, four elements at a time where
    the last axis stays contiguous (d = 8), one at a time where a view starts unaligned (d = 6,
    a slice). Forward and gradients match numpy."""
    L, B = 5, 3
    feeds = {"x": rnd(B, L, d, seed=95), "r": rnd(L, B, d, seed=96), "w": rnd(d, d, seed=97)}
    consts = {"half": np.array(0.5, np.float32), "s0": np.array([1], np.int64), "e0": np.array([L], np.int64),
              "ax": np.array([1], np.int64)}
    nodes = [Node("Transpose", ["x"], ["xt"], {"perm": [1, 0, 2]}, name="batch_first"),
             Node("Mul", ["xt", "half"], ["h"], name="scale"),
             Node("Tanh", ["h"], ["a"], name="act"),
             Node("Add", ["a", "r"], ["s"], name="residual"),
             Node("MatMul", ["s", "w"], ["m"], name="proj"),
             Node("Relu", ["m"], ["q"], name="relu"),
             Node("Transpose", ["q"], ["qt"], {"perm": [1, 0, 2]}, name="back"),
             Node("Slice", ["qt", "s0", "e0", "ax"], ["qs"], name="drop_first"),
             Node("Sigmoid", ["qs"], ["y"], name="out")]
    exe = _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds)
    names = _kernel_names(exe)
    assert not any(n.startswith("Transpose") for n in names), names
    viewed = [n for n in exe.prepared.nodes if n.attr("_views") or n.attr("_stores")]
    assert viewed, [n.op for n in exe.prepared.nodes]


def test_an_elementwise_read_through_a_transpose_another_would_store_through_sees_its_data():
    """a = x * 2 -> Transpose -> Slice -> tanh: the second kernel may read a through the
    Transpose and Slice, or the first may store a transposed; not both (an LSTM's gradient read
    zeros when the store folded first and the read then looked through a Transpose that was
    gone). Forward and gradient match numpy."""
    feeds = {"x": rnd(3, 4, 8, seed=98)}
    consts = {"two": np.array(2.0, np.float32), "s0": np.array([1], np.int64), "e0": np.array([3], np.int64),
              "ax": np.array([1], np.int64)}
    nodes = [Node("Mul", ["x", "two"], ["a"], name="double"),
             Node("Transpose", ["a"], ["at"], {"perm": [1, 0, 2]}, name="t"),
             Node("Slice", ["at", "s0", "e0", "ax"], ["s"], name="cut"),
             Node("Tanh", ["s"], ["y"], name="act")]
    exe = _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds)
    assert not any(n.startswith("Transpose") for n in _kernel_names(exe)), _kernel_names(exe)


def test_torchvision_vit_trains_on_wgpu_as_on_numpy_with_its_attention_layouts_as_views(monkeypatch):
    """torchvision's VisionTransformer (nn.MultiheadAttention inside, exported by dynamo) trains
    three SGD steps on wgpu with the losses and weights of the numpy backend, and the views take
    its attention's layout kernels: no Gather (the class token is a view the head's Gemm reads),
    and of the Transposes only those a view cannot express (a transpose reshaped across its
    axes: the patch embedding's, the 2-D in-projection's input) or next to LayerNorm's gradient,
    against more than three times as many with the views off."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    from torchvision.models.vision_transformer import VisionTransformer

    import anygrad
    from anygrad.optim import SGD
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
    y = rng.integers(0, 4, 4).astype(np.int64)
    torch.manual_seed(0)
    net = VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                            num_classes=4, dropout=0.0, attention_dropout=0.0)

    def train(device):
        model = anygrad.from_torch(net, torch.from_numpy(x[:2]), check=False)
        model.compile(loss="cross_entropy", optimizer=SGD(lr=0.1), device=device)
        losses = [model.train_on_batch(x, y) for _ in range(3)]
        names = _kernel_names(model.train_program(*model._batch(x, y))) if device == "wgpu" else []
        return losses, model.state_dict(), names
    want, weights, _ = train("cpu")
    got, trained, names = train("wgpu")
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for name, w in weights.items():
        np.testing.assert_allclose(trained[name], w, rtol=1e-3, atol=1e-5, err_msg=name)
    layout = [n for n in names if n.split("[")[0].split(":")[0] in ("Transpose", "Gather")]
    monkeypatch.setenv("ANYGRAD_WGPU_SLICE_VIEWS", "0")
    copies = [n for n in train("wgpu")[2] if n.split("[")[0].split(":")[0] in ("Transpose", "Gather")]
    assert "Gather" not in layout and len(layout) <= 5 and len(copies) > 3 * len(layout), (layout, copies)


@pytest.mark.parametrize("trans", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("variant", ["register", "shared", "split"])
def test_gemm_reads_slices_and_gathers_as_views(trans, variant):
    """A Gemm (2-D, transA / transB, bias C, alpha, beta) whose operands are a column slice and a
    one-index gather of larger tensors reads them as strided views (fold_views' `_viewA` /
    `_viewB`): no Slice or Gather kernel, in any GEMM variant, forward and gradients against
    numpy (the f32 in-projections and class tokens of exported transformers)."""
    ta, tb = trans
    pin = {"_gemm_variant": "shared", "_gemm_splits": 2} if variant == "split" else {"_gemm_variant": variant}
    M, K, N = (9, 300, 7) if variant == "split" else (9, 13, 7)
    a_shape = (K, M + 5) if ta else (M, K + 5)   # A cut from wider columns
    b_shape = (3, N, K) if tb else (3, K, N)     # B one matrix of a stack
    feeds = {"a": rnd(*a_shape, seed=81), "b": rnd(*b_shape, seed=82), "c": rnd(N, seed=83)}
    consts = {"s0": np.array([2], np.int64), "s1": np.array([2 + a_shape[1] - 5], np.int64),
              "ax": np.array([1], np.int64), "i": np.array(1, np.int64)}
    nodes = [Node("Slice", ["a", "s0", "s1", "ax"], ["av"], name="cut"),
             Node("Gather", ["b", "i"], ["bv"], {"axis": 0}, name="pick"),
             Node("Gemm", ["av", "bv", "c"], ["y"], {"transA": ta, "transB": tb, "alpha": 0.5, "beta": 2.0, **pin},
                  name="gemm")]
    exe = _run(_graph(feeds, nodes, "y", grad=True, consts=consts), feeds)
    gemms = [n for n in exe.prepared.nodes if n.op == "Gemm" and n.outputs[0] == "y"]
    assert len(gemms) == 1 and gemms[0].attr("_viewA") is not None and gemms[0].attr("_viewB") is not None
    names = _kernel_names(exe)
    assert not any(n.split("[")[0].split(":")[0] in ("Slice", "Gather") for n in names), names


@pytest.mark.parametrize("conv2", ["3x3", "1x1", "3x3 stride 2", "3x3 split", "1x1 stride 2", "3x3 skip",
                                   "1x1 skip split"])
def test_relu_gradient_runs_in_the_store_of_the_conv_input_gradient(conv2):
    """Conv -> ReLU -> Conv, trained: ReLU's gradient (dy * (y > 0)) is applied as the second
    conv's input gradient stores dy (GRAD_EPILOGUE_CONVS: no ReluGrad kernel, ResNet's 32 a step),
    reading y at the element it writes: plain, pointwise, by phase (stride 2, whose empty phases
    are cleared to 0, ReLU's gradient of 0) and split in K. With a skip connection around the
    second conv (y = conv2(a) + a: a ResNet block), the skip's gradient is added in that store
    first, then ReLU's gradient applied: no Add kernel either. Every gradient against numpy."""
    k = 1 if conv2.startswith("1x1") else 3
    stride = 2 if "stride 2" in conv2 else 1
    attrs2 = {"kernel_shape": [k, k], "pads": [k // 2] * 4, "strides": [stride, stride]}
    co = 32 if "split" in conv2 else 8 if "skip" in conv2 else 6  # split: K = co * taps, at least 128 a split
    skip = "skip" in conv2
    feeds = {"x": rnd(2, 3, 9, 9, seed=90), "W1": rnd(co if skip else 8, 3, 3, 3, seed=91),
             "W2": rnd(co, co if skip else 8, k, k, seed=92)}
    nodes = [Node("Conv", ["x", "W1"], ["h"], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, name="c1"),
             Node("Relu", ["h"], ["a"], name="act"),
             Node("Conv", ["a", "W2"], ["z" if skip else "y"], attrs2, name="c2")]
    if skip:
        nodes.append(Node("Add", ["z", "a"], ["y"], name="skip"))
    g = _graph(feeds, nodes, "y", grad=True)
    if "split" in conv2:
        for n in g.nodes:
            if n.op == "ConvGradInput":
                n.attrs.update({"_gemm_variant": "shared", "_gemm_splits": 2})
    exe = _run(g, feeds)
    prepared = exe.prepared.nodes
    assert not [n for n in prepared if n.op == "ReluGrad" or "ReluGrad" in [m.op for m in n.attrs.get("members", ())]]
    (fused,) = [n for n in prepared if n.op == "ConvGradInput" and n.attr("_epilogue") == "ReluGrad"]
    assert fused.attr("_epilogue_arg") and fused.inputs[5]
    assert bool(fused.attr("_residual")) == skip and bool(fused.input(3)) == skip
    if skip:  # the one Add kernel left is the forward's skip (y = z + a); the backward's sum is gone
        adds = [n for n in prepared if n.op == "Add" or "Add" in [m.op for m in n.attrs.get("members", ())]]
        assert [n.outputs[0] for n in adds] == ["y"], adds
    if "split" in conv2:
        assert any("splitK" in name for name in _kernel_names(exe))
