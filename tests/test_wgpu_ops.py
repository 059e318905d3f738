"""Every wgpu lowering (except the GEMM family, tested in test_wgpu_gemm.py) against the numpy
backend: forward outputs and the gradients of sum(out * R), on small shapes including odd sizes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wgpu_util import check_wgpu, wgpu_backend

from anygrad.ir.passes import RNG_STATE

pytestmark = pytest.mark.wgpu

RNG = np.random.default_rng(0)


def randn(*shape, lo=None):
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.abs(x) + lo if lo is not None else x


@pytest.fixture(scope="module", autouse=True)
def _backend():
    wgpu_backend()  # skips the module when there is no adapter


# -- elementwise -----------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"])
@pytest.mark.parametrize("shapes", [((3, 5), (5,)), ((2, 1, 4), (3, 1)), ((7,), ())])
def test_binary(op, shapes):
    a, b = randn(*shapes[0]), randn(*shapes[1])
    if op in ("Div", "Pow"):
        b = np.abs(b) + 0.5
    if op == "Pow":
        a = np.abs(a) + 0.1
    check_wgpu(op, [a, b], rtol=2e-4, atol=1e-5)


def test_pow_negative_base_integer_exponent():
    check_wgpu("Pow", [randn(6), np.array([2.0, 3.0, 0.0, 1.0, 2.0, 3.0], np.float32)], const=[1], grad=False)


UNARY = ["Neg", "Abs", "Exp", "Log", "Sqrt", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Erf", "Reciprocal",
         "Softplus", "Floor", "Ceil", "Sign", "Elu", "Selu", "Celu", "Softsign", "HardSigmoid", "HardSwish",
         "Mish", "Sin", "Cos", "Gelu", "Tanhshrink"]


@pytest.mark.parametrize("op", UNARY)
def test_unary(op):
    x = randn(4, 9)
    if op in ("Log", "Sqrt", "Reciprocal"):
        x = np.abs(x) + 0.2
    from anygrad.ir.registry import get_op
    if get_op(op) is None:
        pytest.skip(f"{op} is not registered")
    grad = op not in ("Floor", "Ceil", "Sign")
    check_wgpu(op, [x], {"alpha": 0.2} if op == "LeakyRelu" else None, grad=grad, rtol=2e-4, atol=2e-6)


def test_gelu_tanh_and_prelu():
    check_wgpu("Gelu", [randn(5, 4) * 2], {"approximate": "tanh"})
    check_wgpu("PRelu", [randn(2, 3, 4), randn(3, 1)])


def test_tanh_sigmoid_extremes():
    x = np.array([-100, -20, -1e-3, 0, 1e-3, 20, 100], np.float32)
    check_wgpu("Tanh", [x])
    check_wgpu("Sigmoid", [x])


def test_compare_where_cast():
    a, b = randn(3, 4), randn(4)
    for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"):
        check_wgpu(op, [a, b], feed=[0, 1], grad=False)
    cond = randn(3, 4) > 0
    check_wgpu("Where", [cond, randn(3, 4), randn(4)])
    check_wgpu("Cast", [randn(5) * 4], {"to": 7}, grad=False)  # float -> int64 truncates
    check_wgpu("Cast", [np.array([0, 2, -1], np.int64)], {"to": 1}, feed=[0], grad=False)
    check_wgpu("Cast", [np.array([0.0, 2.5, -1.0], np.float32)], {"to": 9}, feed=[0], grad=False)
    check_wgpu("Not", [np.array([True, False, True])], feed=[0], grad=False)
    check_wgpu("Where", [cond, randn(3, 4), randn(4)], feed=[0])


def test_clip_and_expand():
    x = randn(3, 5)
    check_wgpu("Clip", [x, np.array(-0.5, np.float32), np.array(0.7, np.float32)], const=[1, 2])
    check_wgpu("Expand", [randn(3, 1), np.array([2, 3, 4], np.int64)])


def test_variadic():
    check_wgpu("Sum", [randn(2, 3), randn(3), randn(2, 1)])
    check_wgpu("Mean", [randn(2, 3), randn(3)])


def test_elementwise_losses():
    x, y = randn(4, 3), RNG.uniform(size=(4, 3)).astype(np.float32)
    check_wgpu("BinaryCrossEntropyWithLogits", [x, y], const=[1])
    check_wgpu("AbsoluteError", [x, randn(4, 3)])


# -- reductions ------------------------------------------------------------------------------------
@settings(max_examples=6, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=4), data=st.data(),
       op=st.sampled_from(["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL2",
                           "ReduceLogSumExp", "ReduceL1"]))
def test_reduce(shape, data, op):
    axes = data.draw(st.lists(st.integers(0, len(shape) - 1), unique=True, max_size=len(shape)))
    keep = data.draw(st.sampled_from([0, 1]))
    x = randn(*shape)
    attrs = {"keepdims": keep}
    inputs = [x] + ([np.array(axes, np.int64)] if axes else [])
    check_wgpu(op, inputs, attrs, rtol=2e-4, atol=1e-5)


def test_reduce_long_rows_tree():
    check_wgpu("ReduceSum", [randn(3, 700), np.array([1], np.int64)], {"keepdims": 0})
    check_wgpu("ReduceMean", [randn(5, 300, 2), np.array([0, 1], np.int64)], {"keepdims": 1})
    check_wgpu("ReduceMax", [randn(2000), np.array([0], np.int64)], {"keepdims": 0}, grad=False)
    # Long enough to split over several workgroups per output (two stages).
    check_wgpu("ReduceSum", [randn(3, 200, 101), np.array([0, 2], np.int64)], {"keepdims": 0}, rtol=1e-4)
    check_wgpu("ReduceMax", [randn(70000), np.array([0], np.int64)], {"keepdims": 1}, grad=False)
    check_wgpu("ReduceLogSumExp", [randn(2, 9000) * 5, np.array([1], np.int64)], {"keepdims": 0})


# -- data movement ---------------------------------------------------------------------------------
@pytest.mark.parametrize("perm", [(1, 0, 2), (2, 0, 1), None])
def test_transpose(perm):
    check_wgpu("Transpose", [randn(2, 3, 5)], {"perm": list(perm)} if perm else None)


def test_reshape_like_aliases():
    x = randn(2, 3, 4)
    check_wgpu("Reshape", [x, np.array([6, -1], np.int64)])
    check_wgpu("Flatten", [x], {"axis": 2})
    check_wgpu("Unsqueeze", [x, np.array([0, 3], np.int64)])
    check_wgpu("Squeeze", [randn(2, 1, 3), np.array([1], np.int64)])
    exe = check_wgpu("Identity", [x])
    assert exe.n_kernels >= 1


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    a, b = randn(2, 3, 4), randn(2, 3, 4)
    shape = list(b.shape)
    shape[axis] = 1
    check_wgpu("Concat", [a, randn(*shape), b], {"axis": axis})


def test_slice():
    x = randn(5, 7, 3)
    i64 = lambda *v: np.array(v, np.int64)
    check_wgpu("Slice", [x, i64(1, 0), i64(4, 7), i64(0, 1), i64(1, 2)])
    check_wgpu("Slice", [x, i64(-1), i64(-100), i64(1), i64(-2)])
    check_wgpu("Slice", [x, i64(0, 2), i64(5, 3), i64(0, 2)])


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
def test_pad(mode):
    pads = np.array([0, 2, 1, 0, 1, 2], np.int64)
    inputs = [randn(2, 4, 5), pads] + ([np.array(1.5, np.float32)] if mode == "constant" else [])
    check_wgpu("Pad", inputs, {"mode": mode}, const=[2])


def test_tile():
    check_wgpu("Tile", [randn(2, 3), np.array([2, 3], np.int64)])


def test_split():
    check_wgpu("Split", [randn(7, 3), np.array([2, 5], np.int64)], {"axis": 0}, n_outputs=2)


@pytest.mark.parametrize("axis,idx_shape", [(0, (4,)), (1, (2, 3)), (2, ())])
def test_gather(axis, idx_shape):
    x = randn(3, 4, 5)
    idx = RNG.integers(-x.shape[axis], x.shape[axis], size=idx_shape).astype(np.int64)
    check_wgpu("Gather", [x, idx], {"axis": axis})


def test_argmax():
    x = randn(4, 6, 3)
    check_wgpu("ArgMax", [x], {"axis": 1, "keepdims": 0}, feed=[0], grad=False)
    check_wgpu("ArgMin", [x], {"axis": -1}, feed=[0], grad=False)


# -- nn ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis", [((4, 10), 1), ((2, 3, 5), 1), ((3, 7), -1), ((3, 1100), 1),
                                        ((2, 600, 3), 1)])  # the last two: a workgroup per row
def test_softmax(op, shape, axis):
    check_wgpu(op, [randn(*shape) * 3], {"axis": axis})


@pytest.mark.parametrize("shape", [(5, 3, 4, 4), (7, 6), (3, 2, 9), (40, 2, 23, 19)])  # the last splits
def test_batchnorm_training(shape):
    c = shape[1]
    x = randn(*shape) * 2 + 1
    scale, bias = randn(c), randn(c)
    mean, var = randn(c), randn(c, lo=0.5)
    check_wgpu("BatchNormalization", [x, scale, bias, mean, var], {"training_mode": 1, "momentum": 0.8},
               const=[3, 4], n_outputs=3, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shape", [(4, 3, 5), (40, 2, 23, 19)])
def test_batchnorm_eval(shape):
    c = shape[1]
    check_wgpu("BatchNormalization", [randn(*shape), randn(c), randn(c), randn(c), randn(c, lo=0.5)],
               const=[3, 4], rtol=2e-4, atol=2e-5)


def test_batchnorm_running_stats_in_place():
    """As in a training step: running stats are state, updated in the same buffers."""
    x = randn(6, 4, 3)
    exe = check_wgpu("BatchNormalization", [x, randn(4), randn(4), randn(4), randn(4, lo=0.5)],
                     {"training_mode": 1}, n_outputs=3, state={3: "rm", 4: "rv"}, grad=False)
    assert exe.n_kernels == 2


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5])
def test_dropout_masks_match_numpy_bit_for_bit(ratio):
    x = randn(5, 37)
    rng_state = np.array([1234, 7], np.uint32)
    inputs = [x, np.array(ratio, np.float32), np.array(True), rng_state]
    check_wgpu("Dropout", inputs, {"salt": 3}, const=[1, 2], n_outputs=2, state={3: RNG_STATE})


def test_dropout_inference_is_identity():
    check_wgpu("Dropout", [randn(3, 4)], n_outputs=1)


# -- losses and metrics -----------------------------------------------------------------------------
def _targets(n, c, shape=None, ignore=None):
    t = RNG.integers(0, c, size=shape or (n,)).astype(np.int64)
    if ignore is not None:
        t.reshape(-1)[::3] = ignore
    return t


@pytest.mark.parametrize("log_input", [0, 1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(log_input, reduction):
    x = randn(6, 5)
    check_wgpu("CrossEntropy", [x, _targets(6, 5, ignore=-100)],
               {"log_input": log_input, "reduction": reduction, "ignore_index": -100}, feed=[1], rtol=2e-4)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_weights_spatial_smoothing(smoothing):
    x = randn(3, 4, 2, 3)
    w = randn(4, lo=0.1)
    check_wgpu("CrossEntropy", [x, _targets(3, 4, (3, 2, 3)), w],
               {"log_input": 0, "reduction": "mean", "label_smoothing": smoothing}, const=[2], rtol=2e-4)


def test_onnx_loss_ops():
    x = randn(5, 4)
    t = _targets(5, 4)
    check_wgpu("NegativeLogLikelihoodLoss", [x, t], {"reduction": "mean"})
    check_wgpu("SoftmaxCrossEntropyLoss", [x, t], {"reduction": "sum"}, n_outputs=2)


def test_count_correct():
    x = randn(9, 4)
    t = np.argmax(x, axis=1)
    t[::2] = (t[::2] + 1) % 4
    check_wgpu("CountCorrect", [x, t.astype(np.int64)], feed=[0, 1], grad=False)


# -- optimizer updates -------------------------------------------------------------------------------
OPTIMIZERS = [
    ("SGD", {"momentum": 0.0}), ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", {"momentum": 0.9, "dampening": 0.1, "maximize": True}),
    ("Adam", {}), ("Adam", {"amsgrad": True, "weight_decay": 0.1}), ("AdamW", {}),
    ("Adagrad", {"lr_decay": 0.01, "weight_decay": 0.1}), ("Adadelta", {"weight_decay": 0.1}),
    ("RMSprop", {}), ("RMSprop", {"momentum": 0.9, "centered": True}),
]


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS)
@pytest.mark.parametrize("step", [1.0, 3.0])
def test_optimizer_update(name, kwargs, step):
    from anygrad import optim
    opt = getattr(optim, name)(lr=0.01, **kwargs)
    p, g = randn(4, 3), randn(4, 3)
    state = opt.init_state(p)
    # Averages of gradients small, of squares positive and large (centered RMSprop takes
    # sqrt(square_avg - grad_avg^2)).
    slots = [randn(4, 3) * 0.1 if s in ("exp_avg", "grad_avg", "momentum_buffer") else randn(4, 3, lo=1.0)
             for s in state]
    inputs = [p, g, *slots, np.array(0.01, np.float32), np.array(step, np.float32)]
    n = len(inputs)
    check_wgpu(opt.op, inputs, opt.attrs(), n_outputs=1 + len(slots), grad=False, rtol=1e-5, atol=1e-6,
               state={n - 2: "lr", n - 1: "step"})


def test_integer_max_pool_compares_integers():
    """Integer pools must compare as integers: through f32 bits, negative ints are NaNs or
    negative floats that order backwards, and small positive ones are denormals a GPU flushes."""
    rng = np.random.default_rng(3)
    x = rng.integers(-2**31, 2**31 - 1, (2, 3, 5, 6), dtype=np.int64).astype(np.int32)
    check_wgpu("MaxPool", [x], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 1]},
               feed=[0], grad=False)
    check_wgpu("MaxPool", [(np.arange(25, dtype=np.uint8) + 1).reshape(1, 1, 5, 5)],
               {"kernel_shape": [5, 5], "pads": [2, 2, 2, 2]}, feed=[0], grad=False)
    x3 = rng.integers(-2**31, 2**31 - 1, (1, 2, 4, 5, 3), dtype=np.int64).astype(np.int32)  # the 3-D kernel
    check_wgpu("MaxPool", [x3], {"kernel_shape": [2, 3, 2], "pads": [1, 1, 0, 0, 1, 1]}, feed=[0], grad=False)
