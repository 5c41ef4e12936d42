"""Backward (and forward) pass of a text-to-video cross-attention layer on NVIDIA GPUs, with CuPy.

``import cupy_xattn`` needs neither CuPy nor a GPU; only GPU work does.
"""
from .api import CrossAttentionGrads, cross_attention_backward, cross_attention_forward
from .layer import CrossAttention
from .plans import Plan, plan

__version__ = "0.1.0"
__all__ = ["cross_attention_backward", "cross_attention_forward", "CrossAttention", "CrossAttentionGrads", "plan",
           "Plan", "__version__"]
