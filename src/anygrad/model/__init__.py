"""The Model users hold (anygrad.model.Model): the class is in core.py, the work behind its
methods in the modules beside it (configure, heads, freezing, programs, rates, metrics, state,
placement), each owning one job."""
from .core import Model

__all__ = ["Model"]
