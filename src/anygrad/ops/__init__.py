"""Op registry entries, one module per family. Importing this package registers them all."""
from . import elementwise, linalg, reduce, shape  # noqa: F401
