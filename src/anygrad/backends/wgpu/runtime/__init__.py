"""The runtime (after tinygrad's device + allocator + program): WgpuBackend, the device side
(adapter context, state buffers, pipelines: backend.py, context.py, buffers.py), and
WgpuExecutable, a compiled step, whose encoding (bind groups, dispatch list, compute passes:
encode.py) is apart from its running (inputs, submit, reading back: executable.py).
"""
