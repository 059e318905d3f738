"""The IR: Graph / Node / TensorInfo, the op registry interface, and graph passes."""
from .graph import Graph, Node, Shape, TensorInfo, info_of
from .registry import OpDef, all_ops, defop, get_op
from .infer import infer_node
from .passes import (RNG_STATE, check_supported, fold_constants, infer_shapes, set_training_mode, specialize,
                     unsupported_ops)
from .builder import Builder, GradContext
from .composite import defcomposite

__all__ = [
                     "RNG_STATE",
                     "Builder",
                     "GradContext",
                     "Graph",
                     "Node",
                     "OpDef",
                     "Shape",
                     "TensorInfo",
                     "all_ops",
                     "check_supported",
                     "defcomposite",
                     "defop",
                     "fold_constants",
                     "get_op",
                     "infer_node",
                     "infer_shapes",
                     "info_of",
                     "set_training_mode",
                     "specialize",
                     "unsupported_ops",
]
