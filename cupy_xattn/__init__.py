"""Backward pass of a text-to-video cross-attention layer on NVIDIA GPUs, with CuPy.

``import cupy_xattn`` needs neither CuPy nor a GPU; only GPU work does.
"""
from .api import CrossAttentionGrads, cross_attention_backward
from .plans import Plan, plan

__version__ = "0.1.0"
__all__ = ["cross_attention_backward", "CrossAttentionGrads", "plan", "Plan", "__version__"]
