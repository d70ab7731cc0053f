"""The 2:4 linear op, in one home: :mod:`~.naive` (the pure-torch twin and its
backward), :mod:`~.launch` (the Triton launch path; the prefill kernel's configs
in :mod:`~.prefill`), :mod:`~.op` (the registered ``sparse24::linear`` op with
its autograd, and the dispatch)."""
from .launch import SUPPORTED_DTYPES, aot_compile, check_triton_args, kernel_call, linear_prefill, linear_triton
from .naive import CHUNK_ELEMENTS, CUDA_CHUNK_ELEMENTS, check_input, check_linear_args, chunk_rows, linear_reference
from .op import BACKENDS, KERNEL_DTYPES, choose_backend, forward, linear

__all__ = ["linear", "linear_reference", "linear_triton", "linear_prefill", "choose_backend", "forward", "check_input",
           "check_linear_args", "check_triton_args", "chunk_rows", "kernel_call", "aot_compile", "BACKENDS", "KERNEL_DTYPES",
           "SUPPORTED_DTYPES", "CHUNK_ELEMENTS", "CUDA_CHUNK_ELEMENTS"]
