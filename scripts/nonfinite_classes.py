"""Per mode, the output elements whose class (finite, +Inf, -Inf, NaN) differs from the float64
reference's, on 2x256x77 with one NaN or Inf input element (docs/reliability.md, Known risks).

    PYTHONPATH=. python3 scripts/nonfinite_classes.py
"""
import collections

import numpy

from cupy_xattn import cases, cross_attention_backward, reference
from cupy_xattn.grads import CrossAttentionGrads

CLASSES = ("finite", "+inf", "-inf", "nan")


def classes(x):
    return numpy.select([x == numpy.inf, x == -numpy.inf, numpy.isnan(x)], [1, 2, 3], 0)


def main():
    import cupy

    case = next(c for c in cases.load_suite("sol-execbench") if c.label == "2x256x77")
    inputs = cases.make_inputs(case, seed=9)
    for name, index, value in (("video_latents", (0, 0, 0), numpy.nan), ("key_weight", (0, 0), numpy.inf),
                               ("grad_output", (0, 0, 0), numpy.inf)):
        bad = {key: array.copy() for key, array in inputs.items()}
        bad[name][index] = value
        with numpy.errstate(all="ignore"):
            want = reference.backward(**bad, num_heads=16)
        for precision in ("fp32", "tf32", "fp16"):
            got = cross_attention_backward(**{k: cupy.asarray(a) for k, a in bad.items()}, precision=precision)
            found = []
            for output, w, g in zip(CrossAttentionGrads._fields, want, got):
                cw, cg = classes(numpy.asarray(w)).ravel(), classes(cupy.asnumpy(g).astype(numpy.float64)).ravel()
                differ = cw != cg
                counts = collections.Counter(f"{CLASSES[a]}->{CLASSES[b]}" for a, b in zip(cw[differ], cg[differ]))
                if counts:
                    found.append(f"{output}: {dict(counts)} of {cw.size}")
            print(f"{name}={value} {precision}: " + ("; ".join(found) or "every element's class as the reference's"),
                  flush=True)


if __name__ == "__main__":
    main()
