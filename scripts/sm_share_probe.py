"""Which of the backward's GEMMs gain from a cuBLAS SM count target (cublasSetSmCountTarget), one
product at a time: the sweep's time of one case (cold L2, median) with the plan as it is, then
with the target of a single recorded product (`backward.Backward._gemm`, in recording order; the
fp32 mode's three GEMMs of a product together) set to each share of the SMs. ``--fixed`` holds
some products' targets in every measurement (a candidate table; it is also timed against the plan
without it); ``--shares ''`` times only that. ``--rounds N`` builds a candidate table greedily:
after each round of single products, the best target that gained more than ``--min-gain`` µs joins
the fixed ones and the next round probes the rest on top of them (the single gains of one round
did not simply add up: perf-notes v45, v52); the table is printed as a ``--fixed`` argument.

Usage: PYTHONPATH=. python3 scripts/sm_share_probe.py 2x256x77 tf32 [--shares 0.33,0.5,0.67] [--reps 20]
                                                      [--fixed 0:66,3:44] [--rounds 3 --min-gain 2]
"""
import argparse

from cupy_xattn import backward, bench, cases, plans


def main():
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape")
    parser.add_argument("precision", choices=["tf32", "fp16", "fp32"])
    parser.add_argument("--shares", default="0.33,0.5,0.67", help="fractions of the SMs to try, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--fixed", default="", help="INDEX:SMS,... targets held in every measurement")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the greedy table (1: single products)")
    parser.add_argument("--min-gain", type=float, default=2.0, help="µs a target must gain to join the table")
    args = parser.parse_args()
    case = cases.parse_shape(args.shape, atol=0.0)
    shares = [float(s) for s in args.shares.split(",") if s]
    fixed = {int(i): int(n) for i, n in (item.split(":") for item in args.fixed.split(",") if item)}
    sm_count = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    recorded, override = [], {}  # the products' labels in recording order; {index: sm_target}
    gemm = backward.Backward._gemm

    def probed_gemm(self, a, b, c, **kw):
        index = len(recorded)
        recorded.append((f"{kw['m']}x{kw['n']}x{kw['k']} lane {kw.get('lane', 0)}", kw.get("sm_target", 0)))
        if index in override:
            kw["sm_target"] = override[index]
        gemm(self, a, b, c, **kw)

    def time_plan():
        recorded.clear()
        plans._cache.clear()  # a new plan: the products are recorded (and planned by cuBLAS) again
        result = bench.run_sweep([case], precisions=(args.precision,), reps=args.reps, warmup=5)
        return result["rows"][0]["median_us"]

    backward.Backward._gemm = probed_gemm
    if fixed:
        plain = time_plan()
    override.update(fixed)
    base = time_plan()
    products = list(recorded)
    print(f"{args.shape} {args.precision}: {base:.1f} us as planned{' with --fixed' if fixed else ''}; "
          f"{sm_count} SMs" + (f"; without --fixed {plain:.1f} us" if fixed else ""))
    if not shares:
        return
    for round_ in range(args.rounds):
        print(f"{'#':>3} {'product (m x n x k)':>24} {'target now':>10} " + " ".join(f"{s:>8.2f}" for s in shares))
        best = (-args.min_gain, None)  # (delta, (index, sms)): the largest gain beyond min_gain
        for index, (label, now) in enumerate(products):
            if index in fixed:
                continue
            deltas = []
            for share in shares:
                override.clear()
                override.update(fixed)
                override[index] = max(1, round(share * sm_count))
                deltas.append(time_plan() - base)
                if deltas[-1] < best[0]:
                    best = (deltas[-1], (index, override[index]))
            print(f"{index:>3} {label:>24} {now:>10} " + " ".join(f"{d:>+8.1f}" for d in deltas), flush=True)
        override.clear()
        override.update(fixed)
        print(f"as planned again: {time_plan() - base:+.1f} us (the drift between measurements)")
        if round_ + 1 == args.rounds or best[1] is None:
            break
        fixed[best[1][0]] = best[1][1]
        override.update(fixed)
        base = time_plan()
        print(f"round {round_ + 2}: --fixed {fixed_arg(fixed)}: {base:.1f} us", flush=True)
    if args.rounds > 1:
        print(f"table: --fixed {fixed_arg(fixed)}")


def fixed_arg(fixed):
    return ",".join(f"{index}:{sms}" for index, sms in sorted(fixed.items()))


if __name__ == "__main__":
    main()
