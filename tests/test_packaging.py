"""A built wheel carries the kernel sources, and the installed package reads them from its own copy."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cupy_xattn

CHECKOUT = Path(__file__).resolve().parent.parent


def _run(*command, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_and_loads_kernels_from_its_own_copy(tmp_path):
    # Build from a copy so that the checkout gets no build/ or egg-info, plus a probe kernel
    # with a header, so the test does not depend on which kernels exist today.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(CHECKOUT / name, source / name)
    shutil.copytree(CHECKOUT / "cupy_xattn", source / "cupy_xattn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(CHECKOUT / "kernels_cu", source / "kernels_cu")
    (source / "kernels_cu" / "zz_probe.cuh").write_text("#define ZZ_PROBE 42\n")
    (source / "kernels_cu" / "zz_probe.cu").write_text('#include "zz_probe.cuh"\n// probe\n')
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source)
    [wheel] = (tmp_path / "dist").glob("cupy_xattn-*.whl")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel)
    # The new venv borrows only this interpreter's NumPy and click (its own site-packages comes first).
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    borrowed = {str(Path(__import__(m).__file__).parent.parent) for m in ("numpy", "click")}
    (site / "borrowed.pth").write_text("\n".join(sorted(borrowed)) + "\n")

    probe = ("import cupy_xattn, cupy_xattn.kernels as k; print(cupy_xattn.__file__); print(k.source_dir());"
             "print(','.join(p.name for p in k.kernel_files())); print('ZZ_PROBE 42' in k.kernel_source('zz_probe.cu'))")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    package_file, folder, files, inlined = _run(python, "-c", probe, cwd=tmp_path, env=env).splitlines()
    assert Path(package_file).is_relative_to(site) and Path(folder) == site / "cupy_xattn" / "kernels_cu"
    shipped = sorted(p.name for p in (CHECKOUT / "kernels_cu").glob("*.cu")) + ["zz_probe.cu"]
    assert files.split(',') == sorted(shipped) and inlined == "True"
    assert (site / "cupy_xattn" / "data" / "sol_execbench_cases.json").is_file()
    assert _run(venv / "bin" / "cupy-xattn", "--version", env=env).strip().endswith(cupy_xattn.__version__)
