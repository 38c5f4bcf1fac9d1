"""Numba kernels of the cpu device (installed as ``freetoken.cpu_kernels``), one module per op family."""
