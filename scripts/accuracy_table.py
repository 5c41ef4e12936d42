"""Accuracy of each precision mode over the benchmark suite, as Markdown (docs/accuracy.md).

For every case (one seed, the benchmark's input distribution) and every precision, each of the
10 outputs is compared with the float64 reference by the benchmark's rule: the table cell is
max|x − y| / atol and, in brackets, the share of elements within atol + rtol·|y|. A second
table gives the max relative error max|x − y| / max|y| per output over the suite.

Usage: PYTHONPATH=. python3 scripts/accuracy_table.py [--seed N] [--commit SHA] > docs/accuracy.md
"""
import argparse
import datetime

import numpy

from cupy_xattn import cases, cross_attention_backward, reference
from cupy_xattn.grads import CrossAttentionGrads

PRECISIONS = ("fp32", "tf32", "fp16")
SHORT = {name: name.removeprefix("grad_").replace("_weight", "_W").replace("_bias", "_b")
         for name in CrossAttentionGrads._fields}


def main():
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()

    suite = cases.load_suite("sol-execbench")
    rows = {p: [] for p in PRECISIONS}
    relative = {p: dict.fromkeys(CrossAttentionGrads._fields, 0.0) for p in PRECISIONS}
    for case in suite:
        inputs = cases.make_inputs(case, seed=args.seed)
        ref = reference.backward(**inputs, num_heads=16)
        gpu_inputs = {name: cupy.asarray(a) for name, a in inputs.items()}
        for precision in PRECISIONS:
            got = cross_attention_backward(**gpu_inputs, precision=precision)
            result = cases.compare(got, ref, atol=case.atol, rtol=case.rtol, match_ratio=case.match_ratio)
            rows[precision].append((case, result))
            for name, x, y in zip(CrossAttentionGrads._fields, got, ref):
                if name == "grad_key_bias":  # zero in exact arithmetic: no relative error
                    continue
                err = float(numpy.abs(cupy.asnumpy(x).astype(numpy.float64) - y).max() / numpy.abs(y).max())
                relative[precision][name] = max(relative[precision][name], err)

    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print("# Accuracy of the precision modes\n")
    print(f"Measured on {device}, {datetime.date.today().isoformat()}, commit {args.commit}, "
          f"seed {args.seed}, by `scripts/accuracy_table.py`. Inputs drawn as the benchmark draws them "
          "(weights randn/√1024, the rest randn); reference: float64 NumPy (`cupy_xattn.reference`).\n")
    print("## Max relative error over the 16 cases\n")
    print("max|x − y| / max|y| per output (grad_key_bias is 0 in exact arithmetic, so it is left out).\n")
    names = [n for n in CrossAttentionGrads._fields if n != "grad_key_bias"]
    print("| precision | " + " | ".join(SHORT[n] for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for p in PRECISIONS:
        print(f"| {p} | " + " | ".join(f"{relative[p][n]:.1e}" for n in names) + " |")
    for p in PRECISIONS:
        verdict = "every case passes" if all(r["passed"] for _, res in rows[p] for r in res) else "FAILURES"
        print(f"\n## {p}: benchmark rule ({verdict})\n")
        print("Cell: max|x − y| / atol (share of elements within atol + rtol·|y|, 99% needed).\n")
        print("| case | atol | " + " | ".join(SHORT[n] for n in CrossAttentionGrads._fields) + " |")
        print("|---|---|" + "---|" * len(CrossAttentionGrads._fields))
        for case, result in rows[p]:
            cells = [f"{r['max_abs_err'] / r['atol']:.3f} ({100 * r['match_ratio']:.2f}%)"
                     + ("" if r["passed"] else " **FAIL**") for r in result]
            print(f"| {case.label} | {case.atol} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
