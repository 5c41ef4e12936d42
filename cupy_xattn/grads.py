"""The named result type, shared by the API, the reference and the GPU backend."""
from typing import Any, NamedTuple


class CrossAttentionGrads(NamedTuple):
    """The 10 gradients of a cross-attention layer, in the benchmark's order.

    Shapes with B batch, Nv video tokens, Nt text tokens and D hidden size.

    Attributes
    ----------
    grad_video_latents : (B, Nv, D)
    grad_text_embeddings : (B, Nt, D)
    grad_query_weight, grad_key_weight, grad_value_weight, grad_output_weight : (D, D)
    grad_query_bias, grad_key_bias, grad_value_bias, grad_output_bias : (D,)
        ``grad_key_bias`` is mathematically zero and comes out as rounding noise.
    """

    grad_video_latents: Any
    grad_text_embeddings: Any
    grad_query_weight: Any
    grad_query_bias: Any
    grad_key_weight: Any
    grad_key_bias: Any
    grad_value_weight: Any
    grad_value_bias: Any
    grad_output_weight: Any
    grad_output_bias: Any


# The public argument order: grad_output, then the inputs the 10 gradients belong to.
INPUT_NAMES = ("grad_output",) + tuple(name.removeprefix("grad_") for name in CrossAttentionGrads._fields)
