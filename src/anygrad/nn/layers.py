"""Layers with PyTorch's names, arguments, state_dict keys and default initialisation."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import functional as F
from . import init
from .functional._util import _ints
from .functional.convolution import _no_indices
from .functional.dense import _embedding_options, _padding_row
from .module import Buffer, Module, Parameter


def _empty(*shape: int) -> Parameter:
    return Parameter(np.zeros(shape, np.float32))


# -- containers ----------------------------------------------------------------------------------
class Sequential(Module):
    def __init__(self, *modules: Module):
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def forward(self, x):
        for m in self.children():
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return list(self.children())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return self.children()


class ModuleList(Module):
    def __init__(self, modules: Iterable[Module] = ()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, m: Module) -> ModuleList:
        self.add_module(str(len(self._modules)), m)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self.children())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return self.children()


# -- affine layers -------------------------------------------------------------------------------
class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty(out_features, in_features)
        self.bias = _empty(out_features) if bias else None
        self.reset_parameters()

    def reset_parameters(self, rng: np.random.Generator | None = None) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5), rng=rng)
        if self.bias is not None:
            init.bias_uniform_(self.bias, self.in_features, rng)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def _conv_setup(layer: Module, in_channels: int, out_channels: int, kernel_size: Any, groups: int,
                padding_mode: str) -> None:
    """The checks and attributes every conv layer (plain and transposed) shares."""
    name = type(layer).__name__
    if padding_mode != "zeros":
        raise ConfigError(f"{name}: padding_mode '{padding_mode}' is not supported (only 'zeros')")
    if in_channels % groups or out_channels % groups:
        raise ConfigError(f"{name}: in_channels {in_channels} and out_channels {out_channels} "
                          f"must be divisible by groups {groups}")
    layer.in_channels, layer.out_channels, layer.groups = in_channels, out_channels, groups
    layer.kernel_size = tuple(_ints(kernel_size, layer.nd, "kernel_size"))


class _ConvNd(Module):
    nd = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding: Any = 0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
    ):
        super().__init__()
        _conv_setup(self, in_channels, out_channels, kernel_size, groups, padding_mode)
        self.stride, self.dilation = (
            tuple(_ints(stride, self.nd, "stride")),
            tuple(_ints(dilation, self.nd, "dilation")),
        )
        self.padding = padding if isinstance(padding, str) else tuple(_ints(padding, self.nd, "padding"))
        if self.padding == "same" and any(s != 1 for s in self.stride):
            raise ConfigError(f"{type(self).__name__}: padding='same' needs stride 1 (as in PyTorch)")
        self.weight = _empty(out_channels, in_channels // groups, *self.kernel_size)
        self.bias = _empty(out_channels) if bias else None
        self.reset_parameters()

    def reset_parameters(self, rng: np.random.Generator | None = None) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5), rng=rng)
        if self.bias is not None:
            init.bias_uniform_(self.bias, init.fan_in(self.weight.shape), rng)

    def forward(self, x):
        return F.conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"bias={self.bias is not None}"
        )


class Conv1d(_ConvNd):
    nd = 1


class Conv2d(_ConvNd):
    nd = 2


class _ConvTransposeNd(Module):
    """Weight (in_channels, out_channels / groups, *kernel), PyTorch's init (fan_in from dim 1)."""

    nd = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        output_padding=0,
        groups: int = 1,
        bias: bool = True,
        dilation=1,
        padding_mode: str = "zeros",
    ):
        super().__init__()
        _conv_setup(self, in_channels, out_channels, kernel_size, groups, padding_mode)
        self.stride = tuple(_ints(stride, self.nd, "stride"))
        self.padding = tuple(_ints(padding, self.nd, "padding"))
        self.output_padding = tuple(_ints(output_padding, self.nd, "output_padding"))
        self.dilation = tuple(_ints(dilation, self.nd, "dilation"))
        self.weight = _empty(in_channels, out_channels // groups, *self.kernel_size)
        self.bias = _empty(out_channels) if bias else None
        self.reset_parameters()

    def reset_parameters(self, rng: np.random.Generator | None = None) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5), rng=rng)
        if self.bias is not None:
            init.bias_uniform_(self.bias, init.fan_in(self.weight.shape), rng)

    def _output_padding(self, x, output_size) -> tuple[int, ...]:
        """PyTorch's output_size: the extra rows past the smallest output, each below the stride."""
        if output_size is None:
            return self.output_padding
        size = [int(s) for s in output_size][-self.nd:]
        out_pad = []
        for i, (want, n, s, p, k, d) in enumerate(zip(size, list(x.shape)[-self.nd:], self.stride, self.padding,
                                                       self.kernel_size, self.dilation)):
            least = (int(n) - 1) * s - 2 * p + d * (k - 1) + 1
            if not least <= want < least + s:
                raise ConfigError(f"{type(self).__name__}: output_size {size} is not reachable in dim {i} "
                                  f"(from {least} to {least + s - 1})")
            out_pad.append(want - least)
        return tuple(out_pad)

    def forward(self, x, output_size=None):
        return F.conv_transpose(x, self.weight, self.bias, self.stride, self.padding,
                                self._output_padding(x, output_size), self.groups, self.dilation)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, output_padding={self.output_padding}, dilation={self.dilation}, "
            f"groups={self.groups}, bias={self.bias is not None}"
        )


class ConvTranspose1d(_ConvTransposeNd):
    nd = 1


class ConvTranspose2d(_ConvTransposeNd):
    nd = 2


# -- normalisation ---------------------------------------------------------------------------------
class _BatchNorm(Module):
    ranks: tuple[int, ...] = ()

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ):
        super().__init__()
        if momentum is None and track_running_stats:
            raise ConfigError(
                f"{type(self).__name__}: momentum=None (a cumulative average of the running statistics) "
                "cannot be expressed by the BatchNormalization op, whose momentum is fixed; pass a number "
                "such as momentum=0.1"
            )
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.track_running_stats = track_running_stats
        self.weight = _empty(num_features) if affine else None
        self.bias = _empty(num_features) if affine else None
        if track_running_stats:
            self.running_mean = Buffer(np.zeros(num_features, np.float32))
            self.running_var = Buffer(np.ones(num_features, np.float32))
            # Kept for PyTorch's state_dict; the graph does not count (momentum is fixed).
            self.num_batches_tracked = Buffer(np.array(0, np.int64))
        else:  # always batch statistics: no state, as PyTorch's None buffers
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(name, None)
        self.reset_parameters()

    def reset_parameters(self, rng: np.random.Generator | None = None) -> None:
        if self.weight is not None:
            init.ones_(self.weight)
            init.zeros_(self.bias)
        if self.track_running_stats:
            init.zeros_(self.running_mean)
            init.ones_(self.running_var)
            self.num_batches_tracked.data = np.array(0, np.int64)

    def forward(self, x):
        if len(x.shape) not in self.ranks:
            raise ConfigError(
                f"{type(self).__name__} expects input of rank {' or '.join(map(str, self.ranks))}, "
                f"got shape {tuple(x.shape)}"
            )
        return F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            momentum=self.momentum,
            eps=self.eps,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.weight is not None}, "
            f"track_running_stats={self.track_running_stats}"
        )


class BatchNorm1d(_BatchNorm):
    ranks = (2, 3)


class BatchNorm2d(_BatchNorm):
    ranks = (4,)


class LayerNorm(Module):
    def __init__(
        self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True
    ):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape, self.eps = shape, eps
        self.weight = _empty(*shape) if elementwise_affine else None
        self.bias = _empty(*shape) if elementwise_affine and bias else None
        self.reset_parameters()

    def reset_parameters(self, rng: np.random.Generator | None = None) -> None:
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Embedding(Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ):
        super().__init__()
        _embedding_options("Embedding", max_norm, scale_grad_by_freq)
        if padding_idx is not None:
            padding_idx = _padding_row("Embedding", padding_idx, num_embeddings)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.weight = _empty(num_embeddings, embedding_dim)
        self.reset_parameters()

    def reset_parameters(self, rng: np.random.Generator | None = None) -> None:
        init.normal_(self.weight, rng=rng)
        if self.padding_idx is not None:  # PyTorch starts the padding row at zero
            self.weight.data[self.padding_idx] = 0

    def forward(self, indices):
        return F.embedding(indices, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class Dropout(Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0 <= p < 1:
            raise ConfigError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


# -- pooling ---------------------------------------------------------------------------------------
class MaxPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.ceil_mode = dilation, ceil_mode

    def forward(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)


class AvgPool2d(Module):
    def __init__(
        self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True
    ):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad

    def forward(self, x):
        return F.avg_pool2d(
            x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad
        )


class _AdaptivePool(Module):
    fn: Any  # the functional form: each subclass names its own

    def __init__(self, output_size, return_indices: bool = False):
        super().__init__()
        _no_indices(type(self).__name__, return_indices)
        self.output_size = output_size

    def forward(self, x):
        return self.fn(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class AdaptiveAvgPool1d(_AdaptivePool):
    fn = staticmethod(F.adaptive_avg_pool1d)

    def __init__(self, output_size):
        super().__init__(output_size)


class AdaptiveAvgPool2d(_AdaptivePool):
    fn = staticmethod(F.adaptive_avg_pool2d)

    def __init__(self, output_size):
        super().__init__(output_size)


class AdaptiveMaxPool1d(_AdaptivePool):
    fn = staticmethod(F.adaptive_max_pool1d)


class AdaptiveMaxPool2d(_AdaptivePool):
    fn = staticmethod(F.adaptive_max_pool2d)


class Upsample(Module):
    def __init__(self, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None):
        super().__init__()
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor

    def forward(self, x):
        return F.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                             self.recompute_scale_factor)

    def extra_repr(self) -> str:
        what = f"size={self.size}" if self.size is not None else f"scale_factor={self.scale_factor}"
        return f"{what}, mode='{self.mode}'"


# -- shape and activations ---------------------------------------------------------------------------
class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return F.flatten(x, self.start_dim, self.end_dim)


class Identity(Module):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()

    def forward(self, x):
        return x


def _activation(name: str, fn, **defaults):
    """A stateless layer class that calls `fn(x, **options)`."""

    def __init__(self, *args, **kwargs):
        Module.__init__(self)
        options = dict(defaults)
        options.update(zip(defaults, args))
        options.update({k: v for k, v in kwargs.items() if k != "inplace"})
        self.options = options

    def forward(self, x):
        return fn(x, **self.options)

    def extra_repr(self):
        return ", ".join(f"{k}={v}" for k, v in self.options.items())

    return type(
        name,
        (Module,),
        {"__init__": __init__, "forward": forward, "extra_repr": extra_repr, "__doc__": f"torch.nn.{name}"},
    )


class PReLU(Module):
    """A learned slope for negative inputs: one, or one per channel (dim 1)."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25):
        super().__init__()
        self.num_parameters, self.init = num_parameters, init
        self.weight = _empty(num_parameters)
        self.reset_parameters()

    def reset_parameters(self, rng: np.random.Generator | None = None) -> None:
        self.weight.data = np.full(self.num_parameters, self.init, np.float32)

    def forward(self, x):
        return F.prelu(x, self.weight)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


ReLU = _activation("ReLU", F.relu)
ReLU6 = _activation("ReLU6", F.relu6)
Hardtanh = _activation("Hardtanh", F.hardtanh, min_val=-1.0, max_val=1.0)
Hardswish = _activation("Hardswish", F.hardswish)
Hardsigmoid = _activation("Hardsigmoid", F.hardsigmoid)
Softplus = _activation("Softplus", F.softplus, beta=1.0, threshold=20.0)
Mish = _activation("Mish", F.mish)
SELU = _activation("SELU", F.selu)
CELU = _activation("CELU", F.celu, alpha=1.0)
Softsign = _activation("Softsign", F.softsign)
LogSigmoid = _activation("LogSigmoid", F.logsigmoid)
LeakyReLU = _activation("LeakyReLU", F.leaky_relu, negative_slope=0.01)
Sigmoid = _activation("Sigmoid", F.sigmoid)
Tanh = _activation("Tanh", F.tanh)
ELU = _activation("ELU", F.elu, alpha=1.0)
GELU = _activation("GELU", F.gelu, approximate="none")
SiLU = _activation("SiLU", F.silu)
Softmax = _activation("Softmax", F.softmax, dim=None)
LogSoftmax = _activation("LogSoftmax", F.log_softmax, dim=None)
