"""Op registry entries, one module per family. Importing this package registers them all."""
from . import elementwise, index, linalg, loss, metrics, nn, norm, reduce, shape  # noqa: F401
