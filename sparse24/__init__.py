"""sparse24: 2:4 (and N:M) structured sparsity for PyTorch with Triton kernels."""
from .format import FLOAT_DTYPES, Sparse24Tensor, compress, is_nm, mask_nm
from .ops.linear import linear, linear_reference

__version__ = "0.1.0"

__all__ = ["Sparse24Tensor", "compress", "is_nm", "mask_nm", "linear", "linear_reference", "FLOAT_DTYPES",
           "__version__"]
