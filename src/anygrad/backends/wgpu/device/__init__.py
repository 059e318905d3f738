"""The WebGPU device underneath every stage: which implementation (wgpu-native or Dawn) and adapter,
shader modules and their errors, the poll thread, and the on-disk cache of pipelines and plans.
Imports nothing else of the backend, so kernels, planning, tuning and the runtime may all use it.
"""
