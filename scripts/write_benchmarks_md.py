#!/usr/bin/env python3
"""Write BENCHMARKS.md from a sweep JSON (``cupy-xattn sweep --format json``).

Usage::

    python3 scripts/write_benchmarks_md.py benchmarks/h200-latest.json > BENCHMARKS.md
    python3 scripts/write_benchmarks_md.py benchmarks/h200-latest.json benchmarks/h200-wan22-latest.json \
        -o BENCHMARKS.md

Each further JSON (another suite, e.g. other layer sizes) is appended as its own part, with its
own device, date, commit and settings lines.

One table per precision of cupy_xattn: every case with its time (median, p20-p80),
TFLOP/s, fraction of the card's measured ceiling, host time per call, every baseline's
time and how many times faster cupy_xattn is than torch-tf32-graph; then suite means and
the ceilings. Needs only the standard library and the package (for the means).
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupy_xattn import bench  # noqa: E402  (after the path fix, so a checkout works without install)

BASELINE_ORDER = ("torch-tf32-graph", "torch-tf32-eager", "torch-fp32-graph",
                  "torch-fp32-eager", "naive-cupy")


def _num(value, digits=1):
    return "–" if value is None else f"{value:,.{digits}f}"


def _pct(value):
    return "–" if value is None else f"{100 * value:.1f} %"


def _times(value, digits=2):
    return "–" if value is None else f"{value:.{digits}f}×"


def _case_key(row):
    return (row["batch_size"], row["num_video_tokens"], row["num_text_tokens"])


def _case_label(key):
    return f"B={key[0]} Nv={key[1]} Nt={key[2]}"


def _table(header, rows, left=1):
    """A Markdown table; the first ``left`` columns (text) left-aligned, numbers right."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _ours_cell(row):
    if row is None:
        return "–"
    if row["status"] not in ("ok", "nan"):
        return "error"
    cell = f"{_num(row['median_us'])} ({_num(row['p20_us'])}–{_num(row['p80_us'])})"
    return cell + (" NaN!" if row["status"] == "nan" else "")


def _floor_bound(row):
    """Issue #5's bound on a case, 1.5 × its floor + 10 µs, where the floor is the time at the
    ceiling (GFLOP over the mode's measured GEMM rate: median × "of ceiling"); None without one, or
    where the row did not time ok (a NaN result is not within any bound)."""
    if row is None or row["status"] != "ok" or not row.get("fraction_of_ceiling"):
        return None
    return 1.5 * row["median_us"] * row["fraction_of_ceiling"] + 10.0


def _bound_cell(row):
    bound = _floor_bound(row)
    return "–" if bound is None else f"{_num(bound)} {'✓' if row['median_us'] <= bound else '✗'}"


def _baseline_cell(row):
    if row is None:
        return "–"
    if row["status"] not in ("ok", "nan"):
        return "error"
    return _num(row["median_us"]) + (" NaN!" if row["status"] == "nan" else "")


def _precision_section(precision, rows, case_order, baselines):
    ours = {_case_key(r): r for r in rows if r["impl"] == bench.IMPL and r["precision"] == precision}
    # torch rows carry their own precision (fp32/tf32); naive rows the sweep's precision
    others = {}
    for r in rows:
        if r["impl"] in baselines and (r["impl"].startswith("torch-") or r["precision"] == precision):
            others[(r["impl"], _case_key(r))] = r
    header = (["case", "GFLOP", "cupy_xattn µs (p20–p80)", "TFLOP/s", "of ceiling", "1.5 × floor + 10 µs", "host µs"]
              + [f"{b} µs" for b in baselines] + ["× vs torch-tf32-graph"])
    table = []
    for key in case_order:
        r = ours.get(key)
        gflop = r["gflop"] if r else next((o["gflop"] for (i, k), o in others.items() if k == key), None)
        table.append([_case_label(key), _num(gflop), _ours_cell(r),
                      _num(r and r.get("tflops")), _pct(r and r.get("fraction_of_ceiling")), _bound_cell(r),
                      _num(r and r.get("host_us"))]
                     + [_baseline_cell(others.get((b, key))) for b in baselines]
                     + [_times(r and r.get("speedup_vs_torch_tf32_graph"))])
    means = {(m["precision"], m["impl"]): m for m in bench.suite_means(rows)}
    mine = means.get((precision, bench.IMPL))

    def baseline_mean(b):
        for (p, impl), m in means.items():
            if impl == b and (b.startswith("torch-") or p == precision):
                return _num(m["mean_us"])
        return "–"

    if mine:
        bounded = [r for r in ours.values() if _floor_bound(r) is not None]
        within = sum(r["median_us"] <= _floor_bound(r) for r in bounded)
        table.append([f"**suite mean** ({mine['n_cases']} cases)", "", f"**{_num(mine['mean_us'])}**",
                      _num(mine["mean_tflops"]), _pct(mine["mean_fraction_of_ceiling"]),
                      f"{within} / {len(bounded)} within" if bounded else "–", _num(mine["mean_host_us"])]
                     + [baseline_mean(b) for b in baselines]
                     + [_times(mine["speedup_vs_torch_tf32_graph"])])
    errors = [r for r in ours.values() if r["status"] not in ("ok", "nan")]
    lines = [f"## precision = {precision}", ""] + _table(header, table)
    if errors:
        by_message = {}
        for r in errors:
            # temporary compile folders differ call by call: leave them out to group
            message = re.sub(r"/tmp/[^/\s]+/", ".../", r["status"]).replace("`", "'")
            by_message.setdefault(message, []).append(_case_label(_case_key(r)))
        lines += ["", "Errors:"]
        for message, labels in by_message.items():
            where = "every case" if len(labels) == len(case_order) else ", ".join(labels)
            lines.append(f"- {where}: `{message}`")
    return lines + [""]


def render(result, title="Benchmarks"):
    """The Markdown text of BENCHMARKS.md (or of a further part, under ``title``) for one sweep result."""
    meta, rows, ceilings = result["meta"], result["rows"], result.get("ceilings")
    bench._fill_derived(rows, ceilings)  # derived columns by today's definitions (fp32's ceiling changed)
    settings = meta.get("settings") or {}
    out = [f"# {title}", "",
           "Generated by `scripts/write_benchmarks_md.py` from the sweep JSON; do not edit by hand.", "",
           f"- device: **{meta.get('device')}** (driver {meta.get('driver_version')}, "
           f"CUDA runtime {meta.get('cuda_runtime_version')})",
           f"- date (UTC): {meta.get('date_utc')}, host `{meta.get('hostname')}`, "
           f"commit `{meta.get('git_commit')}`",
           f"- versions: cupy {meta.get('cupy_version')}, numpy {meta.get('numpy_version')}, "
           f"torch {meta.get('torch_version') or 'not used'}, python {meta.get('python_version')}",
           f"- settings: backend {settings.get('backend')}, D={settings.get('hidden_size')}, "
           f"H={settings.get('num_heads')}, {settings.get('warmup')} warm-ups, "
           f"{settings.get('reps')} timed repetitions, median (p20–p80) of CUDA-event times; "
           f"L2 flushed before each ({settings.get('flush_bytes')} bytes zeroed); "
           f"{settings.get('input_sets')} input/output sets rotated; "
           + (f"a lead kernel spins {settings['lead_cycles']:,} GPU cycles (~0.3 ms) before the flush, "
              "so the host has issued the call before the timed span starts: the span is the GPU work "
              "and the gaps between kernels (the harness's first-kernel-start to last-kernel-end); "
              "eager rows whose host time exceeds the lead still show their later gaps"
              if settings.get("lead_cycles") else
              "GPU idle at the start of each call, so launch gaps and the host time before the "
              "first launch count")
           + ". host µs = perf_counter around the Python call.",
           "- TFLOP/s = (10·Mv·D² + 12·Mt·D² + 12·Mv·Nt·D) / time (the benchmark's WORKLOAD.md; `cases.flops`); "
           "\"of ceiling\" = TFLOP/s / this card's measured GEMM rate at that precision (cupy_xattn's "
           "fp32: a third of the fp16 rate, since that mode runs each product as three fp16 GEMMs); "
           "1.5 × floor + 10 µs = issue #5's bound on each case, the floor being its time at the ceiling "
           "(median × \"of ceiling\"), ✓ where the median is within it; "
           "× vs torch-tf32-graph = torch-tf32-graph time / cupy_xattn time (> 1: we are faster).",
           "- torch rows: PyTorch autograd of the same layer, forward recompute + backward, "
           "strict fp32 or TF32 matmuls, eager or replayed from a CUDA graph.", ""]
    for note in meta.get("notes") or []:
        out.append(f"> note: {note}")
    if meta.get("notes"):
        out.append("")

    case_order = list(dict.fromkeys(_case_key(r) for r in rows))
    present = {r["impl"] for r in rows}
    baselines = [b for b in BASELINE_ORDER if b in present]
    precisions = list(dict.fromkeys(r["precision"] for r in rows if r["impl"] == bench.IMPL))
    for precision in precisions:
        out += _precision_section(precision, rows, case_order, baselines)

    means = bench.suite_means(rows)
    if means:
        out += ["## Suite means", ""]
        out += _table(["precision", "impl", "cases", "mean µs", "mean host µs", "mean TFLOP/s",
                       "mean of ceiling", "× vs torch-tf32-graph"],
                      [[m["precision"], m["impl"], str(m["n_cases"]), _num(m["mean_us"]),
                        _num(m["mean_host_us"]), _num(m["mean_tflops"]),
                        _pct(m["mean_fraction_of_ceiling"]), _times(m["speedup_vs_torch_tf32_graph"])]
                       for m in means], left=2)
        out.append("")

    if ceilings:
        out += ["## Ceilings measured on this card", ""]
        table = []
        for key, what in (("fp32", "GEMM, fp32 data, CUBLAS_COMPUTE_32F"),
                          ("tf32", "GEMM, fp32 data, CUBLAS_COMPUTE_32F_FAST_TF32"),
                          ("fp16", "GEMM, fp16 operands, fp32 accumulation")):
            e = ceilings.get(key) or {}
            shape = f"{e['m']}×{e['n']}×{e['k']}" if e.get("m") else "–"
            value = f"{_num(e.get('tflops'))} TFLOP/s" if e.get("tflops") else f"error: {e.get('error')}"
            table.append([key, what, shape, value])
        c = ceilings.get("copy") or {}
        value = f"{_num(c.get('gbps'), 0)} GB/s" if c.get("gbps") else f"error: {c.get('error')}"
        size = f"{c['bytes'] / 2**30:.0f} GiB" if c.get("bytes") else "–"
        table.append(["copy", "device-to-device memcpy, bytes read + written", size, value])
        out += _table(["ceiling", "what", "size", "measured"], table, left=2)
        out.append("")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_paths", nargs="+", metavar="json_path",
                        help="sweep results (cupy-xattn sweep --format json); the first is the main part")
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = parser.parse_args(argv)
    parts = []
    for i, path in enumerate(args.json_paths):
        with open(path) as stream:
            result = json.load(stream)
        settings = result["meta"].get("settings") or {}
        title = f"Benchmarks, D={settings.get('hidden_size')}, H={settings.get('num_heads')} ({os.path.basename(path)})"
        parts.append(render(result) if i == 0 else render(result, title))
    text = "\n\n".join(parts)
    if args.output:
        with open(args.output, "w") as stream:
            stream.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
