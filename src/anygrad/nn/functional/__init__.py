"""anygrad.nn.functional: PyTorch's functional API, each call appending the ONNX nodes that
PyTorch's exporter (opset 17) would emit for it.

Training/inference differences (dropout, batch statistics) are not decided here: Dropout and
BatchNormalization nodes are emitted as in an inference export, and the Model rewrites them for
training (`set_training_mode`), exactly as it does for an imported ONNX file.

One module per family, as torch.nn.functional groups them: activation (non-linear activations,
softmax), dense (linear, embedding), convolution (conv, conv_transpose, pooling), normalization
(batch_norm, layer_norm, dropout), vision (pad, interpolate), loss, attention; shape (reshape,
transpose, indexing, ...) and tensor_ops (reductions, arithmetic, constant, onnx_op) hold the
torch.* functions that traced Tensors' methods call. Everything is used from here
(`F.relu`, `F.conv2d`), which re-exports each module's public functions.
"""
from __future__ import annotations

from .shape import cat, flatten, getitem, permute, reshape, squeeze, transpose, unsqueeze, view  # noqa: F401
from .tensor_ops import add, amax, constant, exp, log, matmul, mean, onnx_op, sqrt, sum  # noqa: F401
from .activation import (  # noqa: F401
    celu, elu, gelu, hardsigmoid, hardswish, hardtanh, leaky_relu, log_softmax, logsigmoid, mish, prelu,
    relu, relu6, selu, sigmoid, silu, softmax, softplus, softsign, tanh,
)
from .dense import embedding, linear  # noqa: F401
from .convolution import (  # noqa: F401
    adaptive_avg_pool1d, adaptive_avg_pool2d, adaptive_max_pool1d, adaptive_max_pool2d, avg_pool2d, conv,
    conv1d, conv2d, conv3d, conv_transpose, conv_transpose1d, conv_transpose2d, conv_transpose3d, max_pool2d,
)
from .normalization import batch_norm, dropout, layer_norm  # noqa: F401
from .vision import interpolate, pad  # noqa: F401
from .loss import (  # noqa: F401
    binary_cross_entropy_with_logits, cross_entropy, l1_loss, mse_loss, nll_loss,
)
from .attention import scaled_dot_product_attention  # noqa: F401
