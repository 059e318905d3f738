"""Op registry entries, one module per family. Importing this package registers them all."""
from . import elementwise, linalg, loss, nn, reduce, shape  # noqa: F401
