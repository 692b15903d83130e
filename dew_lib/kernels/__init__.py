"""Compiled kernels for XLA:CPU, built from their C++ source on first use.

Each kernel is an XLA FFI handler compiled with the machine's C++ compiler for the machine's
own instruction set (`-march=native`) into a cache folder (`DEW_KERNEL_CACHE`, else
`~/.cache/dew/kernels`), once per source, compiler, jaxlib and CPU, then registered with JAX.
"""

from dew_lib.kernels.build import KernelBuildError, load_causal_attention

__all__ = ["KernelBuildError", "load_causal_attention"]
