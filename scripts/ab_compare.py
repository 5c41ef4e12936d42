"""Per-case deltas of scripts/ab_trees.sh's runs: each tree against tree 1 (the base), per run (TAG).

Usage:  python3 scripts/ab_compare.py DIR     (DIR holds ab-<TAG><n>.json: tree n of the run TAG)

One line per case and precision with, for each run and each tree after the first, "base → tree
(Δ)" in µs (cupy_xattn's medians), then the suite means of each run, precision and tree. Runs of
one call repeated under several TAGs (p1, p2, ...) show whether a delta holds across pairs.
"""
import collections
import json
import pathlib
import re
import sys

_NAME = re.compile(r"ab-(.*)(\d)\.json$")


def load(folder):
    """{tag: {tree number: {(precision, B, Nv, Nt): median µs}}} of the ab-*.json in ``folder``."""
    runs = collections.defaultdict(dict)
    for path in sorted(pathlib.Path(folder).glob("ab-*.json")):
        tag, tree = _NAME.search(path.name).groups()
        rows = json.loads(path.read_text())["rows"]
        runs[tag][int(tree)] = {(r["precision"], r["batch_size"], r["num_video_tokens"], r["num_text_tokens"]):
                                r["median_us"] for r in rows if r["impl"] == "cupy_xattn"}
    return dict(runs)


def report(runs):
    """The comparison as text: a line per case, then the means over the cases every tree of a run timed."""
    columns = [(tag, tree) for tag in sorted(runs) for tree in sorted(runs[tag]) if tree != 1 and 1 in runs[tag]]
    cases = sorted({case for trees in runs.values() for times in trees.values() for case in times})
    lines = ["case".ljust(22) + "".join(f"{f'{tag}: 1 → {tree} (Δ)':>28s}" for tag, tree in columns)]
    sums = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for case in cases:
        cells = []
        for tag, tree in columns:
            base, new = runs[tag][1].get(case), runs[tag][tree].get(case)
            if base is None or new is None:
                cells.append(f"{'-':>28s}")
                continue
            total = sums[(tag, tree, case[0])]
            total[0], total[1], total[2] = total[0] + base, total[1] + new, total[2] + 1
            cells.append(f"{f'{base:.1f} → {new:.1f} ({new - base:+.1f})':>28s}")
        lines.append(f"{case[0]} {case[1]}x{case[2]}x{case[3]}".ljust(22) + "".join(cells))
    for (tag, tree, precision), (base, new, n) in sorted(sums.items()):
        lines.append(f"mean {precision} {tag} 1 → {tree}: {base / n:.1f} → {new / n:.1f} ({(new - base) / n:+.2f}) "
                     f"over {n} cases")
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    runs = load(sys.argv[1])
    if not runs:
        sys.exit(f"no ab-*.json in {sys.argv[1]}")
    sys.stdout.write(report(runs))


if __name__ == "__main__":
    main()
