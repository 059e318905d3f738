"""`anygrad codegen` lives in `anygrad.frontends.codegen` (a frontend: ONNX in, Python out); this
name stays so that `from anygrad.codegen import write_code` keeps working."""
from .frontends.codegen import Generated, Written, generate, write_code

__all__ = ["Generated", "Written", "generate", "write_code"]
