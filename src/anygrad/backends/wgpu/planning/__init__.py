"""From a fused graph to a plan (planner.py): the kernel list, where every value lives (aliases,
slots by liveness, in place), binding packing/splitting and grid folding for the adapter's limits
(limits.py: the limits profiles). Uses kernels/ and fusion/; runs nothing on a device.
"""
