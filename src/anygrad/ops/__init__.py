"""Op registry entries, one module per family. Importing this package registers them all."""
from . import elementwise, gather_scatter, index, linalg, loss, metrics, nn, norm, reduce, resize, shape  # noqa: F401
from . import attention, bitwise, detection, image, math_extra, ml, optional, preview_training, quant, spectral  # noqa: F401
from . import conv_transpose, rnn  # noqa: F401  (composites of the ops above)
from . import collective  # noqa: F401  (AllReduceSum: data-parallel sums inside a step)
from . import fused_attention  # noqa: F401  (made by ir/attention.py)
from . import resolve  # noqa: F401  (OpDef.resolve for the families above: after them)
