"""How much range does the fp16 mode's one [K0 | V0] scale cost? A NumPy model, no GPU.

Usage: PYTHONPATH=. python3 scripts/kv_half_range.py [EXPONENT ...]      (default 0 12 15 16 18 20 24)
       PYTHONPATH=. python3 scripts/kv_half_range.py --gpu [EXPONENT ...]   (the library on a GPU)

The fp16 mode writes [K0 | V0] = T [Wk; Wv]^T as fp16 at one scale for the tensor, s_T · s_W ·
kv_half_alpha(D) (attention_bwd.half_kv), where s_T puts max|T| in [2^13, 2^14). A sample whose
text embeddings are 2^-e times the batch's largest gets its keys and values 2^-e lower in that
fp16: from some e on they are subnormals and lose bits. Here sample 0 is randn, sample 1 is randn
times 2^-e (its queries times 2^e, so its scores stay O(1)); the weights are randn / 32. Printed:
max|K0 · s_KV| of sample 1 and the max relative error of its dQ, dK, dV when only K0 and V0 are
rounded so (float64 otherwise), against the float64 attention backward (reference.py).

With --gpu, the whole layer's backward in the fp16 and tf32 modes at B = 2, Nv = 130, for
Nt = 77 (resident kernel) and 93 (streamed), with sample 1's text embeddings times 2^-e and its
video latents and dY times 2^e (so that its scores, dS and dQ, which every other fp16 copy holds at
one scale with sample 0's, stay within 2^e of sample 0's): the relative error (to its own largest element) of each sample's dX
(through dQ = dS K) and dT (through dK, dV) against reference.backward. tf32 at Nt = 77 keeps
per-tile scales for K and V (the control); tf32 at 93 takes a copy at the scale of max|K0|, max|V0|;
fp16 takes both at the bound's scale (attention_bwd.half_kv).
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


def layer_errors(exponent, precision, n_text, seed=0):
    """Relative errors of (dX[0], dX[1], dT[0], dT[1]), each to its own largest element, of the
    library's backward (on the GPU) with sample 1's text 2^-e, video and dY 2^e times sample 0's."""
    import cupy

    from cupy_xattn import cases, cross_attention_backward

    inputs = cases.make_inputs(cases.Case(2, 130, n_text, atol=0.0), seed=seed)
    inputs["text_embeddings"][1] *= numpy.float32(2.0 ** -exponent)
    inputs["video_latents"][1] *= numpy.float32(2.0 ** exponent)
    inputs["grad_output"][1] *= numpy.float32(2.0 ** exponent)
    ref = reference.backward(**inputs, num_heads=16)
    got = cross_attention_backward(**{k: cupy.asarray(v) for k, v in inputs.items()}, precision=precision)
    errors = []
    for name in ("grad_video_latents", "grad_text_embeddings"):
        x, y = cupy.asnumpy(getattr(got, name)).astype(numpy.float64), getattr(ref, name)
        errors += [float(numpy.abs(x[b] - y[b]).max() / numpy.abs(y[b]).max()) for b in (0, 1)]
    return errors


def main(argv):
    if argv[:1] == ["--gpu"]:
        for e in [int(a) for a in argv[1:]] or [0, 12, 16, 18, 20]:
            for precision in ("fp16", "tf32"):
                for n_text in (77, 93):
                    dx0, dx1, dt0, dt1 = layer_errors(e, precision, n_text)
                    print(f"sample 2^-{e:<2} {precision} Nt={n_text}   dX {dx0:.1e} / {dx1:.1e}   "
                          f"dT {dt0:.1e} / {dt1:.1e}")
        return
    for e in [int(a) for a in argv] or [0, 12, 15, 16, 18, 20, 24]:
        peak, (dq, dk, dv) = errors(e)
        print(f"sample 2^-{e:<2}  max|K0 · s_KV| {peak:9.3g}   dQ {dq:.1e}  dK {dk:.1e}  dV {dv:.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
