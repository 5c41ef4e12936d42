"""The scripts/ a GPU session runs parse here: a syntax error (or a merge's conflict markers) would
otherwise surface only on the device, in its limited time."""
import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*"))


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.suffix == ".py"], ids=lambda p: p.name)
def test_python_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.suffix == ".sh"], ids=lambda p: p.name)
def test_shell_script_parses(path):
    subprocess.run(["bash", "-n", str(path)], check=True)
