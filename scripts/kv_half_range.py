"""How much range does the fp16 mode's one [K0 | V0] scale cost? A NumPy model, no GPU.

Usage: PYTHONPATH=. python3 scripts/kv_half_range.py [EXPONENT ...]      (default 0 12 15 16 18 20 24)

The fp16 mode writes [K0 | V0] = T [Wk; Wv]^T as fp16 at one scale for the tensor, s_T · s_W ·
kv_half_alpha(D) (attention_bwd.half_kv), where s_T puts max|T| in [2^13, 2^14). A sample whose
text embeddings are 2^-e times the batch's largest gets its keys and values 2^-e lower in that
fp16: from some e on they are subnormals and lose bits. Here sample 0 is randn, sample 1 is randn
times 2^-e (its queries times 2^e, so its scores stay O(1)); the weights are randn / 32. Printed:
max|K0 · s_KV| of sample 1 and the max relative error of its dQ, dK, dV when only K0 and V0 are
rounded so (float64 otherwise), against the float64 attention backward (reference.py).
"""
import sys

import numpy

from cupy_xattn import reference
from cupy_xattn.attention_bwd import kv_half_alpha


def copy_scale(amax):
    """The fp16 copies' scale set afresh (half_scaling.cu): amax · s in [2^13, 2^14)."""
    return 2.0 ** (13 - numpy.floor(numpy.log2(amax)))


def errors(exponent, hidden=1024, heads=16, n_text=77, n_video=64, seed=0):
    """(max|K0 · s_KV| of the small sample, relative errors of its dQ, dK, dV)."""
    rng = numpy.random.default_rng(seed)
    text = rng.standard_normal((2, n_text, hidden))
    text[1] *= 2.0 ** -exponent
    wk, wv = (rng.standard_normal((hidden, hidden)) / 32 for _ in range(2))
    q = rng.standard_normal((1, n_video, hidden)) * 2.0 ** exponent
    dout = rng.standard_normal((1, n_video, hidden))
    s_kv = copy_scale(numpy.abs(text).max()) * copy_scale(max(numpy.abs(wk).max(), numpy.abs(wv).max())) \
        * kv_half_alpha(hidden)
    k, v = text[1:] @ wk.T, text[1:] @ wv.T
    rounded = [(x * s_kv).astype(numpy.float16).astype(numpy.float64) / s_kv for x in (k, v)]
    exact = reference.attention_backward(dout, q, k, v, 0.125, num_heads=heads)
    got = reference.attention_backward(dout, q, *rounded, 0.125, num_heads=heads)
    return numpy.abs(k * s_kv).max(), [float(numpy.abs(g - r).max() / numpy.abs(r).max()) for g, r in zip(got, exact)]


def main(argv):
    for e in [int(a) for a in argv] or [0, 12, 15, 16, 18, 20, 24]:
        peak, (dq, dk, dv) = errors(e)
        print(f"sample 2^-{e:<2}  max|K0 · s_KV| {peak:9.3g}   dQ {dq:.1e}  dK {dk:.1e}  dV {dv:.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
