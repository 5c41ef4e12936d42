"""The only reader of ``kernels_cu/``: kernel sources, the compiled-kernel cache, and cubins without a GPU.

The .cu files live in the checkout's top-level ``kernels_cu/`` and are installed as
``cupy_xattn/kernels_cu/``; an editable install does not see that mapping, so both places
are searched, the installed copy first.
"""
import functools
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
import warnings
from pathlib import Path

from ._cupy import cache_dir, import_cupy

_PACKAGE = Path(__file__).resolve().parent
SOURCE_DIRS = (_PACKAGE / "kernels_cu", _PACKAGE.parent / "kernels_cu")
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.MULTILINE)

_modules = {}


class CompileError(RuntimeError):
    """A kernel failed to compile; the message holds the compiler's log."""


def source_dir():
    """The folder the kernel sources are read from: the installed copy, else the checkout's."""
    for folder in SOURCE_DIRS:
        if folder.is_dir() and any(folder.glob("*.cu")):
            return folder
    raise FileNotFoundError(f"no kernels_cu/*.cu in {' or '.join(map(str, SOURCE_DIRS))}")


def kernel_files():
    """Paths of every ``kernels_cu/*.cu``, sorted."""
    return sorted(source_dir().glob("*.cu"))


#: what precedes a kernel's name where kernels_cu/ defines it
KERNEL_HEAD = r'extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+'
_KERNEL = re.compile(KERNEL_HEAD + r"(\w+)\s*\(")


@functools.lru_cache(maxsize=None)
def kernel_names():
    """Names of every ``extern "C"`` kernel in ``kernels_cu/*.cu``."""
    return frozenset(name for path in kernel_files() for name in _KERNEL.findall(path.read_text()))


def kernel_source(filename):
    """The text of ``kernels_cu/<filename>`` with its local ``#include "x.cuh"`` files inlined.

    Inlining makes the returned string the whole program, so CuPy's disk cache (keyed on
    the source text) sees header edits. ``#line`` directives keep compiler messages pointing
    at the original files. Each header is inlined once.
    """
    folder = source_dir()
    if not (folder / filename).is_file():
        raise FileNotFoundError(f"no kernel source {filename!r} in {folder}")
    return _inline(folder, filename, set())


def _inline(folder, filename, seen):
    seen.add(filename)
    text = (folder / filename).read_text()

    def replace(match):
        header = match.group(1)
        if not (folder / header).is_file():  # a system or toolkit header: the compiler finds it
            return match.group(0)
        if header in seen:
            return f"// {header} already inlined"
        line = text.count("\n", 0, match.end()) + 2
        return f'#line 1 "{header}"\n{_inline(folder, header, seen)}\n#line {line} "{filename}"'

    return _LOCAL_INCLUDE.sub(replace, text)


def _with_defines(filename, defines):
    """Source with ``#define K V`` lines first; kernels default their knobs with ``#ifndef K``."""
    lines = [f"#define {name} {value}\n" for name, value in (defines or {}).items()]
    return "".join(lines) + kernel_source(filename)


def get_kernel(filename, kernel_name, defines=None, arch=None):
    """Compiled ``extern "C"`` kernel ``kernel_name`` of ``kernels_cu/<filename>`` for the current GPU.

    Parameters
    ----------
    filename : str
        e.g. "attention_bwd.cu".
    kernel_name : str
    defines : dict, optional
        Name -> value, prepended as ``#define`` lines.
    arch : str, optional
        A target other than the device's own, e.g. "sm_90a" for wgmma: compiled here
        (``compile_cubin``), its cubin kept in CuPy's cache folder beside CuPy's own.

    Returns
    -------
    cupy.RawKernel
        Modules are cached per (filename, defines, device, arch); CuPy also caches the binary on
        disk (``CUPY_CACHE_DIR``), keyed on the full source text.
    """
    cupy = import_cupy()
    device = cupy.cuda.Device()
    key = (filename, tuple(sorted((defines or {}).items())), device.id, arch)
    if key not in _modules and arch is not None:
        try:
            _modules[key] = _module_from_cached_cubin(filename, arch, defines)
        except OSError as exc:
            warnings.warn(f"cupy_xattn: the kernel cache ({cache_dir()}) is not usable ({exc}); "
                          f"compiling {filename} without it", RuntimeWarning, stacklevel=2)
            _modules[key] = _module_without_cache(filename, arch, defines)
    if key not in _modules:
        try:  # compiles now, through CuPy's disk cache
            module = cupy.RawModule(code=_with_defines(filename, defines), options=("-std=c++17",))
            module.get_function(kernel_name)
        except OSError as exc:  # CuPy's cache folder cannot be read or written
            warnings.warn(f"cupy_xattn: CuPy's kernel cache ({cache_dir()}) is not usable ({exc}); "
                          f"compiling {filename} without it", RuntimeWarning, stacklevel=2)
            module = _module_without_cache(filename, f"sm_{device.compute_capability}", defines)
        _modules[key] = module
    return _modules[key].get_function(kernel_name)


def cubin_cache_path(filename, arch, defines=None):
    """Where ``get_kernel(..., arch=...)`` keeps the cubin: CuPy's cache folder, named by a hash of
    the source with its defines, the target and the compiler (NVRTC's version, or nvcc)."""
    nvrtc = _nvrtc()
    compiler = f"nvrtc {nvrtc.getVersion()} {' '.join(_nvrtc_options(arch))}" if nvrtc is not None else "nvcc"
    text = "\0".join((_with_defines(filename, defines), arch, compiler))
    return Path(cache_dir()) / f"cupy_xattn_{hashlib.sha256(text.encode()).hexdigest()[:40]}.cubin"


def _module_from_cached_cubin(filename, arch, defines):
    """A RawModule of the cubin at ``cubin_cache_path``, compiled and written there first if missing
    (through a temporary file and a rename, so a reader never sees half a cubin)."""
    cupy = import_cupy()
    path = cubin_cache_path(filename, arch, defines)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_bytes(compile_cubin(filename, arch, defines))
        os.replace(partial, path)
    module = cupy.RawModule(path=str(path))
    module.module  # load it now: a broken file fails here, not at the first launch  # noqa: B018
    return module


def _module_without_cache(filename, arch, defines):
    """A RawModule of a cubin compiled here, not kept."""
    return load_cubin(compile_cubin(filename, arch, defines), filename)


def load_cubin(cubin, name):
    """A loaded RawModule of ``cubin`` (bytes), through a temporary file ``name``.cubin: a RawModule
    from a path gives kernels with the same attributes as one from source."""
    cupy = import_cupy()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, name + ".cubin")
        Path(path).write_bytes(cubin)
        module = cupy.RawModule(path=path)
        module.module  # load it before the file goes  # noqa: B018
    return module


def compile_cubin(filename, arch, defines=None):
    """Compile ``kernels_cu/<filename>`` to a cubin for ``arch``, without needing a GPU.

    Uses NVRTC through CuPy (with CuPy's include paths, as ``get_kernel`` compiles), or
    ``nvcc -cubin`` when CuPy or its NVRTC library is missing.

    Parameters
    ----------
    filename : str
    arch : str or int
        "sm_90", "sm_90a", "90" or 90.
    defines : dict, optional

    Returns
    -------
    bytes

    Raises
    ------
    CompileError
        With the compiler's log.
    """
    return compile_source(_with_defines(filename, defines), filename, arch)


def compile_ptx(filename, arch, defines=None):
    """``compile_cubin``'s PTX (bytes): what the front end made of the source, before ptxas."""
    return compile_source(_with_defines(filename, defines), filename, arch, ptx=True)


def compile_source(source, filename, arch, ptx=False):
    """``compile_cubin`` (or with ``ptx``, ``compile_ptx``) for a source string (``filename`` names it
    in the compiler's messages)."""
    arch = str(arch) if str(arch).startswith("sm_") else f"sm_{arch}"
    nvrtc = _nvrtc()
    if nvrtc is None:
        return _compile_with_nvcc(source, filename, arch, ptx)
    options = _nvrtc_options(arch)
    program = nvrtc.createProgram(source, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"{filename} ({arch}): {exc}\n{nvrtc.getProgramLog(program)}") from None
        return nvrtc.getPTX(program) if ptx else whole_elf(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)


def find_nvdisasm():
    """Path of an nvdisasm, for the machine-code checks (the sass tests, scripts/sass_mix.py and
    sass_same.py): $NVDISASM where that is a file, else PATH, the CUDA toolkit's bin ($CUDA_HOME,
    else /usr/local/cuda) or the ``nvidia-cuda-nvdisasm`` wheel (the test extra); None when none is."""
    import glob
    import sysconfig
    toolkit = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    found = [os.environ.get("NVDISASM", ""), shutil.which("nvdisasm") or ""]
    found += glob.glob(os.path.join(toolkit, "bin", "nvdisasm*"))
    found += sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin", "nvdisasm*")))
    return next((path for path in found if os.path.isfile(path)), None)


def elf_size(image):
    """The size an ELF64 image's header implies: the end of its program or its section header table."""
    ph_offset, sh_offset = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", image, 0x36)
    return max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)


def whole_elf(cubin):
    """``cubin`` with the byte CuPy's ``nvrtc.getCUBIN`` cuts off: it strips a trailing NUL as from
    text (``cubin[:size - 1]``), which is the ELF's last byte, the top byte of its last header's
    last 8-byte field (a zero). The driver loads the cut cubin; nvdisasm refuses it. Unchanged
    where the file is as long as its header says (nvcc's, or a fixed CuPy's)."""
    return cubin + b"\0" if len(cubin) == elf_size(cubin) - 1 else cubin


def _nvrtc_options(arch):
    """NVRTC's options for compile_cubin: CuPy's own (include paths, C++17) and -ftz=true as CuPy's
    RawModule adds it, so a cubin from here computes what a cached module does."""
    from cupy._core.core import assemble_cupy_compiler_options

    return (*assemble_cupy_compiler_options(()), f"-arch={arch}", "-std=c++17", "-ftz=true")


def _nvrtc():
    """CuPy's NVRTC binding when CuPy and the NVRTC library are both there, else None."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except (ImportError, OSError, RuntimeError):  # no CuPy; no libnvrtc (CuPy 14 raises a RuntimeError)
        return None
    return nvrtc


def _compile_with_nvcc(source, filename, arch, ptx=False):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CompileError(f"cannot compile {filename}: neither NVRTC (pip install nvidia-cuda-nvrtc-cu12) "
                           "nor nvcc is available")
    with tempfile.TemporaryDirectory() as folder:
        source_path, out_path = os.path.join(folder, filename), os.path.join(folder, "out")
        Path(source_path).write_text(source)
        command = [nvcc, "-ptx" if ptx else "-cubin", f"-arch={arch}", "-std=c++17", "-ftz=true", "-o", out_path,
                   source_path]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise CompileError(f"{filename} ({arch}): nvcc failed\n{done.stderr}")
        return Path(out_path).read_bytes()
