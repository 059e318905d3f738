"""Measuring on the device: the GEMM autotuner (autotune.py), GPU timing and step profiles
(profiling.py), and the float16 self-tests an adapter passes before f16 kernels are used
(selftest.py). Uses kernels/, planning/ and device/; the runtime calls it.
"""
