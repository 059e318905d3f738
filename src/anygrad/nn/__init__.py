"""anygrad.nn: write a model in Python, PyTorch style, and train it with anygrad.

    import anygrad.nn as nn
    import anygrad.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(784, 10)
        def forward(self, x):
            return F.log_softmax(self.fc(x.flatten(1)), dim=1)

    net = Net()
    net.load_state_dict(torch_state_dict_as_numpy)        # PyTorch names: "fc.weight", ...
    model = net.to_model(input_shape=(None, 1, 28, 28))   # an anygrad.Model: compile/train/predict
    ...
    net.load_from(model)                                  # trained weights back into the module

`forward` is traced once (symbolic batch) into the same Graph the ONNX importer produces.
"""

from . import functional, init
from .init import manual_seed
from .layers import (
    CELU,
    ELU,
    GELU,
    SELU,
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveMaxPool1d,
    AdaptiveMaxPool2d,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv1d,
    Conv2d,
    ConvTranspose1d,
    ConvTranspose2d,
    Dropout,
    Embedding,
    Flatten,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    LayerNorm,
    LeakyReLU,
    Linear,
    LogSigmoid,
    LogSoftmax,
    MaxPool2d,
    Mish,
    ModuleList,
    PReLU,
    ReLU,
    ReLU6,
    Sequential,
    SiLU,
    Sigmoid,
    Softmax,
    Softplus,
    Softsign,
    Tanh,
    Upsample,
)
from .module import Buffer, IncompatibleKeys, Module, Parameter, trace
from .tracing import SymInt, Tensor

__all__ = [
    "CELU",
    "ELU",
    "GELU",
    "SELU",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d",
    "AvgPool2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "Buffer",
    "Conv1d",
    "Conv2d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "Dropout",
    "Embedding",
    "Flatten",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "Identity",
    "IncompatibleKeys",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "LogSigmoid",
    "LogSoftmax",
    "MaxPool2d",
    "Mish",
    "Module",
    "ModuleList",
    "PReLU",
    "Parameter",
    "ReLU",
    "ReLU6",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Softplus",
    "Softsign",
    "SymInt",
    "Tanh",
    "Tensor",
    "Upsample",
    "functional",
    "init",
    "manual_seed",
    "trace",
]
