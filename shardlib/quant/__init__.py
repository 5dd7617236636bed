"""Quantized frozen weights: the project's packed int4 (``Int4Tensor``, ``quantize_int4_``).

torchao is optional and never imported here; its int8 tensors are used as they come.
"""

from .int4 import Int4Tensor, quantize_int4_

__all__ = ["Int4Tensor", "quantize_int4_"]
