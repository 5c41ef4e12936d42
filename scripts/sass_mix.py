"""Instruction mix of a kernel's longest loop, from its SASS, without a GPU: where a warp's issue
slots go per trip (ncu on the device gives the times; this gives the instructions).

Usage:  PYTHONPATH=. python3 scripts/sass_mix.py attention_bwd.cu attn_bwd_resident \\
            -D ATTN_HALF=1 -D ATTN_KEYS=80 -D ATTN_RESIDENT_MIN_BLOCKS=2 [--arch sm_90]

Compiles as the library does (kernels.compile_cubin: NVRTC with CuPy's flags), or with --nvcc
as ``nvcc -cubin -ftz=true`` (CuPy's -ftz; for a machine whose NVRTC is older than its nvdisasm:
the CPU machine's CUDA 12 NVRTC and the CUDA 13 wheel), and disassembles with nvdisasm: the
CUDA toolkit's, or the one in the ``nvidia-cuda-nvdisasm`` wheel (the test extra), as
``kernels.find_nvdisasm`` finds it, or the one given with --nvdisasm or $NVDISASM. The counts are
static: every instruction of the loop body once, so both sides of a branch inside it count (a
rarely taken path inflates them).
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

_ADDRESS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+`?\(?\.?(L_x_\d+)")


def loop_mix(sass, kernel):
    """(instructions of ``kernel``, Counter of opcodes in its longest loop: the span between a
    label and the furthest backward branch to it) from nvdisasm -c output."""
    lines = sass.splitlines()
    starts = [n for n, line in enumerate(lines) if line.startswith("//") and f".text.{kernel} " in line + " "]
    if not starts:
        raise ValueError(f"no kernel {kernel!r} in the disassembly")
    end = next((n for n in range(starts[0] + 1, len(lines)) if lines[n].startswith("//---")), len(lines))
    instructions, labels, pending = [], {}, []
    for line in lines[starts[0]:end]:
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
        found = _ADDRESS.match(line)
        if found:
            address = int(found.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            instructions.append((address, found.group(2)))
    loops = [(labels[m.group(1)], address) for address, text in instructions
             for m in [_BRANCH.search(text)] if m and labels.get(m.group(1), address) < address]
    mix = collections.Counter()
    if loops:
        first, last = max(loops, key=lambda span: span[1] - span[0])
        for address, text in instructions:
            if first <= address <= last:
                words = text.split()
                opcode = words[1] if words[0].startswith("@") else words[0]
                mix[opcode.split(".")[0]] += 1
    return len(instructions), mix


def nvcc_sass(text, file, arch, defines, nvdisasm, folder):
    """The ``nvdisasm -c`` listing of ``text`` (the kernels_cu/ file ``file`` with its headers inlined:
    kernels.kernel_source) compiled by ``nvcc -cubin -ftz=true`` for ``arch`` with ``-D`` ``defines``
    ({name: value}), its files written to ``folder``. RuntimeError, with the tool's output, if one fails."""
    source, cubin = os.path.join(folder, file), os.path.join(folder, "kernel.cubin")
    with open(source, "w") as f:
        f.write(text)
    _tool(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-ftz=true", "-o", cubin, source]
          + [f"-D{k}={v}" for k, v in defines.items()])
    return _tool([nvdisasm, "-c", cubin])


def _tool(command):
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} …: exit {done.returncode}\n{done.stderr}")
    return done.stdout


def main():
    from cupy_xattn import kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a file of kernels_cu/, e.g. attention_bwd.cu")
    parser.add_argument("kernel")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--nvcc", action="store_true", help="compile with nvcc -ftz=true instead of NVRTC")
    parser.add_argument("--nvdisasm", default=kernels.find_nvdisasm(),
                        help="default: kernels.find_nvdisasm() ($NVDISASM, PATH, the toolkit, the wheel)")
    args = parser.parse_args()
    if not args.nvdisasm:
        parser.error("no nvdisasm: give --nvdisasm or $NVDISASM, or install the test extra "
                     "(see the docstring for the wheel)")
    defines = dict(d.split("=", 1) for d in args.defines)
    with tempfile.TemporaryDirectory() as folder:
        if args.nvcc:
            sass = nvcc_sass(kernels.kernel_source(args.source), args.source, args.arch, defines, args.nvdisasm,
                             folder)
        else:
            cubin = os.path.join(folder, "kernel.cubin")
            with open(cubin, "wb") as f:
                f.write(kernels.compile_cubin(args.source, args.arch, {k: int(v) for k, v in defines.items()}))
            sass = _tool([args.nvdisasm, "-c", cubin])
    total, mix = loop_mix(sass, args.kernel)
    print(f"{args.kernel} ({args.arch}, {defines}): {total} instructions; longest loop {sum(mix.values())}")
    for opcode, count in mix.most_common():
        print(f"  {opcode:10s} {count}")


if __name__ == "__main__":
    main()
