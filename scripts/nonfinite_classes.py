"""Per mode, the output elements whose class (finite, +Inf, -Inf, NaN) differs from the float64
reference's, on 2x256x77 with one NaN or Inf input element (docs/reliability.md, Known risks).

    PYTHONPATH=. python3 scripts/nonfinite_classes.py
    PYTHONPATH=. python3 scripts/nonfinite_classes.py --dwo   (the fp32 mode's NaN in dWo, traced)
"""
import argparse
import collections

import numpy

from cupy_xattn import cases, cross_attention_backward, reference
from cupy_xattn.grads import CrossAttentionGrads

CLASSES = ("finite", "+inf", "-inf", "nan")


def classes(x):
    return numpy.select([x == numpy.inf, x == -numpy.inf, numpy.isnan(x)], [1, 2, 3], 0)


def _case_and_inputs():
    """The suite's 2x256x77 case and its inputs (NumPy, seed 9), as both checks draw them."""
    case = next(c for c in cases.load_suite("sol-execbench") if c.label == "2x256x77")
    return case, cases.make_inputs(case, seed=9)


def main():
    import cupy

    _, inputs = _case_and_inputs()
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


def dwo_nan_rule(copy, remainder):
    """Where Inf · (copy + remainder), formed as the 3xFP16 products Inf·remainder then + Inf·copy,
    is NaN: a zero remainder (Inf · 0), or one of the other sign than the copy (Inf − Inf)."""
    return (remainder == 0) | (numpy.sign(remainder) != numpy.sign(copy))


def trace_dwo():
    """The fp32 mode, +Inf at dY[0, 0, 0]: dWo's row 0 is Inf · O[0, :]; compare its NaN elements
    with dwo_nan_rule over O's fp16 copy and remainder, read from the plan (Session 36)."""
    import cupy

    import cupy_xattn

    case, inputs = _case_and_inputs()
    inputs["grad_output"][0, 0, 0] = numpy.inf
    plan = cupy_xattn.plan(case.batch_size, case.num_video_tokens, case.num_text_tokens, precision="fp32")
    got = cupy.asnumpy(plan(**{k: cupy.asarray(a) for k, a in inputs.items()}).grad_output_weight[0])
    (program, _), = plan._programs.values()
    d, base = inputs["output_weight"].shape[0], program._halves.data.ptr
    copy, remainder = (cupy.asnumpy(program._halves[(int(ptr) - base) // 2:][:d]).astype(numpy.float64)
                       for ptr in (program._o_half[0], program._o_half[2]))
    with numpy.errstate(all="ignore"):
        want = reference.backward(**inputs, num_heads=16).grad_output_weight[0]
    assert numpy.isinf(want).all(), "the reference's dWo row 0 should be all ±Inf here"
    predicted = dwo_nan_rule(copy, remainder)
    print(f"dWo row 0: {numpy.isnan(got).sum()} NaN of {d} (reference: all ±Inf); the rule predicts "
          f"{predicted.sum()} ({(remainder == 0).sum()} zero remainders); agree on {(numpy.isnan(got) == predicted).sum()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dwo", action="store_true", help="where the fp32 mode's NaN in dWo come from")
    if parser.parse_args().dwo:
        trace_dwo()
    else:
        main()
