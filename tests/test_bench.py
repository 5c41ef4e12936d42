"""CPU tests of the timing harness: statistics, derived numbers, output formats,
the numpy-backend sweep and the no-GPU error. Nothing here needs a GPU."""
import csv
import io
import json
import math
import pathlib
import re

import numpy
import pytest

from cupy_xattn import bench
from cupy_xattn.cases import Case


def _row(b, nv, nt, precision, impl, median, host=10.0, gflop=1.0, status="ok"):
    row = {k: None for k in bench.ROW_FIELDS}
    row.update(batch_size=b, num_video_tokens=nv, num_text_tokens=nt, precision=precision,
               impl=impl, median_us=median, p20_us=median, p80_us=median, host_us=host,
               gflop=gflop, reps=50, timer="cuda-events", status=status)
    return row


def _result(rows, ceilings=None):
    bench._fill_derived(rows, ceilings)
    meta = dict.fromkeys(bench.META_FIELDS, "x")
    meta["torch_version"] = None
    meta["settings"] = {"backend": "cupy", "reps": 50, "warmup": 10, "hidden_size": 1024,
                        "num_heads": 16}
    return bench._jsonable({"meta": meta, "rows": rows, "ceilings": ceilings,
                            "means": bench.suite_means(rows)})


def _sample_result():
    rows = [
        _row(2, 256, 77, "tf32", bench.IMPL, 100.0, gflop=2.0),
        _row(2, 256, 77, "tf32", "torch-tf32-graph", 300.0, gflop=2.0),
        _row(8, 512, 77, "tf32", bench.IMPL, 200.0, gflop=8.0),
        _row(8, 512, 77, "tf32", "torch-tf32-graph", 500.0, gflop=8.0),
        _row(8, 512, 77, "fp16", bench.IMPL, None, status="error: ValueError: nope"),
    ]
    ceilings = {"tf32": {"tflops": 400.0, "median_us": 1.0, "m": 8, "n": 8, "k": 8},
                "fp32": {"tflops": 50.0, "median_us": 1.0, "m": 8, "n": 8, "k": 8},
                "fp16": {"tflops": None, "error": "RuntimeError: x"},
                "copy": {"gbps": 4000.0, "median_us": 1.0, "bytes": 2**30}}
    return _result(rows, ceilings)


def test_summarize_known_data():
    stats = bench.summarize(list(range(1, 101)))       # 1..100, linear interpolation
    assert stats["median_us"] == pytest.approx(50.5)
    assert stats["p20_us"] == pytest.approx(20.8)
    assert stats["p80_us"] == pytest.approx(80.2)
    assert bench.summarize([7.0]) == {"median_us": 7.0, "p20_us": 7.0, "p80_us": 7.0}
    shuffled = bench.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert shuffled["median_us"] == 3.0
    assert all(type(v) is float for v in shuffled.values())
    with pytest.raises(ValueError):
        bench.summarize([])


def test_derived_numbers():
    rows = _sample_result()["rows"]
    ours = rows[0]
    # 2 GFLOP in 100 us = 20 TFLOP/s; ceiling 400 -> 0.05; torch 300 us / 100 us = 3x
    assert ours["tflops"] == pytest.approx(20.0)
    assert ours["fraction_of_ceiling"] == pytest.approx(0.05)
    assert ours["speedup_vs_torch_tf32_graph"] == pytest.approx(3.0)
    assert rows[1]["speedup_vs_torch_tf32_graph"] == pytest.approx(1.0)
    failed = rows[4]
    assert failed["tflops"] is None and failed["fraction_of_ceiling"] is None
    assert failed["speedup_vs_torch_tf32_graph"] is None


def test_our_fp32_is_measured_against_a_third_of_fp16():
    # our fp32 runs three fp16 GEMMs per product; the baselines' fp32 runs IEEE FFMA
    rows = [_row(1, 8, 5, "fp32", bench.IMPL, 100.0, gflop=3.0),
            _row(1, 8, 5, "fp32", "torch-fp32-graph", 100.0, gflop=3.0)]
    ceilings = {"fp32": {"tflops": 60.0}, "fp16": {"tflops": 300.0}}
    ours, torch = bench._fill_derived(rows, ceilings)
    assert ours["tflops"] == torch["tflops"] == pytest.approx(30.0)
    assert ours["fraction_of_ceiling"] == pytest.approx(30.0 / 100.0)
    assert torch["fraction_of_ceiling"] == pytest.approx(30.0 / 60.0)
    # no fp16 ceiling: none for our fp32 either, not the FFMA one
    (ours,) = bench._fill_derived(rows[:1], {"fp32": {"tflops": 60.0}, "fp16": {"tflops": None}})
    assert ours["fraction_of_ceiling"] is None


def test_nan_rows_keep_their_times_but_stay_out_of_means_and_speedups():
    nan_ours = bench._measure(_row(1, 8, 5, "tf32", bench.IMPL, None, gflop=2.0),
                              lambda: ([100.0, 100.0], [10.0, 10.0], False))
    assert nan_ours["status"] == "nan" and nan_ours["median_us"] == 100.0 and nan_ours["host_us"] == 10.0
    rows = [nan_ours,
            _row(1, 8, 5, "tf32", "torch-tf32-graph", 200.0, gflop=2.0),
            _row(2, 8, 5, "tf32", bench.IMPL, 50.0, gflop=2.0),
            _row(2, 8, 5, "tf32", "torch-tf32-graph", 300.0, gflop=2.0, status="nan")]
    result = _result(rows)
    nan_ours, _, ours, _ = result["rows"]
    # the time is real, the values are not: TFLOP/s and speedup still shown for the nan row ...
    assert nan_ours["tflops"] == pytest.approx(20.0)
    assert nan_ours["speedup_vs_torch_tf32_graph"] == pytest.approx(2.0)
    # ... but a nan reference is no reference, and the means take only ok rows
    assert ours["speedup_vs_torch_tf32_graph"] is None
    means = {m["impl"]: m for m in result["means"]}
    assert (means[bench.IMPL]["n_cases"], means[bench.IMPL]["mean_us"]) == (1, pytest.approx(50.0))
    assert (means["torch-tf32-graph"]["n_cases"], means["torch-tf32-graph"]["mean_us"]) == (1, pytest.approx(200.0))
    assert means[bench.IMPL]["speedup_vs_torch_tf32_graph"] is None
    assert [line.split()[-1] for line in bench.format_rows(result, "table").splitlines()
            if line.endswith((" ok", " nan"))] == ["nan", "ok", "ok", "nan"]


def test_long_errors_are_cut_to_300_in_the_row_and_100_in_the_table():
    def body():
        raise ValueError("a  long\n\tline " * 60)

    row = bench._measure(_row(1, 8, 5, "tf32", bench.IMPL, None), body)
    prefix = "error: ValueError: "
    # whitespace collapsed, 297 characters of the message and "..."
    assert row["status"] == prefix + ("a long line " * 60)[:297] + "..."
    result = _result([row])
    table = bench.format_rows(result, "table")
    assert row["status"][:100] in table and row["status"][:101] not in table
    assert list(csv.DictReader(io.StringIO(bench.format_rows(result, "csv"))))[0]["status"] == row["status"]


def test_suite_means():
    means = {(m["precision"], m["impl"]): m for m in _sample_result()["means"]}
    ours = means[("tf32", bench.IMPL)]
    assert ours["n_cases"] == 2
    assert ours["mean_us"] == pytest.approx(150.0)
    assert ours["mean_host_us"] == pytest.approx(10.0)
    assert ours["mean_tflops"] == pytest.approx((20.0 + 40.0) / 2)
    assert ours["mean_fraction_of_ceiling"] == pytest.approx((0.05 + 0.1) / 2)
    # ratio of the suite means on the shared cases: 400 / 150
    assert ours["speedup_vs_torch_tf32_graph"] == pytest.approx(400.0 / 150.0)
    assert means[("tf32", "torch-tf32-graph")]["mean_us"] == pytest.approx(400.0)
    assert ("fp16", bench.IMPL) not in means          # errors are left out of the means


def test_suite_means_without_reference():
    rows = [_row(1, 8, 5, "fp32", bench.IMPL, 10.0), _row(1, 16, 5, "fp32", bench.IMPL, 30.0)]
    bench._fill_derived(rows, None)
    (m,) = bench.suite_means(rows)
    assert m["mean_us"] == pytest.approx(20.0)
    assert m["speedup_vs_torch_tf32_graph"] is None
    assert m["mean_fraction_of_ceiling"] is None


def test_format_json_round_trip():
    result = _sample_result()
    loaded = json.loads(bench.format_rows(result, "json"))
    assert set(loaded) == {"meta", "rows", "ceilings", "means"}
    assert loaded["rows"] == result["rows"]
    assert loaded["ceilings"]["tf32"]["tflops"] == 400.0


def test_json_rejects_nothing_numpy():
    result = _sample_result()
    result["rows"][0]["median_us"] = numpy.float32(1.5)
    result["rows"][0]["reps"] = numpy.int64(50)
    result["rows"][1]["p80_us"] = float("nan")
    text = bench.format_rows(result, "json")
    loaded = json.loads(text)
    assert loaded["rows"][0]["median_us"] == 1.5
    assert loaded["rows"][0]["reps"] == 50
    assert loaded["rows"][1]["p80_us"] is None
    assert "NaN" not in text


def test_format_csv():
    result = _sample_result()
    text = bench.format_rows(result, "csv")
    records = list(csv.DictReader(io.StringIO(text)))
    assert tuple(records[0]) == bench.ROW_FIELDS + bench.META_FIELDS
    assert len(records) == len(result["rows"])
    assert float(records[0]["median_us"]) == 100.0
    assert records[0]["device"] == "x"
    assert records[4]["median_us"] == ""
    assert records[4]["status"].startswith("error")


def test_format_table():
    text = bench.format_rows(_sample_result(), "table")
    assert "median_us" in text and "suite means" in text and "ceilings measured" in text
    # The first row whole: TFLOP/s rounded to 0.1, the fraction of the ceiling to 0.001, x vs torch to 0.01.
    assert re.search(r"^2\s+256\s+77\s+tf32\s+cupy_xattn\s+100\.0\s+100\.0\s+100\.0\s+10\.0\s+20\.0\s+0\.050\s+3\.00\s+ok$",
                     text, re.M), text
    assert "400.0 TFLOP/s" in text
    assert "fp16 GEMM: not measured" in text
    assert "error: ValueError: nope" in text


def test_format_rejects_unknown():
    with pytest.raises(ValueError, match="fmt"):
        bench.format_rows(_sample_result(), "xml")


def test_numpy_sweep_tiny_shape():
    cases = [Case(1, 8, 5, atol=0.1), Case(2, 6, 3, atol=0.1)]
    seen = []
    result = bench.run_sweep(cases, precisions=("tf32", "fp32"), backend="numpy", reps=3,
                             warmup=1, hidden_size=64, num_heads=4, progress=seen.append)
    assert seen == cases
    json.loads(bench.format_rows(result, "json"))
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["status"] == "ok", row["status"]
        assert row["impl"] == bench.IMPL and row["timer"] == "perf_counter"
        assert row["p20_us"] <= row["median_us"] <= row["p80_us"]
        assert row["tflops"] > 0 and math.isfinite(row["tflops"])
    assert result["rows"][0]["gflop"] == pytest.approx(
        (10 * 8 * 64**2 + 12 * 5 * 64**2 + 12 * 8 * 5 * 64) / 1e9)
    meta = result["meta"]
    for field in ("numpy_version", "git_commit", "date_utc", "hostname", "device"):
        assert meta[field]
    assert meta["settings"]["backend"] == "numpy"
    assert {(m["precision"], m["impl"]) for m in result["means"]} == {
        ("tf32", bench.IMPL), ("fp32", bench.IMPL)}
    assert "suite means" in bench.format_rows(result, "table")


def test_numpy_sweep_marks_nan_outputs(monkeypatch):
    # a NaN in the last of the ten outputs: timed all the same, status "nan", out of the means
    import cupy_xattn
    real = cupy_xattn.cross_attention_backward

    def nan_bias(*args, **kwargs):
        grads = real(*args, **kwargs)
        return grads._replace(grad_output_bias=numpy.full_like(grads.grad_output_bias, numpy.nan))

    monkeypatch.setattr(cupy_xattn, "cross_attention_backward", nan_bias)
    result = bench.run_sweep([Case(1, 8, 5, atol=0.1)], precisions=("tf32",), backend="numpy", reps=2,
                             warmup=0, hidden_size=64, num_heads=4)
    (row,) = result["rows"]
    assert row["status"] == "nan" and row["median_us"] > 0 and row["tflops"] > 0
    assert result["means"] == []


def test_metadata_without_gpu():
    meta = bench.collect_meta("numpy")
    assert set(bench.META_FIELDS) <= set(meta)
    assert meta["date_utc"].endswith("+00:00")
    assert meta["git_commit"]
    json.dumps(meta)


def test_git_commit_override(monkeypatch):
    monkeypatch.setenv("CUPY_XATTN_GIT_COMMIT", "abc1234")
    assert bench.collect_meta("numpy")["git_commit"] == "abc1234"


def _gpu_present():
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.is_available()
    except Exception:
        return False


@pytest.mark.skipif(_gpu_present(), reason="a GPU is present: the no-GPU error cannot happen")
def test_cupy_backend_without_gpu_raises_clearly():
    with pytest.raises(RuntimeError, match=r"no CUDA GPU found: .*--backend numpy"):
        bench.run_sweep([Case(1, 8, 5, atol=0.1)], precisions=("tf32",), backend="cupy",
                        reps=1, warmup=0, hidden_size=64, num_heads=4, baselines=True,
                        ceilings=True)


def test_run_sweep_rejects_bad_options():
    case = [Case(1, 8, 5, atol=0.1)]
    with pytest.raises(ValueError, match="backend"):
        bench.run_sweep(case, precisions=("tf32",), backend="torch")
    with pytest.raises(ValueError, match="reps=0"):
        bench.run_sweep(case, precisions=("tf32",), backend="numpy", reps=0)
    # a negative warm-up would silently run none
    with pytest.raises(ValueError, match="warmup >= 0, got reps=1, warmup=-1"):
        bench.run_sweep(case, precisions=("tf32",), backend="numpy", reps=1, warmup=-1)


def test_import_does_not_touch_cupy_or_torch():
    import subprocess
    import sys
    code = ("import sys, cupy_xattn.bench; "
            "print('cupy' in sys.modules, 'torch' in sys.modules)")
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=root)
    assert out.stdout.split() == ["False", "False"]


def _load_md_writer():
    import importlib.util
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "write_benchmarks_md.py"
    spec = importlib.util.spec_from_file_location("write_benchmarks_md", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_md_marks_the_cases_within_the_floor_bound():
    result = _sample_result()
    result["rows"][0]["median_us"] = 15.0  # 2 GFLOP at 400 TFLOP/s: a 5 µs floor, a bound of 17.5
    text = _load_md_writer().render(result)
    assert "| 17.5 ✓ |" in text and "| 40.0 ✗ |" in text and "| 1 / 2 within |" in text


def test_benchmarks_md_from_json(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(bench.format_rows(_sample_result(), "json"))
    target = tmp_path / "BENCHMARKS.md"
    _load_md_writer().main([str(path), "-o", str(target)])
    text = target.read_text()
    assert "## precision = tf32" in text and "## precision = fp16" in text
    assert "| B=2 Nv=256 Nt=77 |" in text
    assert "3.00×" in text                            # 300 us torch / 100 us ours
    assert "**suite mean** (2 cases)" in text
    # Issue #5's bound, 1.5 × floor + 10 µs: floors of 5 and 20 µs (2 and 8 GFLOP at 400 TFLOP/s)
    assert "| 17.5 ✗ |" in text and "| 40.0 ✗ |" in text and "| 0 / 2 within |" in text
    assert "## Ceilings measured on this card" in text and "400.0 TFLOP/s" in text
    assert "every case" not in text and "error: ValueError: nope" in text
    # A second sweep (other layer sizes) is appended as its own part.
    _load_md_writer().main([str(path), str(path), "-o", str(target)])
    both = target.read_text()
    assert both.startswith(text) and both.count("## precision = tf32") == 2
    assert "\n# Benchmarks, D=" in both and "(sweep.json)" in both
