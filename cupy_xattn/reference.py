"""Float64 NumPy reference of the cross-attention layer: forward and backward.

Shapes: B batch, Nv video tokens, Nt text tokens, D hidden size = H heads x d head_dim.
Weights are (out, in) and applied as ``x @ W.T + b``. Written for clarity, not speed;
every function takes any B, Nv, Nt, H and d.

``text_lengths`` (optional, ints [B], 1 ≤ length ≤ Nt): sample b attends to its first
text_lengths[b] text tokens only; the padded ones get zero attention, hence zero gradients.
"""
import math

import numpy

from .grads import CrossAttentionGrads


def _split_heads(x, num_heads):
    """(B, N, D) -> (B, H, N, d)."""
    batch, tokens, hidden = x.shape
    return x.reshape(batch, tokens, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _merge_heads(x):
    """(B, H, N, d) -> (B, N, D)."""
    batch, heads, tokens, head_dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, tokens, heads * head_dim)


def _rows(x):
    """(..., n) -> (rows, n): weight gradients sum over every batch and token."""
    return x.reshape(-1, x.shape[-1])


def _resolve_scale(scale, hidden_size, num_heads):
    return 1.0 / math.sqrt(hidden_size // num_heads) if scale is None else float(scale)


def _padding_mask(text_lengths, batch_size, text_tokens):
    """(B, 1, 1, Nt) True where a text token is padding, or None without lengths."""
    if text_lengths is None:
        return None
    lengths = numpy.asarray(text_lengths)
    if lengths.shape != (batch_size,) or lengths.dtype.kind not in "iu":
        raise ValueError(f"text_lengths must be {batch_size} integers (one per sample); got "
                         f"{lengths.dtype} array of shape {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > text_tokens:
        raise ValueError(f"text_lengths must lie in [1, {text_tokens}] (the text tokens); got "
                         f"{lengths.min()}..{lengths.max()}")
    return (numpy.arange(text_tokens) >= lengths[:, None])[:, None, None, :]


def attention_probabilities(queries, keys, scale, *, num_heads, text_lengths=None):
    """P = softmax(scale * Q K^T) over the (unpadded) text tokens.

    Parameters
    ----------
    queries : (B, Nv, D)
    keys : (B, Nt, D)
    scale : float
    num_heads : int
        D is split into num_heads heads of D / num_heads.
    text_lengths : (B,) ints, optional
        Unpadded text tokens per sample; the rest get P = 0.

    Returns
    -------
    (B, H, Nv, Nt), zero on padded text tokens.
    """
    scores = scale * _split_heads(queries, num_heads) @ _split_heads(keys, num_heads).swapaxes(-1, -2)
    padding = _padding_mask(text_lengths, *keys.shape[:2])
    if padding is not None:
        scores = numpy.where(padding, -numpy.inf, scores)
    probabilities = numpy.exp(scores - scores.max(axis=-1, keepdims=True))
    return probabilities / probabilities.sum(axis=-1, keepdims=True)


def attention(queries, keys, values, scale, *, num_heads, text_lengths=None):
    """O = P V with heads merged: (B, Nv, D) from Q (B, Nv, D), K and V (B, Nt, D)."""
    probabilities = attention_probabilities(queries, keys, scale, num_heads=num_heads, text_lengths=text_lengths)
    return _merge_heads(probabilities @ _split_heads(values, num_heads))


def attention_backward(grad_attention_output, queries, keys, values, scale, *, num_heads, text_lengths=None):
    """Gradients of the attention O = softmax(scale Q K^T) V with respect to Q, K and V.

    Parameters
    ----------
    grad_attention_output : (B, Nv, D)
        dO.
    queries : (B, Nv, D)
    keys, values : (B, Nt, D)
    scale, num_heads, text_lengths
        As in ``attention_probabilities``.

    Returns
    -------
    grad_queries : (B, Nv, D)
    grad_keys, grad_values : (B, Nt, D)
        Zero on padded text tokens.
    """
    probabilities = attention_probabilities(queries, keys, scale, num_heads=num_heads, text_lengths=text_lengths)
    grad_heads = _split_heads(grad_attention_output, num_heads)
    grad_values = probabilities.swapaxes(-1, -2) @ grad_heads
    grad_probabilities = grad_heads @ _split_heads(values, num_heads).swapaxes(-1, -2)
    grad_scores = scale * probabilities * (
        grad_probabilities - (grad_probabilities * probabilities).sum(axis=-1, keepdims=True))
    grad_queries = grad_scores @ _split_heads(keys, num_heads)
    grad_keys = grad_scores.swapaxes(-1, -2) @ _split_heads(queries, num_heads)
    return _merge_heads(grad_queries), _merge_heads(grad_keys), _merge_heads(grad_values)


def forward(video_latents, text_embeddings, query_weight, query_bias, key_weight, key_bias,
            value_weight, value_bias, output_weight, output_bias, scale=None, *, num_heads, text_lengths=None):
    """Y = attention(X Wq^T + bq, T Wk^T + bk, T Wv^T + bv) Wo^T + bo, in float64.

    Parameters
    ----------
    video_latents : (B, Nv, D)
    text_embeddings : (B, Nt, D)
    query_weight, key_weight, value_weight, output_weight : (D, D)
    query_bias, key_bias, value_bias, output_bias : (D,)
    scale : float, optional
        Defaults to 1/sqrt(D / num_heads).
    num_heads : int
    text_lengths : (B,) ints, optional
        Unpadded text tokens per sample (see the module's docstring).

    Returns
    -------
    (B, Nv, D) float64
    """
    X, T, Wq, bq, Wk, bk, Wv, bv, Wo, bo = (numpy.asarray(a, dtype=numpy.float64) for a in (
        video_latents, text_embeddings, query_weight, query_bias, key_weight, key_bias,
        value_weight, value_bias, output_weight, output_bias))
    scale = _resolve_scale(scale, X.shape[-1], num_heads)
    O = attention(X @ Wq.T + bq, T @ Wk.T + bk, T @ Wv.T + bv, scale, num_heads=num_heads, text_lengths=text_lengths)
    return O @ Wo.T + bo


def backward(grad_output, video_latents, text_embeddings, query_weight, query_bias, key_weight,
             key_bias, value_weight, value_bias, output_weight, output_bias, scale=None, *, num_heads,
             text_lengths=None):
    """The 10 gradients of ``forward`` given dY = ``grad_output`` (B, Nv, D), in float64.

    Other parameters as in ``forward``. Nothing is saved from a forward pass: Q, K, V, P and O
    are recomputed.

    Returns
    -------
    CrossAttentionGrads
        float64 arrays, shaped like the inputs they belong to.
    """
    dY, X, T, Wq, bq, Wk, bk, Wv, bv, Wo, bo = (numpy.asarray(a, dtype=numpy.float64) for a in (
        grad_output, video_latents, text_embeddings, query_weight, query_bias, key_weight,
        key_bias, value_weight, value_bias, output_weight, output_bias))
    scale = _resolve_scale(scale, X.shape[-1], num_heads)
    Q, K, V = X @ Wq.T + bq, T @ Wk.T + bk, T @ Wv.T + bv
    O = attention(Q, K, V, scale, num_heads=num_heads, text_lengths=text_lengths)
    dO = dY @ Wo
    dQ, dK, dV = attention_backward(dO, Q, K, V, scale, num_heads=num_heads, text_lengths=text_lengths)
    return CrossAttentionGrads(
        grad_video_latents=dQ @ Wq,
        grad_text_embeddings=dK @ Wk + dV @ Wv,
        grad_query_weight=_rows(dQ).T @ _rows(X),
        grad_query_bias=_rows(dQ).sum(axis=0),
        grad_key_weight=_rows(dK).T @ _rows(T),
        grad_key_bias=_rows(dK).sum(axis=0),
        grad_value_weight=_rows(dV).T @ _rows(T),
        grad_value_bias=_rows(dV).sum(axis=0),
        grad_output_weight=_rows(dY).T @ _rows(O),
        grad_output_bias=_rows(dY).sum(axis=0),
    )
