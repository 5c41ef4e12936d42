"""Kernel sources: found, headers inlined, and every kernels_cu/*.cu compiles for Ampere and Hopper without a GPU."""
import os
import re
import shutil
import types
from pathlib import Path

import numpy
import pytest

import builds
from cupy_xattn import kernels

# Collected from the folder: an empty kernels_cu/ is a collection error, not a silent pass.
KERNEL_FILES = [path.name for path in kernels.kernel_files()]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("filename", KERNEL_FILES)
def test_every_kernel_compiles(filename, arch):
    cubin = kernels.compile_cubin(filename, arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) == kernels.elf_size(cubin)  # whole (kernels.whole_elf)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("defines", [{"ATTN_SPLIT3": 1}, {"ATTN_KEYS": 16}, {"ATTN_KEYS": 80},
                                     {"ATTN_SPLIT3": 1, "ATTN_KEYS": 80},
                                     {"ATTN_KEYS": 80, "ATTN_BLOCK_Q": 128, "ATTN_RESIDENT_MIN_BLOCKS": 1},
                                     {"ATTN_HEAD_DIM": 128}, {"ATTN_HEAD_DIM": 128, "ATTN_SPLIT3": 1},
                                     {"ATTN_O_TRANSPOSED": 1}, {"ATTN_O_TRANSPOSED": 1, "ATTN_KEYS": 80},
                                     {"ATTN_BLOCK_KV": 64}, {"ATTN_HALF": 1}, {"ATTN_HALF": 1, "ATTN_KEYS": 80},
                                     {"ATTN_HALF": 1, "ATTN_BLOCK_KV": 64}, {"ATTN_HALF": 1, "ATTN_HEAD_DIM": 128},
                                     {"ATTN_HALF": 1, "ATTN_KEYS": 80, "ATTN_BLOCK_Q": 128, "ATTN_RESIDENT_MIN_BLOCKS": 1},
                                     {"ATTN_HALF": 1, "ATTN_O_TRANSPOSED": 1, "ATTN_KEYS": 80},
                                     {"ATTN_HALF": 1, "ATTN_KEYS": 96, "ATTN_KEY_SPLIT": 2,
                                      "ATTN_RESIDENT_MIN_BLOCKS": 1},
                                     {"ATTN_HALF": 1, "ATTN_KEYS": 96, "ATTN_KEY_SPLIT": 2,
                                      "ATTN_RESIDENT_MIN_BLOCKS": 1, "ATTN_O_TRANSPOSED": 1},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_BLOCK_KV": 64},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KEYS": 80},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KEYS": 96, "ATTN_KEY_SPLIT": 2,
                                      "ATTN_RESIDENT_MIN_BLOCKS": 1},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1, "ATTN_BLOCK_KV": 64},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1, "ATTN_HEAD_DIM": 128},
                                     {"ATTN_HALF": 1, "ATTN_KV_HALF": 1}, {"ATTN_HALF": 1, "ATTN_KV_HALF": 1,
                                                                           "ATTN_O_TRANSPOSED": 1, "ATTN_BLOCK_KV": 64},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1, "ATTN_KEYS": 80},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1, "ATTN_KEYS": 80,
                                      "ATTN_BLOCK_Q": 128, "ATTN_RESIDENT_MIN_BLOCKS": 1},
                                     {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1, "ATTN_KEYS": 96,
                                      "ATTN_KEY_SPLIT": 2, "ATTN_RESIDENT_MIN_BLOCKS": 1},
                                     {"ATTN_SPLIT3": 1, "ATTN_O_HALF": 1}, {"ATTN_SPLIT3": 1, "ATTN_O_HALF": 1, "ATTN_KEYS": 80},
                                     {"ATTN_SPLIT3": 1, "ATTN_O_HALF": 1, "ATTN_HEAD_DIM": 128},
                                     {"ATTN_KV_PARTS": 2, "ATTN_SPLIT3": 1, "ATTN_O_HALF": 1},  # key parts, streamed
                                     {"ATTN_KV_PARTS": 3, "ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1},
                                     {"ATTN_KV_PARTS": 2, "ATTN_HALF": 1, "ATTN_KV_HALF": 1, "ATTN_O_TRANSPOSED": 1},
                                     {"ATTN_KV_PARTS": 8, "ATTN_HALF": 1, "ATTN_HEAD_DIM": 128},
                                     {"ATTN_KV_PARTS": 7, "ATTN_SPLIT3": 1, "ATTN_O_HALF": 1},
                                     # dQ^T beside dQ (the tf32 mode): resident, split keys, streamed
                                     {"ATTN_HALF": 1, "ATTN_O_TRANSPOSED": 1, "ATTN_DQ_TRANSPOSED": 1, "ATTN_KEYS": 80},
                                     {"ATTN_HALF": 1, "ATTN_KEYS": 96, "ATTN_KEY_SPLIT": 2, "ATTN_RESIDENT_MIN_BLOCKS": 1,
                                      "ATTN_O_TRANSPOSED": 1, "ATTN_DQ_TRANSPOSED": 1},
                                     {"ATTN_HALF": 1, "ATTN_KV_HALF": 1, "ATTN_O_TRANSPOSED": 1, "ATTN_DQ_TRANSPOSED": 1,
                                      "ATTN_BLOCK_KV": 64}])
def test_attention_kernel_variants_compile(defines, arch):
    # The 3xTF32 split (ATTN_SPLIT3) and the resident kernel (ATTN_KEYS) are other programs.
    cubin = kernels.compile_cubin("attention_bwd.cu", arch, defines)
    assert cubin[:4] == b"\x7fELF"
    resident = "ATTN_KEYS" in defines  # one program per build: the resident kernel or the streamed one
    assert (b"attn_bwd_resident" in cubin) == resident and (b"\x00attn_bwd\x00" in cubin) != resident


@pytest.mark.parametrize("defines", [{"ATTN_KEYS": 80, "ATTN_KV_PARTS": 2}, {"ATTN_KV_PARTS": 0}])
def test_key_parts_are_the_streamed_kernels_alone(defines):
    with pytest.raises(kernels.CompileError, match="key parts"):
        kernels.compile_cubin("attention_bwd.cu", "sm_90", defines)


@pytest.mark.parametrize("defines", [{"ATTN_HALF": 1, "ATTN_DQ_TRANSPOSED": 1},
                                     {"ATTN_HALF": 1, "ATTN_O_TRANSPOSED": 1, "ATTN_DQ_TRANSPOSED": 1, "ATTN_KV_PARTS": 2}])
def test_dq_transposed_goes_beside_o_transposed_with_one_key_part(defines):
    with pytest.raises(kernels.CompileError, match="dQ\\^T"):
        kernels.compile_cubin("attention_bwd.cu", "sm_90", defines)


@pytest.mark.parametrize("defines", [{"ATTN_KEYS": 80}, {"ATTN_KEYS": 16}, {"ATTN_KEYS": 48, "ATTN_O_TRANSPOSED": 1},
                                     {"ATTN_KEYS": 80, "ATTN_O_TRANSPOSED": 1, "ATTN_DQ_TRANSPOSED": 1},
                                     {"ATTN_KEYS": 80, "ATTN_O_HALF": 1}, {"ATTN_KEYS": 80, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1}])
def test_wgmma_attention_compiles_for_sm_90a(defines):
    # ATTN_WGMMA: the resident kernel's products as warpgroup MMAs, which only sm_90a has.
    defines = dict(defines, ATTN_HALF=1, ATTN_WGMMA=1, ATTN_RESIDENT_MIN_BLOCKS=2)
    assert b"attn_bwd_resident" in kernels.compile_cubin("attention_bwd.cu", "sm_90a", defines)
    with pytest.raises(kernels.CompileError):
        kernels.compile_cubin("attention_bwd.cu", "sm_90", defines)


def test_the_lean_attention_compiles_for_sm_90a_in_the_fp16_modes_build_only():
    # attn_bwd_lean (ATTN_LEAN) in place of attn_bwd_resident: wgmma; with ATTN_QDO_HALF fp16 K0|V0 and O;
    # without, the tf32 mode's builds (O^T, dQ^T).
    for defines in (builds.LEAN_FP16, builds.LEAN_TF32):
        cubin = kernels.compile_cubin("attention_bwd.cu", "sm_90a", defines)
        assert b"attn_bwd_lean" in cubin and b"attn_bwd_resident" not in cubin
    for missing in ("ATTN_KV_HALF", "ATTN_O_HALF", "ATTN_LEAN", "ATTN_WGMMA"):
        with pytest.raises(kernels.CompileError, match="attn_bwd_lean"):
            kernels.compile_cubin("attention_bwd.cu", "sm_90a", dict(builds.LEAN_FP16, **{missing: 0}))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_transpose_of_floats_compiles(arch):  # TR_VEC = 1: shapes whose rows are not float4s
    cubin = kernels.compile_cubin("transpose.cu", arch, {"TR_VEC": 1})
    assert cubin[:4] == b"\x7fELF" and b"transposed_copies" in cubin


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("defines", [{"ATTN_SPLIT3": 1}, {"ATTN_HEAD_DIM": 128},
                                     {"ATTN_HEAD_DIM": 128, "ATTN_SPLIT3": 1}])
def test_attention_forward_variants_compile(defines, arch):
    cubin = kernels.compile_cubin("attention_fwd.cu", arch, defines)
    assert cubin[:4] == b"\x7fELF" and b"attn_fwd" in cubin


@pytest.fixture
def probe_dir(tmp_path, monkeypatch):
    (tmp_path / "probe.cuh").write_text('#include "probe_inner.cuh"\n#define PROBE_SCALE 2.0f\n')
    (tmp_path / "probe_inner.cuh").write_text("#define PROBE_INNER 1\n")
    (tmp_path / "probe.cu").write_text(
        '// a probe kernel\n'
        '#include "probe.cuh"\n'
        '#include "probe_inner.cuh"\n'
        '#include <cuda_fp16.h>\n'
        '#ifndef PROBE_OFFSET\n#define PROBE_OFFSET 0.0f\n#endif\n'
        'extern "C" __global__ void probe_scale_f32(const float* x, float* y, int n) {\n'
        '  int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
        '  if (i < n) y[i] = PROBE_SCALE * x[i] + PROBE_OFFSET + PROBE_INNER;\n'
        '}\n')
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken() {\n  undeclared_thing = 1;\n}\n')
    monkeypatch.setattr(kernels, "SOURCE_DIRS", (tmp_path / "missing", tmp_path))
    return tmp_path


def test_local_headers_are_inlined_once_with_line_markers(probe_dir):
    source = kernels.kernel_source("probe.cu")
    assert "#define PROBE_SCALE 2.0f" in source and source.count("#define PROBE_INNER 1") == 1
    assert '#include "probe' not in source and "#include <cuda_fp16.h>" in source
    assert '#line 1 "probe.cuh"' in source and '#line 3 "probe.cu"' in source
    assert "// probe_inner.cuh already inlined" in source


def test_a_header_edit_changes_the_source_text(probe_dir):
    before = kernels.kernel_source("probe.cu")
    (probe_dir / "probe.cuh").write_text('#include "probe_inner.cuh"\n#define PROBE_SCALE 3.0f\n')
    assert kernels.kernel_source("probe.cu") != before


def test_missing_source(probe_dir):
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        kernels.kernel_source("nope.cu")


def test_no_kernel_folder_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "SOURCE_DIRS", (tmp_path,))
    with pytest.raises(FileNotFoundError, match="no kernels_cu"):
        kernels.kernel_files()


@pytest.mark.parametrize("arch", ["sm_80", "90", 90])
def test_probe_compiles_with_defines(probe_dir, arch):
    assert kernels.compile_cubin("probe.cu", arch, {"PROBE_OFFSET": "1.5f"})[:4] == b"\x7fELF"
    ptx = kernels.compile_ptx("probe.cu", arch, {"PROBE_OFFSET": "1.5f"})
    assert b".entry probe_scale_f32" in ptx and b"0f3FC00000" in ptx  # 1.5f, as PTX spells it


def test_cubins_flush_denormals_as_cupys_modules_do(probe_dir, monkeypatch):
    # CuPy's RawModule compiles with -ftz=true, and the kernels' scaling is written for it
    # (attention_common.cuh, unscale): a cubin from here (the cache-less fallback) must match.
    nvrtc = kernels._nvrtc()
    if nvrtc is None:
        pytest.skip("no NVRTC")
    seen = []
    compile_program = nvrtc.compileProgram
    monkeypatch.setattr(nvrtc, "compileProgram", lambda program, options: seen.append(options) or
                        compile_program(program, options))
    kernels.compile_cubin("probe.cu", "sm_90")
    assert "-ftz=true" in seen[0]


def test_nvcc_cubins_flush_denormals_too(probe_dir, monkeypatch):
    # The fallback without NVRTC must compute what CuPy's modules (-ftz=true) do, as NVRTC's cubins do.
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"cubin")
        return types.SimpleNamespace(returncode=0, stderr="")
    monkeypatch.setattr(kernels, "_nvrtc", lambda: None)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: "/usr/bin/nvcc")
    monkeypatch.setattr(kernels.subprocess, "run", run)
    assert kernels.compile_cubin("probe.cu", "sm_90") == b"cubin"
    assert "-ftz=true" in commands[0]


def test_compile_error_carries_the_log(probe_dir):
    with pytest.raises(kernels.CompileError, match=r"(?s)broken.cu \(sm_90\).*broken.cu\(2\).*undeclared_thing"):
        kernels.compile_cubin("broken.cu", "sm_90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_nvcc_fallback(probe_dir, monkeypatch):
    monkeypatch.setattr(kernels, "_nvrtc", lambda: None)
    assert kernels.compile_cubin("probe.cu", "sm_80")[:4] == b"\x7fELF"
    assert b".entry probe_scale_f32" in kernels.compile_ptx("probe.cu", "sm_80")
    with pytest.raises(kernels.CompileError, match="undeclared_thing"):
        kernels.compile_cubin("broken.cu", "sm_80")


@pytest.mark.gpu
def test_get_kernel_runs_and_is_cached_per_defines(probe_dir):
    import cupy

    x = cupy.arange(100, dtype=cupy.float32)
    y = cupy.empty_like(x)
    for offset in ("0.0f", "1.5f"):
        kernel = kernels.get_kernel("probe.cu", "probe_scale_f32", {"PROBE_OFFSET": offset})
        kernel((1,), (128,), (x, y, numpy.int32(x.size)))
        cupy.testing.assert_allclose(y, 2 * x + float(offset[:-1]) + 1)
    compiled = len(kernels._modules)
    kernels.get_kernel("probe.cu", "probe_scale_f32", {"PROBE_OFFSET": "1.5f"})
    assert len(kernels._modules) == compiled


# -- CuPy's on-disk kernel cache (CUPY_CACHE_DIR) ------------------------------------------------

_RUN_PROBE = """
import sys
from pathlib import Path
import cupy, numpy
from cupy_xattn import kernels
kernels.SOURCE_DIRS = (Path(sys.argv[1]),)
x = cupy.arange(8, dtype=cupy.float32)
y = cupy.empty_like(x)
kernels.get_kernel("probe.cu", "probe_scale_f32")((1,), (32,), (x, y, numpy.int32(8)))
print(y.get().tolist())
"""


def _run_probe_process(probe_dir, cache):
    import subprocess
    import sys

    env = {**os.environ, "CUPY_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", _RUN_PROBE, str(probe_dir)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_unusable_cache_dir_at_import_is_a_clear_error(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("cupy")
    (tmp_path / "a_file").write_text("")
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path / "a_file" / "cache")}
    done = subprocess.run([sys.executable, "-c", "from cupy_xattn._cupy import import_cupy; import_cupy()"],
                          capture_output=True, text=True, env=env, timeout=300)
    import cupy
    if int(cupy.__version__.split(".")[0]) >= 14:  # CuPy 14 creates the folder when it is imported
        assert done.returncode and "point CUPY_CACHE_DIR at a folder that can be created and written" in done.stderr, (
            done.stderr)
    else:  # an older CuPy touches it only when it compiles
        assert done.returncode == 0, done.stderr


@pytest.mark.gpu
def test_a_corrupted_cache_entry_is_recompiled(probe_dir, tmp_path):
    cache = tmp_path / "cache"
    expected = str([2.0 * i + 1 for i in range(8)])
    assert _run_probe_process(probe_dir, cache) == expected
    entries = [path for path in cache.iterdir() if path.is_file()]
    assert entries, "the first run left nothing in the cache"
    for path in entries:
        path.write_bytes(b"not a cubin" * 10)
    assert _run_probe_process(probe_dir, cache) == expected


@pytest.mark.gpu
def test_a_source_edit_recompiles(probe_dir, tmp_path):
    cache = tmp_path / "cache"
    assert _run_probe_process(probe_dir, cache) == str([2.0 * i + 1 for i in range(8)])
    (probe_dir / "probe.cuh").write_text('#include "probe_inner.cuh"\n#define PROBE_SCALE 3.0f\n')
    assert _run_probe_process(probe_dir, cache) == str([3.0 * i + 1 for i in range(8)])


@pytest.mark.gpu
def test_an_unwritable_cache_compiles_without_it(probe_dir, tmp_path, monkeypatch):
    import cupy
    from cupy.cuda import compiler

    x = cupy.arange(100, dtype=cupy.float32)  # CuPy's own kernels need its cache: made before it breaks
    y = cupy.full_like(x, numpy.nan)
    (tmp_path / "a_file").write_text("")
    # Writes into the cache now fail even for root (a folder under a regular file).
    monkeypatch.setattr(compiler._kernel_cache_backend, "_cache_dir", str(tmp_path / "a_file" / "cache"))
    monkeypatch.setattr(kernels, "_modules", {})
    with pytest.warns(RuntimeWarning, match="kernel cache .* is not usable"):
        kernel = kernels.get_kernel("probe.cu", "probe_scale_f32", {"PROBE_OFFSET": "0.25f"})
    kernel.max_dynamic_shared_size_bytes  # a RawKernel, with its attributes  # noqa: B018
    kernel((1,), (128,), (x, y, numpy.int32(x.size)))
    cupy.testing.assert_allclose(y, 2 * x + 1.25)


def test_sm_90a_cubins_are_cached_on_disk_by_source_target_and_compiler(tmp_path, monkeypatch):
    # get_kernel(..., arch="sm_90a") compiles here (CuPy would build for the device's sm_90) and keeps
    # the cubin in CuPy's cache folder: the second process loads it instead of compiling again.
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    compiled, loaded = [], []
    monkeypatch.setattr(kernels, "compile_cubin", lambda f, arch, defines=None: compiled.append(arch) or b"cubin")
    fake_cupy = types.SimpleNamespace(RawModule=lambda path: loaded.append(path) or types.SimpleNamespace(module=1))
    monkeypatch.setattr(kernels, "import_cupy", lambda: fake_cupy)
    defines = {"ATTN_HALF": 1, "ATTN_WGMMA": 1, "ATTN_KEYS": 80}
    path = kernels.cubin_cache_path("attention_bwd.cu", "sm_90a", defines)
    assert path.parent == tmp_path / "cache"
    assert path != kernels.cubin_cache_path("attention_bwd.cu", "sm_90a", dict(defines, ATTN_KEYS=64))
    assert path != kernels.cubin_cache_path("attention_bwd.cu", "sm_100a", defines)
    for _ in range(2):
        kernels._module_from_cached_cubin("attention_bwd.cu", "sm_90a", defines)
    assert compiled == ["sm_90a"] and loaded == [str(path)] * 2 and path.read_bytes() == b"cubin"
    assert list(path.parent.iterdir()) == [path]  # no partial file left behind


def test_the_cubin_cache_key_holds_the_compilers_version(monkeypatch):
    # Another NVRTC may compile the same source differently: it must not load the last one's cubins.
    monkeypatch.setattr(kernels, "_nvrtc_options", lambda arch: (f"-arch={arch}", "-ftz=true"))

    def path(version):
        nvrtc = None if version is None else types.SimpleNamespace(getVersion=lambda: version)
        monkeypatch.setattr(kernels, "_nvrtc", lambda: nvrtc)
        return kernels.cubin_cache_path("transpose.cu", "sm_90a")
    assert len({path((12, 8)), path((12, 9)), path((13, 0)), path(None)}) == 4  # None: nvcc



def test_every_kernel_waits_for_its_inputs_first():
    """graphs.py makes the edges into every kernel of kernels_cu programmatic: each must begin with
    wait_for_inputs() (grid_dependency.cuh), or it could read its inputs before they are written."""
    definition = re.compile(kernels.KERNEL_HEAD + r"(\w+)\s*\([^)]*\)\s*\{\s*([^;]*);")
    first = {name: statement for path in kernels.kernel_files() for name, statement in definition.findall(path.read_text())}
    assert set(first) == kernels.kernel_names() >= {"attn_bwd", "attn_bwd_resident", "half_copy_absmax", "half_rescale"}
    assert {name: statement for name, statement in first.items() if statement != "wait_for_inputs()"} == {}


# Builds that together hold every kernel but sm_90a's: the streamed attention (fp32 operands; fp16 with
# an fp16 O, and with an fp16 K0|V0), the resident one (the same two), the forward, the conversions, the
# transposes.
_PTX_BUILDS = [("attention_bwd.cu", {}), ("attention_bwd.cu", {"ATTN_HALF": 1, "ATTN_O_HALF": 1}),
               ("attention_bwd.cu", {"ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1}),
               ("attention_bwd.cu", {"ATTN_KEYS": 80, "ATTN_HALF": 1, "ATTN_O_HALF": 1}),
               ("attention_bwd.cu", {"ATTN_KEYS": 80, "ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1}),
               ("attention_fwd.cu", {}), ("half_scaling.cu", {}), ("transpose.cu", {})]
# ... and the wgmma builds, sm_90a's only: the resident attention's, the lean one's.
_SM90A_BUILDS = [("attention_bwd.cu", {"ATTN_KEYS": 80, "ATTN_HALF": 1, "ATTN_O_HALF": 1, "ATTN_WGMMA": 1}),
                 ("attention_bwd.cu", builds.LEAN_FP16), ("attention_bwd.cu", builds.LEAN_TF32)]
_SM90A_KERNELS = {"attn_bwd_lean"}
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st|atom|red|cp\.async|prefetch)(?!\.param|\.shared|\.local|\.const)\S*",
                            re.MULTILINE)


@pytest.mark.parametrize("arch, waits", [("sm_90", True), ("sm_90a", True), ("sm_80", False)])
def test_every_kernel_compiled_for_sm90_waits_before_its_first_global_access(arch, waits):
    """What the compiler made of wait_for_inputs(): on sm_90 a griddepcontrol.wait before any load
    or store other than of the kernel's parameters, in every entry point (graphs.py makes the edges
    into them programmatic); below sm_90 none (graphs.py leaves those kernels' edges alone)."""
    seen = {}
    for filename, defines in _PTX_BUILDS + (_SM90A_BUILDS if arch == "sm_90a" else []):
        ptx = kernels.compile_ptx(filename, arch, defines).decode()
        for entry in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
            body = ptx[entry.end():ptx.index("\n}", entry.end())]
            wait, access = body.find("griddepcontrol.wait"), _GLOBAL_ACCESS.search(body)
            ok = (0 <= wait < access.start()) if waits else wait == -1
            seen[entry.group(1)] = seen.get(entry.group(1), True) and ok  # in every build
    expected = kernels.kernel_names() - (set() if arch == "sm_90a" else _SM90A_KERNELS)
    assert set(seen) == expected and all(seen.values()), seen


def test_find_nvdisasm_takes_the_environment_then_path_then_the_toolkit_then_the_wheel(tmp_path, monkeypatch):
    import sysconfig
    toolkit, purelib = tmp_path / "cuda", tmp_path / "site"
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"purelib": str(purelib)})
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.setenv("NVDISASM", str(tmp_path / "gone"))  # not a file: passed over
    assert kernels.find_nvdisasm() is None
    found = []
    for path in (purelib / "nvidia" / "cu13" / "bin" / "nvdisasm", toolkit / "bin" / "nvdisasm.exe",
                 tmp_path / "on_path" / "nvdisasm", tmp_path / "given"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        if path.parent.name == "on_path":
            monkeypatch.setattr(kernels.shutil, "which", lambda name, path=path: str(path))
        if path.name == "given":
            monkeypatch.setenv("NVDISASM", str(path))
        found.append(kernels.find_nvdisasm())
    assert found == [str(purelib / "nvidia" / "cu13" / "bin" / "nvdisasm"), str(toolkit / "bin" / "nvdisasm.exe"),
                     str(tmp_path / "on_path" / "nvdisasm"), str(tmp_path / "given")]


# SASS of global memory: loads, stores, atomics, reductions, the async and bulk copies.
_SASS_GLOBAL_ACCESS = re.compile(r"^(?:LDG|STG|LD|ST|LDGSTS|ATOM|ATOMG|RED|REDG|UTMALDG|UTMASTG|UBLKCP)(?:\.|$)")


@pytest.mark.sass
def test_every_kernel_compiled_for_sm90_waits_before_its_first_global_access_in_sass(tmp_path):
    """The same in the machine code: ptxas may schedule a load above griddepcontrol.wait (ACQBULK)
    although the PTX has it below (it did so with attn_bwd_lean's read-only scalar loads in Session
    36; load_after_wait keeps them behind it), so each entry point's first global memory
    instruction must come after its ACQBULK."""
    nvdisasm = kernels.find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm, in the test extra)")
    import subprocess
    seen = {}
    for i, (filename, defines) in enumerate(_PTX_BUILDS + _SM90A_BUILDS):
        cubin = tmp_path / f"{i}.cubin"
        cubin.write_bytes(kernels.compile_cubin(filename, "sm_90a" if (filename, defines) in _SM90A_BUILDS else "sm_90",
                                                defines))
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        for name, body in re.findall(r"\.global\s+(\w+)(.*?)(?=\.global\s|\Z)", sass, re.DOTALL):
            opcodes = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", body)]
            wait = opcodes.index("ACQBULK") if "ACQBULK" in opcodes else len(opcodes)
            early = [op for op in opcodes[:wait] if _SASS_GLOBAL_ACCESS.match(op)]
            seen[name] = seen.get(name, True) and "ACQBULK" in opcodes and not early
    assert set(seen) == kernels.kernel_names() and all(seen.values()), seen

