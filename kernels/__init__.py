"""Trellis kernels. ``reference`` is the executable spec (numpy, CPU, no torch).

GPU backends (Triton kernels, the exllamav3 extension) live beside it and are imported lazily.
"""
