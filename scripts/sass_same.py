"""Whether a change leaves the compiled kernels as they were, without a GPU: the SASS of every build
in BUILDS from this checkout's kernels_cu/ against another revision's. A refactor whose SASS is the
same needs no new device timing (perf-notes, Session 32).

Usage:  PYTHONPATH=. python3 scripts/sass_same.py b42e9be [--nvdisasm PATH] [--jobs N]

Each build is compiled as ``nvcc -cubin -ftz=true`` (CuPy's -ftz) from the sources with their
headers inlined (kernels.kernel_source) and disassembled by nvdisasm (the CUDA toolkit's, or the
``nvidia-cuda-nvdisasm`` wheel's): sass_mix.nvcc_sass, as ``sass_mix.py --nvcc``. Prints one line a build:
"same", or how many lines of SASS differ (``diff`` of the two listings). Exit status 1 if any differ, 2 if a build or the revision fails.
"""
import argparse
import concurrent.futures
import difflib
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_mix  # noqa: E402  (nvcc_sass)

# Builds of the kinds the library plans (attention_bwd.AttentionBackward's defines: the resident ones
# at the benchmark's 77 text tokens, the streamed ones in both tile widths and with key parts) and
# the other kernel files: (name, file, arch, defines). Not every planned combination of knobs.
_R = dict(ATTN_BLOCK_Q=64, ATTN_BLOCK_KV=32, ATTN_HEAD_DIM=64, ATTN_SPLIT3=0, ATTN_HALF=1, ATTN_KEYS=80,
          ATTN_KEY_SPLIT=1, ATTN_RESIDENT_MIN_BLOCKS=2, ATTN_WGMMA=1)
_MMA = dict(_R, ATTN_WGMMA=0)
_SPLIT = dict(_MMA, ATTN_KEY_SPLIT=2, ATTN_KEYS=96, ATTN_RESIDENT_MIN_BLOCKS=1)  # one block an SM: keys split
_STREAMED = dict(_MMA, ATTN_KEYS=0)
BUILDS = [
    ("lean fp16", "attention_bwd.cu", "sm_90a", dict(_R, ATTN_LEAN=1, ATTN_O_HALF=1, ATTN_KV_HALF=1, ATTN_QDO_HALF=1)),
    ("lean tf32", "attention_bwd.cu", "sm_90a", dict(_R, ATTN_LEAN=1, ATTN_O_TRANSPOSED=1, ATTN_DQ_TRANSPOSED=1)),
    ("lean tf32 O^T", "attention_bwd.cu", "sm_90a", dict(_R, ATTN_LEAN=1, ATTN_O_TRANSPOSED=1)),
    ("resident wgmma fp16 O", "attention_bwd.cu", "sm_90a", dict(_R, ATTN_O_HALF=1)),
    ("resident wgmma fp16 K|V", "attention_bwd.cu", "sm_90a", dict(_R, ATTN_O_HALF=1, ATTN_KV_HALF=1)),
    ("resident wgmma O^T", "attention_bwd.cu", "sm_90a", dict(_R, ATTN_O_TRANSPOSED=1)),
    ("resident wgmma dQ^T", "attention_bwd.cu", "sm_90a", dict(_R, ATTN_O_TRANSPOSED=1, ATTN_DQ_TRANSPOSED=1)),
    ("resident mma fp16 O", "attention_bwd.cu", "sm_90", dict(_MMA, ATTN_O_HALF=1)),
    ("resident mma fp16 K|V", "attention_bwd.cu", "sm_90", dict(_MMA, ATTN_O_HALF=1, ATTN_KV_HALF=1)),
    ("resident mma key split", "attention_bwd.cu", "sm_90", dict(_SPLIT, ATTN_O_HALF=1)),
    ("resident mma key split K|V", "attention_bwd.cu", "sm_90", dict(_SPLIT, ATTN_O_HALF=1, ATTN_KV_HALF=1)),
    ("resident mma key split O^T", "attention_bwd.cu", "sm_90", dict(_SPLIT, ATTN_O_TRANSPOSED=1)),
    ("resident mma O^T", "attention_bwd.cu", "sm_90", dict(_MMA, ATTN_O_TRANSPOSED=1)),
    ("resident fp32", "attention_bwd.cu", "sm_90", dict(_MMA, ATTN_HALF=0, ATTN_SPLIT3=1, ATTN_O_HALF=1)),
    ("resident sm_80", "attention_bwd.cu", "sm_80", dict(_MMA, ATTN_O_HALF=1, ATTN_KV_HALF=1)),
    ("streamed fp16", "attention_bwd.cu", "sm_90", dict(_STREAMED, ATTN_O_HALF=1)),
    ("streamed fp16 K|V", "attention_bwd.cu", "sm_90", dict(_STREAMED, ATTN_O_HALF=1, ATTN_KV_HALF=1)),
    ("streamed fp16 64-key tiles", "attention_bwd.cu", "sm_90",
     dict(_STREAMED, ATTN_BLOCK_KV=64, ATTN_O_HALF=1, ATTN_KV_HALF=1)),
    ("streamed fp16 key parts", "attention_bwd.cu", "sm_90", dict(_STREAMED, ATTN_O_HALF=1, ATTN_KV_HALF=1, ATTN_KV_PARTS=2)),
    ("streamed tf32 64-key tiles", "attention_bwd.cu", "sm_90",
     dict(_STREAMED, ATTN_BLOCK_KV=64, ATTN_O_TRANSPOSED=1, ATTN_KV_HALF=1)),
    ("streamed tf32 key parts", "attention_bwd.cu", "sm_90",
     dict(_STREAMED, ATTN_O_TRANSPOSED=1, ATTN_KV_HALF=1, ATTN_KV_PARTS=2)),
    ("streamed fp32", "attention_bwd.cu", "sm_90", dict(_STREAMED, ATTN_HALF=0, ATTN_SPLIT3=1)),
    ("streamed fp16 head_dim 128", "attention_bwd.cu", "sm_90", dict(_STREAMED, ATTN_HEAD_DIM=128, ATTN_O_HALF=1)),
    ("streamed fp32 head_dim 128", "attention_bwd.cu", "sm_90", dict(_STREAMED, ATTN_HALF=0, ATTN_SPLIT3=1, ATTN_HEAD_DIM=128)),
    ("forward", "attention_fwd.cu", "sm_90", {}),
    ("half scaling", "half_scaling.cu", "sm_90", {}),
    ("transpose", "transpose.cu", "sm_90", {}),
]


def differing_lines(a, b):
    """How many lines of SASS listing ``a`` differ from ``b`` (each side's lines that diff marks)."""
    return sum(1 for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def _sources(source_dir, files):
    """{file: its text with headers inlined} from the kernels_cu/ folder ``source_dir``."""
    from cupy_xattn import kernels
    saved = kernels.SOURCE_DIRS
    kernels.SOURCE_DIRS = (source_dir,)
    try:
        return {file: kernels.kernel_source(file) for file in files}
    finally:
        kernels.SOURCE_DIRS = saved


def _sass(text, file, arch, defines, nvdisasm, folder):
    """sass_mix.nvcc_sass in a folder of its own; a failing tool's output printed, exit status 2."""
    os.makedirs(folder)
    try:
        return sass_mix.nvcc_sass(text, file, arch, defines, nvdisasm, folder)
    except RuntimeError as failed:
        print(failed, file=sys.stderr)
        sys.exit(2)


def _run(command, stdin=None, text=True):
    """stdout of ``command`` (bytes unless text); where it fails, its stderr and exit status 2."""
    done = subprocess.run(command, input=stdin, capture_output=True)
    if done.returncode:
        print(f"{' '.join(command[:3])} …: exit {done.returncode}", done.stderr.decode(errors="replace"),
              file=sys.stderr)
        sys.exit(2)
    return done.stdout.decode() if text else done.stdout


def main():
    from pathlib import Path

    from cupy_xattn import kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare this checkout's kernels_cu/ with")
    parser.add_argument("--nvdisasm", default=kernels.find_nvdisasm(),
                        help="default: kernels.find_nvdisasm() ($NVDISASM, PATH, the toolkit, the wheel)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if not args.nvdisasm:
        parser.error("no nvdisasm: give --nvdisasm or $NVDISASM, or install the test extra "
                     "(see sass_mix.py for the wheel)")
    here = kernels.source_dir()
    files = sorted({file for _, file, _, _ in BUILDS})
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp, "base")
        base.mkdir()
        root, prefix = (_run(["git", "-C", str(here), "rev-parse", option]).strip()
                        for option in ("--show-toplevel", "--show-prefix"))
        archive = _run(["git", "-C", root, "archive", f"{args.revision}:{prefix}"], text=False)
        _run(["tar", "-x", "-C", str(base)], stdin=archive, text=False)
        trees = {"old": _sources(base, files), "new": _sources(here, files)}

        def compare(i):
            name, file, arch, defines = BUILDS[i]
            old, new = (_sass(trees[tree][file], file, arch, defines, args.nvdisasm, os.path.join(tmp, f"{tree}{i}"))
                        for tree in ("old", "new"))
            return name, differing_lines(old, new)

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(compare, range(len(BUILDS))))
    for name, lines in results:
        print(f"{name:30s} {'same' if lines == 0 else f'{lines} lines differ'}")
    sys.exit(1 if any(lines for _, lines in results) else 0)


if __name__ == "__main__":
    main()
