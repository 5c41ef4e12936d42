"""Ablation trees of the resident attention kernel: how much of its time each part of a tile costs.

Each tree is this checkout's commit with one part of attn_bwd_resident taken out (the results are
wrong; only the kernel's time means anything):
  loads   every tile load reads the head's first rows (hits in L2/L1): the global-load latency
  exp     the softmax without exp2f
  stores  the dQ and O stores behind a condition that never holds (their products stay)

Usage:  python3 scripts/attention_ablation.py make .scratch/ab        (here: base and one tree each)
        python3 scripts/attention_ablation.py run .scratch/ab          (on the GPU: per-kernel traces)
The trees must travel to the device with the checkout (the device tool's carry).
"""
import argparse
import os
import pathlib
import subprocess
import sys

# (file, text, replacement): each text occurs once in the kernel sources (tests/test_kernels.py).
ABLATIONS = {
    "loads": ("kernels_cu/attention_common.cuh", "src + (long long)(row0 + row(j)) * ld_src + col()",
              "src + (long long)row(j) * ld_src + col()"),
    "exp": ("kernels_cu/attention_bwd.cu", "p[n][i] = exp2f(p[n][i] - base);", "p[n][i] = p[n][i] - base;"),
    "stores": ("kernels_cu/attention_bwd.cu", "store_rows<NT_HD>(hs.dq + col0,",
               "if (n_video < 0) store_rows<NT_HD>(hs.dq + col0,"),
}
# The stores tree also guards the O store.
O_STORE = ("            store_o<NT_HD>(hs.o", "            if (n_video < 0) store_o<NT_HD>(hs.o")
SHAPES = (("64x128x77", "fp16"), ("8x512x77", "fp16"), ("64x128x77", "tf32"))


def make(folder):
    for name in ("base", *ABLATIONS):
        tree = folder / name
        subprocess.run(f"rm -rf {tree} && mkdir -p {tree} && git archive HEAD | tar -x -C {tree}", shell=True,
                       check=True)
        edits = [ABLATIONS[name]] if name in ABLATIONS else []
        if name == "stores":
            edits.append(("kernels_cu/attention_bwd.cu", *O_STORE))
        for file, text, replacement in edits:
            path = tree / file
            source = path.read_text()
            if source.count(text) != 1:
                raise SystemExit(f"{name}: {text!r} is not once in {file}")
            path.write_text(source.replace(text, replacement))
    print(f"trees in {folder}: base, {', '.join(ABLATIONS)}")


def run(folder):
    for name in ("base", *ABLATIONS):
        for shape, precision in SHAPES:
            print(f"== {name} {shape} {precision}", flush=True)
            result = subprocess.run([sys.executable, "scripts/graph_kernels.py", shape, precision, "--trace",
                                     "--kernels", "--reps", "10"], cwd=folder / name,
                                    env=dict(os.environ, PYTHONPATH="."), capture_output=True, text=True)
            print("\n".join(line for line in result.stdout.splitlines() if "replays" in line or "attn" in line))
            if result.returncode:
                print(result.stderr[-2000:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("make", "run"))
    parser.add_argument("folder", type=pathlib.Path)
    args = parser.parse_args()
    (make if args.action == "make" else run)(args.folder)


if __name__ == "__main__":
    main()
