"""A cross-attention layer object for plain NumPy/CuPy training loops."""

import math

import numpy

from ._cupy import import_cupy
from .api import cross_attention_backward, cross_attention_forward
from .forward import PRECISIONS

#: the layer's parameters, in the order of ``cross_attention_forward``'s arguments after X and T.
PARAMETER_NAMES = ("query_weight", "query_bias", "key_weight", "key_bias", "value_weight", "value_bias",
                   "output_weight", "output_bias")


class CrossAttention:
    """Cross-attention from video latents (queries) to text embeddings (keys, values).

    Holds the 8 parameters and their gradients (NumPy arrays with ``backend="numpy"``, CuPy
    arrays with ``backend="cupy"``). ``forward`` keeps its inputs; ``backward`` returns the input
    gradients and adds the parameter gradients into ``grads`` (``+=``, as frameworks do: call
    ``zero_grad`` between steps).

    Parameters
    ----------
    hidden_size, num_heads : int
        D and H.
    precision : "tf32" or "fp32" (the forward's precisions; the backward runs at the same one).
    backend : "cupy" or "numpy" (the float64 reference, in float32 arrays).
    seed : int
        Weights are drawn N(0, 1/D), biases are zero.
    """

    def __init__(self, hidden_size=1024, num_heads=16, *, precision="tf32", backend="cupy", seed=0):
        if precision not in PRECISIONS:
            raise ValueError(f"CrossAttention: precision must be one of {', '.join(map(repr, PRECISIONS))} (those "
                             f"of the forward), got {precision!r}")
        self.hidden_size, self.num_heads, self.precision, self.backend = hidden_size, num_heads, precision, backend
        xp = import_cupy() if backend == "cupy" else numpy
        rng = numpy.random.default_rng(seed)
        params = {}
        for name in PARAMETER_NAMES:
            if name.endswith("weight"):
                host = rng.standard_normal((hidden_size, hidden_size)) / math.sqrt(hidden_size)
            else:
                host = numpy.zeros(hidden_size)
            params[name] = xp.asarray(host.astype(numpy.float32))
        self.params = params
        self.grads = {name: xp.zeros_like(p) for name, p in params.items()}
        self._saved = None

    def forward(self, video_latents, text_embeddings, text_lengths=None):
        """Y (B, Nv, D); keeps X, T and the lengths for ``backward``."""
        self._saved = (video_latents, text_embeddings, text_lengths)
        return cross_attention_forward(video_latents, text_embeddings, *self.params.values(),
                                       num_heads=self.num_heads, precision=self.precision, backend=self.backend,
                                       text_lengths=text_lengths)

    def backward(self, grad_output):
        """(dX, dT) for dY = ``grad_output`` at the last forward's inputs; adds dWq, dbq, … into
        ``grads`` (calling it twice adds them twice)."""
        if self._saved is None:
            raise RuntimeError("CrossAttention.backward needs a forward first")
        video_latents, text_embeddings, text_lengths = self._saved
        grads = cross_attention_backward(grad_output, video_latents, text_embeddings, *self.params.values(),
                                         num_heads=self.num_heads, precision=self.precision, backend=self.backend,
                                         text_lengths=text_lengths)
        for name in PARAMETER_NAMES:
            self.grads[name] += getattr(grads, "grad_" + name)
        return grads.grad_video_latents, grads.grad_text_embeddings

    def zero_grad(self):
        for g in self.grads.values():
            g[...] = 0
