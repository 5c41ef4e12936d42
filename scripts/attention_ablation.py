"""Ablation trees of the resident attention kernels: how much of their time each part of a tile costs.

Each tree is this checkout's commit with one part of attn_bwd_resident, or (the lean_ trees) of
attn_bwd_lean, taken out (the results are wrong; only the kernel's time means anything):
  loads   every tile load reads the head's first rows (hits in L2/L1): the global-load latency
  exp     the resident (and lean) kernel's softmax without exp2f (exp_row)
  stores  the dQ and O stores behind a condition that never holds (their products stay)
  dq      the dQ stores alone behind that condition
  stores_l2  the dQ and O (or O^T) stores kept, to 16 rows per sample and head that stay in L2
          (their instructions without their DRAM writes)
  o_late  the wgmma path's O stores moved to the tile's end, after dQ's (dQ's values: the same
          bytes and pattern, wrong values): whether the O stores cost by where they stand (the
          mma.sync path's O stores are only removed)
  scales  the products not divided by their operands' scales (unscale a no-op)
  dkdv    dV^T += dO^T P and dK^T += Q^T dS taken out, with their rescaling (dK, dV come out 0):
          the accumulators held across the tiles (80 registers a thread) no longer live in the loop
  dkdv3   dkdv at three blocks an SM (ATTN_RESIDENT_MIN_BLOCKS and the launcher's blocks per SM):
          what occupancy would buy the rest of the tile's chain (nvcc 13, fp16 64x128x77's wgmma
          build: 253 registers; dkdv 186 at two blocks, 167 at three, no spills either way). Only
          grids of whole (batch, head) pairs isolate it (64x128x77): the blocks per SM also set
          the query chunks where the pairs fill less than a wave (8x512x77: 3 chunks of 3 tiles)
  lean_ds_max attn_bwd_lean's dS at a constant scale: no block maximum of |dP|, no barrier for it
  lean_stores attn_bwd_lean's dQ and O stores behind a condition that never holds
  lean_o      attn_bwd_lean's O stores and bv's add taken out
The resident trees are timed on the tf32 cases that still run attn_bwd_resident (blocks of one or
two query tiles: lean_tf32), the lean trees on the fp16 mode's and tf32 64x128x77.
Where the tf32 schedule has the kernel write dQ^T and its column sums too (ATTN_DQ_TRANSPOSED), the
dq-store trees take those with dQ, and stores_l2 redirects dQ^T as it does O^T (one helper).

Usage:  python3 scripts/attention_ablation.py make .scratch/ab [TREE ...]  (here: base and the trees, or all)
        python3 scripts/attention_ablation.py run .scratch/ab [TREE ...]   (on the GPU: per-kernel traces
                                                                          of base and the trees, or all)
(Session 15 also tried the scale and dS barriers taken out: not a timing-only change, it faulted.)
The trees must travel to the device with the checkout (the device tool's carry).
"""
import argparse
import os
import pathlib
import subprocess
import sys

BWD, COMMON, LAUNCHER = "kernels_cu/attention_bwd.cu", "kernels_cu/attention_common.cuh", "cupy_xattn/attention_bwd.py"
DKDV = [(BWD, "        if (do_run.ratio != 1.f) scale_all<PER_WARP>(dv_acc, do_run.ratio);  // block-uniform\n", ""),
        (BWD, "        if (dk_ratio != 1.f) scale_all<PER_WARP>(dk_acc, dk_ratio);\n", ""),
        (BWD, "            wg_issue<NK, 1, 1>(dv_acc, do_s, ATTN_HEAD_DIM, p_s, LD_P, ATTN_BLOCK_Q / 16, true);\n"
              "            wg_issue<NK, 1, 1>(dk_acc, q_s, ATTN_HEAD_DIM, ds_s, LD_P, ATTN_BLOCK_Q / 16, true);\n", ""),
        (BWD, "            pin_accumulators<NK>(dv_acc);\n            pin_accumulators<NK>(dk_acc);\n", ""),
        (BWD, "[&] { add_transposed(dv_acc, p_s, do_s); });  // dV += P^T dO", "[] {});"),
        (BWD, "        add_transposed(dk_acc, ds_s, q_s);  // dK += dS^T Q\n", "")]


def _never(text, file=BWD):
    """The edit that puts the statement beginning with ``text`` (after its indent) behind a condition
    that never holds: it stays compiled, its work goes."""
    indent = len(text) - len(text.lstrip())
    return file, text, text[:indent] + "if (n_video < 0) " + text[indent:]


RESIDENT_DQ_STORES = [_never("store_dq<NT_HD>(hs.dq + col0,"), _never("            store_dq<NT_HD>(hs.dq, hs.dq_t,")]
RESIDENT_O_STORE = _never("            store_o<NT_HD>(hs.o")
LEAN_O_STORE = _never("\n        store_o<NT_HD>(hs.o,")
# name: [(file, text, replacement)]; each text occurs once in the kernel sources (tests/test_scripts.py).
# The resident kernel has a wgmma path (sm_90: the one timed on the H200) and an mma.sync path: an edit
# of one path's line needs its twin in the other (Session 15's first dq tree missed the wgmma one).
ABLATIONS = {
    "loads": [(COMMON, "src + (long long)(row0 + row(j)) * ld_src + col()",
               "src + (long long)row(j) * ld_src + col()")],
    "exp": [(COMMON, "sum += (p[n][i] = exp2f(p[n][i] - base));", "sum += (p[n][i] = p[n][i] - base);")],
    "stores": RESIDENT_DQ_STORES + [RESIDENT_O_STORE],
    "dq": RESIDENT_DQ_STORES,
    "stores_l2": [(COMMON, "<float2*>(dst + (long long)row * ld + col)",
                   "<float2*>(dst + (long long)(row & 15) * ld + col)"),
                  (BWD, "o_t* dst = o + (long long)row * ld + n * 8", "o_t* dst = o + (long long)(row & 15) * ld + n * 8"),
                  (COMMON, "dst[(long long)col * ld + row] = x0;", "dst[(long long)col * ld + (row & 15)] = x0;"),
                  (COMMON, "dst[(long long)(col + 1) * ld + row] = x1;",
                   "dst[(long long)(col + 1) * ld + (row & 15)] = x1;")],
    "o_late": [RESIDENT_O_STORE,
               (BWD, "            store_dq<NT_HD>(hs.dq, hs.dq_t, hs.dq_sums, ld_o, hidden, q_row0 + r0, n_video, dq_acc, g, t);",
                "            store_dq<NT_HD>(hs.dq, hs.dq_t, hs.dq_sums, ld_o, hidden, q_row0 + r0, n_video, dq_acc, g, t);\n"
                "            store_o<NT_HD>(hs.o + (ATTN_O_TRANSPOSED ? (long long)col0 * ld_o : col0), ld_o, "
                "q_row0 + r0, n_video, dq_acc, g, t, o_half_scale(hidden, inv_t, inv_w, inv_bv), o_lo_offset);")],
    "scales": [(COMMON, "    scale_all<NT>(c, pow2(-e1));\n    scale_all<NT>(c, pow2(e1 - e));\n", "")],
    "dkdv": DKDV,
    "dkdv3": DKDV + [(LAUNCHER, "smem, 2 if rows == 64 and key_split == 1 else 1",
                      "smem, 3 if rows == 64 and key_split == 1 else 1")],
    "lean_ds_max": [(BWD, "        publish_max(red[0], max_finite_abs<NT_K>(0.f, dp));  // read after the barrier below\n", ""),
                    (BWD, "        __syncthreads();  // red[0]: the tile's largest |dP|\n", ""),
                    (BWD, "ds_run.update(ds_observed_scale(red[0], scale));", "ds_run.update(1.f);")],
    "lean_stores": [LEAN_O_STORE, _never("\n        store_dq<NT_HD>(hs.dq,")],
    "lean_o": [(BWD, "        add_to_columns<NT_HD>(o_acc, bv_s, t);  // O = P V0 + bv\n", ""), LEAN_O_STORE],
}
SHAPES = {"resident": (("4x512x77", "tf32"), ("2x1024x77", "tf32")),  # O^T in fp32
          "lean": (("64x128x77", "fp16"), ("2x4096x77", "fp16"), ("64x128x77", "tf32"))}


def shapes(name):
    """The (shape, precision) pairs tree ``name``'s kernel runs in."""
    return SHAPES["lean" if name.startswith("lean_") else "resident"]


def trees(names):
    """base and the named trees (all when none are named)."""
    unknown = set(names) - set(ABLATIONS) - {"base"}
    if unknown:
        raise SystemExit(f"no such trees: {sorted(unknown)}; there are base, {', '.join(ABLATIONS)}")
    return ["base", *(name for name in (names or ABLATIONS) if name != "base")]


def edit(name, text_of):
    """{file: its text in tree `name`}, from text_of(file) (the base's text) and the tree's edits."""
    edited = {}
    for file, text, replacement in ABLATIONS.get(name, []):
        source = edited.get(file, text_of(file))
        if source.count(text) != 1:
            raise SystemExit(f"{name}: {text!r} is not once in {file}")
        edited[file] = source.replace(text, replacement)
    return edited


def make(folder, names):
    made = trees(names)
    for name in made:
        tree = folder / name
        subprocess.run(f"rm -rf {tree} && mkdir -p {tree} && git archive HEAD | tar -x -C {tree}", shell=True,
                       check=True)
        for file, text in edit(name, lambda file: (tree / file).read_text()).items():
            (tree / file).write_text(text)
    print(f"trees in {folder}: {', '.join(made)}")


def run(folder, names):
    made = trees(names)
    for name in made:
        # base in the shapes of every tree named with it
        pairs = dict.fromkeys(pair for tree in made[1:] or ABLATIONS for pair in shapes(tree)) if name == "base" \
            else shapes(name)
        for shape, precision in pairs:
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
    parser.add_argument("trees", nargs="*", help="these trees beside base (all if none)")
    args = parser.parse_args()
    (make if args.action == "make" else run)(args.folder, args.trees)


if __name__ == "__main__":
    main()
