"""The cupy-xattn command: plain messages, exit codes, clean stdout."""
import json
import re
import sys
import types

import numpy
import pytest
from click.testing import CliRunner

import cupy_xattn
from cupy_xattn.cases import flops
from cupy_xattn.cli import main
from cupy_xattn.grads import CrossAttentionGrads

TINY = ["--shape", "2x16x5", "--hidden-size", "32", "--num-heads", "4"]


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def no_gpu(monkeypatch):
    """CuPy present but no device, whatever this machine has."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(is_available=lambda: False, __version__="0"))


def test_info_without_gpu(runner, no_gpu, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", "/some/cache")
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"cupy_xattn {cupy_xattn.__version__}"
    assert f"numpy      {numpy.__version__}" in lines
    assert "GPU        no GPU (CuPy sees no CUDA device)" in lines
    assert "cache      /some/cache" in lines


def test_info_without_cupy(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0
    assert "cupy       not installed (pip install 'cupy-xattn[cuda12]'" in result.stdout


def test_check_numpy_backend_passes(runner):
    result = runner.invoke(main, ["check", "--backend", "numpy", *TINY, "--shape", "1x3x2"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("%  pass\n") == 20 and result.stdout.rstrip().endswith("all outputs pass")
    assert "case 2x16x5" in result.stdout and "case 1x3x2" in result.stdout
    # The numpy backend is the float64 reference rounded to float32: every gradient within float32
    # rounding, every element matching (the spoil tests below show a wrong gradient fails).
    rows = re.findall(r"^  (grad_\w+)\s+max_abs_err (\S+)\s+atol 0\.1\s+match 100\.00%  pass$", result.stdout, re.M)
    assert [name for name, _ in rows] == list(CrossAttentionGrads._fields) * 2
    assert all(float(err) < 1e-5 for _, err in rows), rows


def _patch_backward(monkeypatch, spoil_value_weight=None):
    """check's backward: the real one, grad_value_weight passed through spoil_value_weight if given.
    Returns the keyword arguments of every call."""
    calls = []

    def backward(**inputs):
        calls.append(inputs)
        grads = cupy_xattn.cross_attention_backward(**inputs)
        if spoil_value_weight is None:
            return grads
        return grads._replace(grad_value_weight=spoil_value_weight(grads.grad_value_weight))

    monkeypatch.setattr(cupy_xattn.api, "cross_attention_backward", backward)
    return calls


def test_check_fails_with_exit_code_1(runner, monkeypatch):
    _patch_backward(monkeypatch, numpy.zeros_like)
    result = runner.invoke(main, ["check", "--backend", "numpy", *TINY])
    assert result.exit_code == 1
    assert "grad_value_weight" in result.stdout and "FAIL" in result.stdout
    assert result.stdout.rstrip().endswith("1 output(s) failed")


def test_check_atol_sets_the_tolerance_of_shape_cases(runner, monkeypatch):
    # every element of one output off by 0.5: over the default atol 0.1, within --atol 1
    _patch_backward(monkeypatch, lambda grad: grad + 0.5)
    assert runner.invoke(main, ["check", "--backend", "numpy", *TINY]).exit_code == 1
    result = runner.invoke(main, ["check", "--backend", "numpy", *TINY, "--atol", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count(" atol 1 ") == 10 and result.stdout.rstrip().endswith("all outputs pass")


def test_check_takes_a_suite_cases_tolerance_for_its_shape(runner, monkeypatch):
    # 2x512x77 is a sol-execbench case (atol 0.17 at D = 1024, 16 heads): one output off by 0.13
    # passes there, fails at --atol 0.1 and at the suite case's size with other heads (no case: 0.1)
    _patch_backward(monkeypatch, lambda grad: grad + 0.13)
    result = runner.invoke(main, ["check", "--backend", "numpy", "--shape", "2x512x77"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count(" atol 0.17 ") == 10
    for other in (["--atol", "0.1"], ["--num-heads", "8"]):
        result = runner.invoke(main, ["check", "--backend", "numpy", "--shape", "2x512x77", *other])
        assert result.exit_code == 1 and result.stdout.count(" atol 0.1 ") == 10, (other, result.output)


def test_check_passes_its_precision_to_the_backward(runner, monkeypatch):
    # the numpy backend ignores the precision, so only the call shows whether it got through
    calls = _patch_backward(monkeypatch)
    result = runner.invoke(main, ["check", "--backend", "numpy", *TINY, "--precision", "fp16"])
    assert result.exit_code == 0, result.output
    assert [call["precision"] for call in calls] == ["fp16"] and "numpy/fp16" in result.stdout


def test_check_seed_picks_the_inputs(runner):
    # the printed float32 rounding errors depend on the random inputs
    first, again, other = (runner.invoke(main, ["check", "--backend", "numpy", *TINY, "--seed", seed]).stdout
                           for seed in ("1", "1", "2"))
    assert first == again
    assert first != other and first.count("%  pass\n") == other.count("%  pass\n") == 10


@pytest.mark.parametrize("command", [["check"], ["sweep"], ["check", "--suite", "sol-execbench"],
                                     ["sweep", "--suite", "sol-execbench"]])
def test_no_gpu_is_one_plain_line(runner, no_gpu, command):
    result = runner.invoke(main, [*command, *([] if len(command) > 1 else TINY)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no CUDA GPU found" in result.stderr and "--backend numpy" in result.stderr
    assert "Traceback" not in result.output


def test_no_cupy_names_the_extras(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    result = runner.invoke(main, ["sweep", "--suite", "sol-execbench"])
    assert result.exit_code == 2 and "cupy-xattn[cuda12]" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("args, complaint", [
    (["check", "--shape", "2x64"], "--shape"),
    (["check", "--shape", "axbxc"], "--shape"),
    (["sweep", "--shape", "0x1x1"], "--shape"),
    (["check", "--suite", "nope"], "--suite"),
    (["check"], "give --suite or at least one --shape"),
    (["check", *TINY, "--precision", "bf16"], "--precision"),
    (["sweep", *TINY, "--precision", "tf32,bf16"], "bf16"),
    (["sweep", *TINY, "--format", "xml"], "--format"),
    (["check", "--shape", "1x1x1", "--hidden-size", "30", "--num-heads", "4"], "not divisible"),
    (["sweep", *TINY, "--reps", "0"], "--reps"),
    (["sweep", "--backend", "numpy", *TINY, "--warmup", "-1"], "--warmup"),
])
def test_bad_arguments_are_usage_errors(runner, args, complaint):
    result = runner.invoke(main, args)
    assert result.exit_code == 2
    assert complaint in result.stderr and "Usage:" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.output


@pytest.fixture
def fake_bench(monkeypatch):
    """Stand-in for cupy_xattn.bench that records what the CLI passes."""
    calls = []

    def run_sweep(cases, *, progress, **options):
        calls.append((cases, options))
        for case in cases:
            progress(case)
        return {"meta": {}, "rows": [{"case": c.label} for c in cases], "ceilings": None}

    def format_rows(result, fmt):
        return f"{fmt}:" + ",".join(row["case"] for row in result["rows"])

    bench = types.SimpleNamespace(run_sweep=run_sweep, format_rows=format_rows)
    monkeypatch.setitem(sys.modules, "cupy_xattn.bench", bench)
    monkeypatch.setattr(cupy_xattn, "bench", bench, raising=False)
    return calls


def test_sweep_passes_options_and_keeps_stdout_clean(runner, fake_bench):
    result = runner.invoke(main, ["sweep", "--backend", "numpy", "--shape", "2x8x3", "--shape", "1x4x2",
                                  "--precision", "fp32,tf32", "--precision", "fp16", "--reps", "3", "--warmup", "1",
                                  "--hidden-size", "64", "--num-heads", "2", "--baselines", "--ceilings",
                                  "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "csv:2x8x3,1x4x2\n"
    assert "sweep" in result.stderr
    [(cases, options)] = fake_bench
    assert [c.label for c in cases] == ["2x8x3", "1x4x2"]
    assert options == {"precisions": ("fp32", "tf32", "fp16"), "backend": "numpy", "reps": 3, "warmup": 1,
                       "hidden_size": 64, "num_heads": 2, "baselines": True, "ceilings": True}


def test_sweep_suite_defaults(runner, fake_bench, monkeypatch):
    monkeypatch.setattr("cupy_xattn.cli.require_gpu", lambda: None)
    result = runner.invoke(main, ["sweep", "--suite", "sol-execbench"])
    assert result.exit_code == 0, result.output
    [(cases, options)] = fake_bench
    assert len(cases) == 16 and options["precisions"] == ("tf32",) and options["backend"] == "cupy"
    assert (options["reps"], options["warmup"], options["hidden_size"], options["num_heads"]) == (50, 10, 1024, 16)
    assert (options["baselines"], options["ceilings"]) == (False, False)
    assert result.stdout.startswith("table:64x128x77,")


def test_shapes_alone_default_to_1024_and_16_heads(runner, fake_bench):
    # no suite: D and H fall back to the sol-execbench layer's, each on its own
    assert runner.invoke(main, ["sweep", "--backend", "numpy", "--shape", "2x8x3"]).exit_code == 0
    assert runner.invoke(main, ["sweep", "--backend", "numpy", "--shape", "2x8x3", "--hidden-size", "64"]).exit_code == 0
    (_, options), (_, smaller) = fake_bench
    assert (options["hidden_size"], options["num_heads"]) == (1024, 16)
    assert (smaller["hidden_size"], smaller["num_heads"]) == (64, 16)


def test_sweep_precisions_are_deduplicated_in_first_seen_order(runner, fake_bench):
    result = runner.invoke(main, ["sweep", "--backend", "numpy", *TINY, "--precision", "fp16,tf32",
                                  "--precision", "fp16", "--precision", "tf32,fp16,fp32"])
    assert result.exit_code == 0, result.output
    [(_, options)] = fake_bench
    assert options["precisions"] == ("fp16", "tf32", "fp32")


def test_sweep_wan_suite_takes_its_layer_sizes_unless_given(runner, fake_bench, monkeypatch):
    monkeypatch.setattr("cupy_xattn.cli.require_gpu", lambda: None)
    assert runner.invoke(main, ["sweep", "--suite", "wan22-a14b"]).exit_code == 0
    assert runner.invoke(main, ["sweep", "--suite", "wan22-a14b", "--num-heads", "80"]).exit_code == 0
    (cases, options), (_, more_heads) = fake_bench
    assert [c.label for c in cases] == ["1x1560x512", "1x4096x512", "1x32760x512"]
    assert (options["hidden_size"], options["num_heads"]) == (5120, 40)
    assert (more_heads["hidden_size"], more_heads["num_heads"]) == (5120, 80)  # head_dim 64


def test_sweep_out_file(runner, fake_bench, tmp_path):
    target = tmp_path / "sweep.json"
    result = runner.invoke(main, ["sweep", "--backend", "numpy", *TINY, "--format", "json", "--out", str(target)])
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and target.read_text() == "json:2x16x5\n"


def test_sweep_numpy_backend_runs_for_real(runner, tmp_path):
    """Through the real timing harness: what a new user without a GPU sees."""
    result = runner.invoke(main, ["sweep", "--backend", "numpy", *TINY, "--reps", "2", "--warmup", "0",
                                  "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert len(rows) == 1
    row = rows[0]  # the timing harness turns a failing call into a status, so the status says it ran
    assert (row["batch_size"], row["num_video_tokens"], row["num_text_tokens"], row["precision"], row["status"]) == (
        2, 16, 5, "tf32", "ok")
    assert 0 < row["p20_us"] <= row["median_us"] <= row["p80_us"] and row["reps"] == 2
    assert row["gflop"] == pytest.approx(flops(2, 16, 5, 32) / 1e9)


def test_python_dash_m(runner):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "cupy_xattn", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and cupy_xattn.__version__ in done.stdout
