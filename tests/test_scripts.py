"""The scripts/ a GPU session runs parse here: a syntax error (or a merge's conflict markers) would
otherwise surface only on the device, in its limited time."""
import os
import py_compile
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

import builds

ROOT = Path(__file__).resolve().parent.parent  # the checkout
SCRIPTS = sorted((ROOT / "scripts").glob("*"))


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.suffix == ".py"], ids=lambda p: p.name)
def test_python_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.suffix == ".sh"], ids=lambda p: p.name)
def test_shell_script_parses(path):
    subprocess.run(["bash", "-n", str(path)], check=True)


def _script(name):
    import importlib.util
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", [(64, 128, 77), (2, 256, 211), (1, 512, 77)])
def test_fast16_probe_has_the_backwards_projection_gemms(shape):
    # the eight products of the backward (each output's shape is its gradient's or activation's),
    # whose FLOPs are WORKLOAD.md's projection part: all of cases.flops but the attention's 12 Mv Nt D
    from cupy_xattn import cases
    probe = _script("fast16_probe")
    b, nv, nt = shape
    mv, mt, d = b * nv, b * nt, 1024
    outputs = [(m, n) for _, _, m, n, _, _, _ in probe.backward_gemms(*shape)]
    assert outputs == [(mv, d), (mt, 2 * d), (mv, d), (d, d), (mv, d), (d, d), (mt, d), (2 * d, d)]
    flop = sum(2 * m * n * k for _, _, m, n, k, _, _ in probe.backward_gemms(*shape))
    assert flop == cases.flops(b, nv, nt, d) - 12 * b * nv * nt * d
    with pytest.raises(ValueError, match="do not chain"):  # a transpose flag off
        probe.BACKWARD_GEMMS[3] = ("dY", "O", False, False)  # dWo without dY^T
        probe.backward_gemms(2, 64, 64)


def test_ab_compare_sets_each_tree_against_the_first_of_its_run(tmp_path):
    import json
    compare = _script("ab_compare")

    def write(name, times, other=0.0):  # times: {(precision, B, Nv, Nt): µs}; and a row of another impl
        rows = [{"impl": "cupy_xattn", "precision": c[0], "batch_size": c[1], "num_video_tokens": c[2],
                 "num_text_tokens": c[3], "median_us": us} for c, us in times.items()]
        rows.append({"impl": "torch-tf32-graph", "precision": "tf32", "batch_size": 1, "num_video_tokens": 512,
                     "num_text_tokens": 77, "median_us": other})
        (tmp_path / name).write_text(json.dumps({"meta": {}, "rows": rows}))

    small, large = ("fp16", 1, 512, 77), ("fp16", 64, 128, 77)
    write("ab-p11.json", {small: 70.0, large: 400.0}, other=999.0)
    write("ab-p12.json", {small: 69.0, large: 396.0})
    write("ab-p21.json", {small: 71.0})
    write("ab-p22.json", {small: 70.5, large: 390.0})  # large has no base in p2
    runs = compare.load(tmp_path)
    assert runs == {"p1": {1: {small: 70.0, large: 400.0}, 2: {small: 69.0, large: 396.0}},
                    "p2": {1: {small: 71.0}, 2: {small: 70.5, large: 390.0}}}
    lines = compare.report(runs).splitlines()
    assert lines[0].split() == ["case", "p1:", "1", "→", "2", "(Δ)", "p2:", "1", "→", "2", "(Δ)"]
    assert lines[1].split() == ["fp16", "1x512x77", "70.0", "→", "69.0", "(-1.0)", "71.0", "→", "70.5", "(-0.5)"]
    assert lines[2].split() == ["fp16", "64x128x77", "400.0", "→", "396.0", "(-4.0)", "-"]
    assert lines[3:] == ["mean fp16 p1 1 → 2: 235.0 → 232.5 (-2.50) over 2 cases",
                         "mean fp16 p2 1 → 2: 71.0 → 70.5 (-0.50) over 1 cases"]


def test_sass_mix_counts_the_longest_loop_of_the_named_kernel():
    sass_mix = _script("sass_mix")
    sass = """//--------------------- .text.other       --------------------------
        /*0000*/                   FMUL R1, R2, R3 ;
//--------------------- .text.k           --------------------------
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
.L_x_2:
        /*0020*/                   FMUL R1, R2, R3 ;
        /*0030*/              @!P0 BRA `(.L_x_2) ;
        /*0040*/                   FMUL.FTZ R1, R2, R3 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0080*/                   NOP ;
"""
    total, mix = sass_mix.loop_mix(sass, "k")
    assert total == 9  # the other kernel's instruction is not k's
    assert dict(mix) == {"HMMA": 1, "FMUL": 2, "BRA": 2}  # .L_x_1's loop (0x10–0x50), not the inner or a forward one
    with pytest.raises(ValueError):
        sass_mix.loop_mix(sass, "missing")


def test_sass_same_counts_the_lines_that_differ_and_builds_only_known_defines():
    sass_same = _script("sass_same")
    listing = "HMMA R0, R2, R4, R0 ;\nFADD R1, R1, R3 ;\nEXIT ;"
    assert sass_same.differing_lines(listing, listing) == 0
    assert sass_same.differing_lines(listing, listing.replace("R3", "R5")) == 2  # a line out, a line in
    assert sass_same.differing_lines(listing, listing + "\nNOP ;") == 1
    from cupy_xattn import kernels
    for name, file, arch, defines in sass_same.BUILDS:  # a misspelt define would compile the default build
        source = kernels.kernel_source(file)
        assert all(f"#ifndef {define}" in source for define in defines), name
        assert arch in ("sm_80", "sm_90", "sm_90a"), name
    lean = {name: defines for name, _, _, defines in sass_same.BUILDS if name.startswith("lean")}
    assert lean["lean fp16"] == _LEAN_BUILDS[0] and lean["lean tf32"] == _LEAN_BUILDS[1]  # the timed builds


def test_sass_same_reads_the_sources_of_the_folder_it_is_given(tmp_path):
    # The other revision's kernels_cu/ (unpacked to a folder) against this checkout's: an edit in a
    # header must reach the compared source, or every build would compare this tree with itself.
    sass_same = _script("sass_same")
    shutil.copytree(ROOT / "kernels_cu", tmp_path / "kernels_cu")
    common = tmp_path / "kernels_cu" / "attention_common.cuh"
    common.write_text(common.read_text() + "\n// edited\n")
    edited, = sass_same._sources(tmp_path / "kernels_cu", ["attention_bwd.cu"]).values()
    here, = sass_same._sources(ROOT / "kernels_cu", ["attention_bwd.cu"]).values()
    assert "// edited" in edited and "// edited" not in here


def test_wgmma_probe_strides_are_the_ones_the_h200_confirmed():
    # (LBO, SBO, bytes per 16 of K) that gave A·B^T to fp32 rounding on the H200 (docs/perf-notes.md,
    # Session 13): a K-major [64][64] A, and a [64][80] B read transposed (its rows run along K).
    probe = _script("wgmma_probe")
    assert probe.strides_for(64, 64, False, False) == (128, 1024, 256)
    assert probe.strides_for(64, 80, True, False) == (1280, 128, 2560)
    assert probe.strides_for(64, 80, True, True) == (128, 1280, 2560)  # the other reading (it faulted)


@pytest.mark.parametrize("n", [64, 80])
def test_wgmma_probe_compiles_for_sm_90a(n):
    from cupy_xattn import kernels
    cubin = kernels.compile_source(_script("wgmma_probe").kernel_source(n), "wgmma_probe.cu", "sm_90a")
    assert cubin[:4] == b"\x7fELF" and b"bench" in cubin and b"probe_11" in cubin


# The builds the ablations are timed in on the H200: the resident kernel on wgmma, fp16 O and fp32 O^T
# (the tf32 mode's); the lean trees' attn_bwd_lean, the fp16 mode's and the tf32 mode's (O^T, dQ^T).
_RESIDENT = dict(ATTN_BLOCK_Q=64, ATTN_BLOCK_KV=32, ATTN_HEAD_DIM=64, ATTN_SPLIT3=0, ATTN_HALF=1, ATTN_KEYS=80,
                 ATTN_KEY_SPLIT=1, ATTN_RESIDENT_MIN_BLOCKS=2, ATTN_WGMMA=1)
_TIMED_BUILDS = [dict(_RESIDENT, ATTN_O_TRANSPOSED=int(o_t), ATTN_O_HALF=int(not o_t)) for o_t in (False, True)]
_LEAN_BUILDS = [dict(_RESIDENT, **builds.LEAN_FP16), dict(_RESIDENT, **builds.LEAN_TF32)]
_ABLATIONS = ["loads", "exp", "stores", "dq", "stores_l2", "o_late", "scales", "dkdv", "dkdv3", "lean_ds_max",
              "lean_stores", "lean_o"]


def _attention_ptx(folder, defines, monkeypatch):
    """PTX (sm_90a) of attention_bwd.cu as the kernel sources in `folder` make it, with `defines`."""
    from cupy_xattn import kernels
    monkeypatch.setattr(kernels, "SOURCE_DIRS", (folder,))
    return kernels.compile_ptx("attention_bwd.cu", "sm_90a", defines)


@pytest.mark.parametrize("name", _ABLATIONS)
def test_attention_ablations_change_the_builds_they_are_timed_in(name, tmp_path, monkeypatch):
    # Each ablation rewrites lines of the kernels. An edit that no longer matches, or that lands in
    # code the timed build does not compile (Session 15's first dq tree edited only the mma.sync
    # path), would leave that tree the same as the base, and the device call would measure nothing.
    import shutil
    ablation = _script("attention_ablation")
    assert set(ablation.ABLATIONS) == set(_ABLATIONS)
    for tree in ("base", name):
        shutil.copytree(ROOT / "kernels_cu", tmp_path / tree / "kernels_cu")
    for file, text in ablation.edit(name, lambda file: (ROOT / file).read_text()).items():
        (tmp_path / name / file).parent.mkdir(exist_ok=True)
        (tmp_path / name / file).write_text(text)
    timed = _TIMED_BUILDS if not name.startswith("lean_") else _LEAN_BUILDS
    for defines in timed:
        base = _attention_ptx(tmp_path / "base" / "kernels_cu", defines, monkeypatch)
        changed = _attention_ptx(tmp_path / name / "kernels_cu", defines, monkeypatch) != base
        assert changed, f"the {name} tree leaves the build {defines} as it is"
    if (tmp_path / name / ablation.LAUNCHER).exists():  # the launcher's blocks per SM, as the tree plans them
        shutil.copytree(ROOT / "cupy_xattn", tmp_path / name / "cupy_xattn", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(Path(ablation.LAUNCHER).name, "__pycache__"))
        blocks = subprocess.run([sys.executable, "-c", "from cupy_xattn import attention_bwd; "
                                 "print(attention_bwd.kernel_choice(77, 'fp16')[4])"], cwd=tmp_path / name,
                                capture_output=True, text=True, check=True).stdout.split()
        assert blocks == ["3"], blocks


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("input_half", [0, 1])
def test_split_attention_probe_kernels_compile(arch, input_half, tmp_path, monkeypatch):
    from cupy_xattn import kernels
    (tmp_path / "split.cu").write_text(_script("split_attention_probe").SOURCE)
    monkeypatch.setattr(kernels, "SOURCE_DIRS", (tmp_path,))
    cubin = kernels.compile_cubin("split.cu", arch, {"INPUT_HALF": input_half})
    assert b"split_fwd" in cubin and b"split_bwd" in cubin


def test_split_attention_probe_reference_is_the_attention_backward(monkeypatch):
    # NumPy stands in for CuPy; every (batch, head) recomputed from the formulas in attention_bwd.cu
    # (B ≠ H, so that batch and head swapped anywhere would show)
    import sys
    import numpy
    monkeypatch.setitem(sys.modules, "cupy", numpy)
    b, nv, nt, heads, scale = 3, 5, 4, 2, 0.125
    d = heads * 64
    rng = numpy.random.default_rng(1)
    q, dout, kv = rng.standard_normal((b * nv, d)), rng.standard_normal((b * nv, d)), rng.standard_normal((b * nt, 2 * d))
    o, dq, dkv = _script("split_attention_probe").reference(q, kv, dout, b, nv, nt, heads, scale)
    for i in range(b):
        for h in range(heads):
            rows, keys, cols, v_cols = (slice(i * nv, (i + 1) * nv), slice(i * nt, (i + 1) * nt),
                                        slice(64 * h, 64 * h + 64), slice(d + 64 * h, d + 64 * h + 64))
            Q, dO, K, V = q[rows, cols], dout[rows, cols], kv[keys, cols], kv[keys, v_cols]
            P = numpy.exp(scale * Q @ K.T)
            P /= P.sum(1, keepdims=True)
            dS = P * (dO @ V.T - (dO * (P @ V)).sum(1, keepdims=True))
            for got, want in ((o[rows, cols], P @ V), (dq[rows, cols], scale * dS @ K),
                              (dkv[keys, cols], scale * dS.T @ Q), (dkv[keys, v_cols], P.T @ dO)):
                numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_kv_half_range_model_loses_bits_only_far_below_the_largest_sample():
    # README's claim for the fp16 mode's one [K0 | V0] scale: fp16-level errors (~5e-4) for a
    # sample 2^12 below the largest, ~2e-2 at 2^20 (K0 and V0 fp16 subnormals).
    model = _script("kv_half_range")
    (_, near), (_, far) = model.errors(12, n_video=16), model.errors(20, n_video=16)
    assert max(near) < 1e-3 < 5e-3 < max(far)



def test_reliability_table_is_the_one_in_the_docs(capsys, monkeypatch):
    # docs/reliability.md's bad-input table is this script's NumPy-backend output: a change to the
    # argument checks that alters a message must regenerate it. A precision given applies to every
    # row that does not set its own and is named in the header.
    table = _script("reliability_table")
    docs = (ROOT / "docs" / "reliability.md").read_text()
    monkeypatch.setattr(sys, "argv", ["reliability_table.py"])
    table.main()
    printed = capsys.readouterr().out
    assert printed.strip() in docs
    assert printed.count("\n") > 20
    seen = []

    def backward(*args, **kwargs):  # records the precision each row asks for
        seen.append(kwargs.get("precision"))
        return [numpy.zeros(1)] * 10
    monkeypatch.setattr(table, "cross_attention_backward", backward)
    monkeypatch.setattr(sys, "argv", ["reliability_table.py", "--precision", "fp16"])
    table.main()
    header = capsys.readouterr().out.splitlines()[0]
    assert header == "| input (B=2, Nv=6, Nt=5, D=256, H=4; backend numpy, precision fp16) | what it gets |"
    assert seen.count("bf16") == 1 and seen.count("fp16") == len(seen) - 1  # all but the row that sets its own


def test_nonfinite_classes_tells_finite_infinities_and_nan_apart():
    classes = _script("nonfinite_classes").classes
    x = numpy.array([0.0, -1.5, numpy.inf, -numpy.inf, numpy.nan])
    assert classes(x).tolist() == [0, 0, 1, 2, 3]


def test_nonfinite_classes_dwo_rule_is_where_inf_times_copy_plus_remainder_is_nan():
    rule = _script("nonfinite_classes").dwo_nan_rule
    copy = numpy.array([0.5, 0.5, -0.5, -0.5, 0.5, -0.5])
    remainder = numpy.array([1e-4, -1e-4, 1e-4, -1e-4, 0.0, 0.0])
    with numpy.errstate(invalid="ignore"):
        products = numpy.inf * remainder + numpy.inf * copy  # the correction term first, as the GEMMs add them
    assert rule(copy, remainder).tolist() == numpy.isnan(products).tolist() == [False, True, True, False, True, True]


def test_graph_kernels_splits_replays_and_lists_the_fastest_and_slowest():
    graph_kernels = _script("graph_kernels")
    # Three replays 2 ms apart: spans 10, 30 (two kernels side by side, 5 µs idle) and 20 µs.
    kernels = [(0.0, 10.0, "a"), (2000.0, 2010.0, "a"), (2005.0, 2025.0, "b"), (2030.0, 2030.0, "c"),
               (4000.0, 4020.0, "a")]
    replays = graph_kernels.split_replays(kernels)
    assert [len(r) for r in replays] == [1, 3, 1]
    lines = graph_kernels.report(replays, listing=True, extremes=True)
    assert lines[0] == "idle gaps per replay, us: 0.0 5.0 0.0"
    assert lines[1] == "span per replay, us: 10.0 30.0 20.0"
    headers = [line for line in lines if line.endswith("us:") and "replay," in line]
    assert headers == ["last replay, span 20.0 us:", "fastest replay, span 10.0 us:", "slowest replay, span 30.0 us:"]
    slowest = lines[lines.index("slowest replay, span 30.0 us:") + 1:]
    assert [line.split()[-1] for line in slowest] == ["a", "b", "c"] and slowest[1].split()[0] == "5.0"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_device_sweep_refuses_to_run_without_the_commit_it_records(tmp_path):
    # On the lent machines ($OUT set) git can name a stale commit: the hash must be given.
    script = ROOT / "scripts" / "sweep_h200.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHON": "false"}
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert run.returncode == 2 and "CUPY_XATTN_GIT_COMMIT" in run.stderr
    assert not any(tmp_path.iterdir())


def _pytest(*args, shard=None, deadline=None):
    """The CompletedProcess of pytest over args in the checkout, with conftest's CUPY_XATTN_TEST_SHARD
    and CUPY_XATTN_TEST_DEADLINE set to shard and deadline (None: unset, whatever this run has)."""
    settings = {"CUPY_XATTN_TEST_SHARD": shard, "CUPY_XATTN_TEST_DEADLINE": deadline}
    env = {key: value for key, value in os.environ.items() if key not in settings}
    env.update((key, value) for key, value in settings.items() if value is not None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def _collected(shard, *args):
    """(return code, test ids, output) of a pytest collection with CUPY_XATTN_TEST_SHARD=shard (None: unset)."""
    run = _pytest("--collect-only", *args, shard=shard)
    return run.returncode, [line for line in run.stdout.splitlines() if "::" in line], run.stdout + run.stderr


def test_a_test_deadline_stops_the_run_after_the_test_that_passes_it():
    # h200_check.sh's TEST_SECONDS: shards cut at a deadline still write their summaries and exit 2.
    def run(deadline):
        done = _pytest("tests/test_cases.py", deadline=deadline)
        return done.returncode, done.stdout + done.stderr
    rc, log = run("0")
    assert rc == 2 and "Interrupted: CUPY_XATTN_TEST_DEADLINE passed" in log and "\n1 passed" in log, log
    rc, log = run(str(time.time() + 3600))
    assert rc == 0 and "Interrupted" not in log and " passed" in log and "\n1 passed" not in log, log
    rc, log = run("soon")
    assert rc == 4 and "CUPY_XATTN_TEST_DEADLINE is a Unix time in seconds, not 'soon'" in log, log


def test_test_shards_partition_the_selected_tests_in_order():
    # h200_check.sh's parallel shards must run every selected test exactly once, in the suite's
    # order, in shards of equal size (taken before -k deselects, by a hook that runs too early,
    # they would be uneven), each with blocks from every part of the suite (conftest.SHARD_BLOCKS).
    import conftest
    args = ("tests/test_cases.py", "tests/test_checks.py", "-k", "test_checks")
    rc, whole, log = _collected(None, *args)
    assert rc == 0 and len(whole) > 3 * conftest.SHARD_BLOCKS * 2, log
    assert len(whole) < len(_collected(None, *args[:2])[1])  # -k deselects some
    runs = [_collected(f"{k}/3", *args) for k in range(3)]
    assert all(rc == 0 for rc, _, _ in runs), [log for _, _, log in runs]
    shards = [ids for _, ids, _ in runs]
    assert sorted(sum(shards, [])) == sorted(whole) and len(sum(shards, [])) == len(whole)
    assert all(ids == sorted(ids, key=whole.index) for ids in shards)  # each in the suite's order
    per_block = len(whole) / (3 * conftest.SHARD_BLOCKS)
    assert max(map(len, shards)) - min(map(len, shards)) <= conftest.SHARD_BLOCKS, shards
    for k, ids in enumerate(shards):  # block k of the first SHARD_BLOCKS · 3 and one in the last third
        assert whole[int(k * per_block)] in ids and any(whole.index(i) >= 2 * len(whole) // 3 for i in ids)
    rc, _, log = _collected("3/3", *args)
    assert rc != 0 and "CUPY_XATTN_TEST_SHARD is k/n" in log
