"""Timing harness: the SOL-ExecBench way, plus the card's ceilings and baselines.

How one implementation is timed on one case (``backend="cupy"``):

* ``NUM_INPUT_SETS`` independent input sets (and as many preallocated output
  sets, passed as ``out=``) are rotated, so every repetition sees inputs and
  outputs at other addresses than the one before it: nothing keyed on pointers
  can hit.
* ``warmup`` untimed calls, then ``reps`` timed ones. Before each timed call the
  device is synchronised, a lead kernel spins ~0.3 ms (``LEAD_CYCLES``) and L2 is
  flushed by zeroing a scratch buffer of twice the L2 size; CUDA events are
  recorded on the current stream right around the Python call. The host issues
  the call while the GPU spins, so the event span is what the benchmark times
  (first kernel start to last kernel end): the gaps between kernels count, the
  host time before the first launch does not, unless it is longer than the lead
  (eager implementations, whose host time exceeds it: their later gaps count).
* ``time.perf_counter`` around the same call (no synchronisation inside) gives
  the host time per call separately.
* Median, 20th and 80th percentiles of the event times are reported.
* After timing, the outputs are checked once for NaN/Inf (status ``"nan"``).
  Correctness is the ``check`` command's job, not this module's.

``backend="numpy"`` times the float64 reference with ``perf_counter`` only (no
events, no flush), so a machine without a GPU can see a sweep work on small
shapes.

Nothing here imports CuPy or PyTorch at import time, and PyTorch is never a
dependency: the baselines run only when ``importlib.util.find_spec("torch")``
finds it.
"""

from __future__ import annotations

import csv
import datetime
import importlib
import importlib.util
import io
import json
import math
import os
import platform
import socket
import subprocess
import time

import numpy

from . import gemm

__all__ = [
    "IMPL", "NAIVE_IMPL", "REFERENCE_IMPL", "ROW_FIELDS",
    "META_FIELDS", "run_sweep", "format_rows", "summarize", "suite_means",
    "measure_ceilings", "collect_meta",
]

IMPL = "cupy_xattn"
NAIVE_IMPL = "naive-cupy"
#: every row's ``speedup_vs_torch_tf32_graph`` is this impl's time / the row's time
REFERENCE_IMPL = "torch-tf32-graph"

#: input sets rotated through the repetitions (the largest case: ~100 MB a set)
NUM_INPUT_SETS = 4

#: which measured ceiling a precision's rows are compared with, and the divisor of its rate. Our
#: fp32 mode computes each product as three fp16 GEMMs (3xFP16), so its ceiling is a third of
#: fp16's (OWN_CEILING); the baselines' fp32 rows run IEEE FFMA.
CEILING_OF_PRECISION = {"fp32": ("fp32", 1), "tf32": ("tf32", 1), "fp16": ("fp16", 1), "bf16": ("fp16", 1)}
OWN_CEILING = {"fp32": ("fp16", 3)}

ROW_FIELDS = (
    "batch_size", "num_video_tokens", "num_text_tokens", "precision", "impl",
    "median_us", "p20_us", "p80_us", "host_us", "gflop", "tflops",
    "fraction_of_ceiling", "speedup_vs_torch_tf32_graph", "reps", "timer",
    "status",
)
META_FIELDS = (
    "device", "driver_version", "cuda_runtime_version", "cupy_version",
    "numpy_version", "torch_version", "git_commit", "date_utc", "hostname",
)

# --------------------------------------------------------------------------
# statistics and derived numbers (pure Python, tested on CPU)

def summarize(samples_us):
    """Median and 20th/80th percentiles (linear interpolation) of timings.

    Parameters
    ----------
    samples_us : sequence of float
        One timing per repetition, in microseconds.

    Returns
    -------
    dict
        ``{"median_us": float, "p20_us": float, "p80_us": float}``.
    """
    a = numpy.asarray(samples_us, dtype=numpy.float64)
    if a.size == 0:
        raise ValueError("summarize() needs at least one timing")
    p20, p50, p80 = numpy.percentile(a, [20.0, 50.0, 80.0])
    return {"median_us": p50.item(), "p20_us": p20.item(), "p80_us": p80.item()}


def _tflops(flop, time_us):
    # TFLOP/s = FLOP / seconds / 1e12 = FLOP / (time_us * 1e-6) / 1e12,
    # FLOP from cases.flops (WORKLOAD.md: 10·Mv·D² + 12·Mt·D² + 12·Mv·Nt·D)
    if time_us is None or not time_us > 0:
        return None
    return flop / (time_us * 1e-6) / 1e12


def _ceiling_tflops(ceilings, precision, impl=IMPL):
    if not ceilings:
        return None
    name, divisor = (OWN_CEILING.get(precision) if impl == IMPL else None) or CEILING_OF_PRECISION.get(
        precision, (precision, 1))
    entry = ceilings.get(name)
    if not isinstance(entry, dict):
        return None
    value = entry.get("tflops")
    return value / divisor if value else None


def _case_key(row):
    return (row["batch_size"], row["num_video_tokens"], row["num_text_tokens"])


def _ok(row):
    return row.get("status") == "ok" and row.get("median_us") is not None


def _fill_derived(rows, ceilings):
    """Per row: TFLOP/s, fraction of the ceiling, speedup vs torch-tf32-graph."""
    reference = {_case_key(r): r["median_us"] for r in rows
                 if r["impl"] == REFERENCE_IMPL and _ok(r)}
    for r in rows:
        t = r.get("median_us") if _ok(r) or r.get("status") == "nan" else None
        r["tflops"] = _tflops(r["gflop"] * 1e9, t) if t else None
        ceiling = _ceiling_tflops(ceilings, r["precision"], r["impl"])
        r["fraction_of_ceiling"] = (r["tflops"] / ceiling
                                    if r["tflops"] and ceiling else None)
        ref = reference.get(_case_key(r))
        r["speedup_vs_torch_tf32_graph"] = ref / t if ref and t else None
    return rows


def suite_means(rows):
    """Suite means per (precision, impl), over the cases that timed ``ok``.

    Returns
    -------
    list of dict
        One dict per (precision, impl) in first-seen order: ``n_cases``,
        ``mean_us`` (arithmetic mean of the per-case medians, the benchmark's
        score), ``mean_host_us``, ``mean_tflops``, ``mean_fraction_of_ceiling``
        and ``speedup_vs_torch_tf32_graph`` (mean torch-tf32-graph time over the
        mean time, on the cases both have; None without that baseline).
    """
    groups = {}
    for r in rows:
        if _ok(r):
            groups.setdefault((r["precision"], r["impl"]), []).append(r)
    reference = {_case_key(r): r["median_us"] for r in rows
                 if r["impl"] == REFERENCE_IMPL and _ok(r)}

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    means = []
    for (precision, impl), group in groups.items():
        shared = [r for r in group if _case_key(r) in reference]
        speedup = None
        if shared:
            speedup = (mean([reference[_case_key(r)] for r in shared])
                       / mean([r["median_us"] for r in shared]))
        means.append({
            "precision": precision,
            "impl": impl,
            "n_cases": len(group),
            "mean_us": mean([r["median_us"] for r in group]),
            "mean_host_us": mean([r.get("host_us") for r in group]),
            "mean_tflops": mean([r.get("tflops") for r in group]),
            "mean_fraction_of_ceiling": mean(
                [r.get("fraction_of_ceiling") for r in group]),
            "speedup_vs_torch_tf32_graph": speedup,
        })
    return means


# --------------------------------------------------------------------------
# metadata

def _git_commit():
    """Short commit of the checkout: $CUPY_XATTN_GIT_COMMIT, git, .git files, or "unknown"."""
    env = os.environ.get("CUPY_XATTN_GIT_COMMIT")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # safe.directory: a checkout copied onto another machine belongs to another user
    git = ["git", "-c", "safe.directory=*"]
    try:
        out = subprocess.run(git + ["rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            commit = out.stdout.strip()
            dirty = subprocess.run(git + ["diff", "--quiet", "HEAD", "--"],
                                   cwd=root, capture_output=True, timeout=10)
            return commit + ("+dirty" if dirty.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return _git_commit_from_files(os.path.join(root, ".git")) or "unknown"


def _git_commit_from_files(git_dir):
    """HEAD read from the .git folder itself (no git binary needed)."""
    try:
        with open(os.path.join(git_dir, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head[:7] or None
        ref = head[4:].strip()
        ref_path = os.path.join(git_dir, *ref.split("/"))
        if os.path.exists(ref_path):
            with open(ref_path) as f:
                return f.read().strip()[:7] or None
        with open(os.path.join(git_dir, "packed-refs")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0][:7]
    except OSError:
        pass
    return None


def _cuda_version_string(v):
    # CUDA encodes versions as 1000*major + 10*minor
    return f"{v // 1000}.{(v % 1000) // 10}"


def collect_meta(backend="cupy", *, torch_module=None):
    """Where and with what a sweep ran: device, versions, commit, date, host.

    Queries the GPU only for ``backend="cupy"``.
    """
    meta = dict.fromkeys(META_FIELDS)
    meta["numpy_version"] = numpy.__version__
    meta["git_commit"] = _git_commit()
    meta["date_utc"] = (datetime.datetime.now(datetime.timezone.utc)
                        .replace(microsecond=0).isoformat())
    meta["hostname"] = socket.gethostname()
    meta["python_version"] = platform.python_version()
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy
            meta["cupy_version"] = cupy.__version__
        except Exception:  # a broken CuPy install must not stop a numpy sweep
            pass
    if torch_module is not None:
        meta["torch_version"] = torch_module.__version__
    if backend == "numpy":
        meta["device"] = f"CPU ({platform.processor() or platform.machine()}), numpy float64 reference"
        return meta
    import cupy
    runtime = cupy.cuda.runtime
    device_id = cupy.cuda.Device().id
    props = runtime.getDeviceProperties(device_id)
    name = props["name"]
    meta["device"] = name.decode() if isinstance(name, bytes) else str(name)
    meta["compute_capability"] = f"{props['major']}.{props['minor']}"
    meta["multiprocessors"] = int(props["multiProcessorCount"])
    meta["l2_bytes"] = int(props["l2CacheSize"])
    meta["memory_bytes"] = int(props["totalGlobalMem"])
    meta["driver_version"] = _cuda_version_string(runtime.driverGetVersion())
    meta["cuda_runtime_version"] = _cuda_version_string(runtime.runtimeGetVersion())
    return meta


# --------------------------------------------------------------------------
# GPU plumbing (imports CuPy lazily)

def _require_gpu():
    """Import CuPy and make sure a CUDA device is there, before any work."""
    hint = ("use --backend numpy to time the float64 reference on small "
            "shapes on this machine")
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"no CUDA GPU found: CuPy is not importable ({exc}); "
                           f"{hint}") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cudaErrorInsufficientDriver / NoDevice on GPU-less hosts
        raise RuntimeError(f"no CUDA GPU found: {type(exc).__name__}: {exc}; "
                           f"{hint}") from exc
    if count < 1:
        raise RuntimeError(f"no CUDA GPU found: CUDA reports 0 devices; {hint}")
    return cupy


#: GPU clock cycles of the lead kernel before each timed call (~0.3 ms at the H200's clocks).
LEAD_CYCLES = 600_000

#: a kernel ``lead(cycles)`` that spins for that many GPU clock cycles (also used by probes and tests).
LEAD_SOURCE = r"""extern "C" __global__ void lead(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}"""


class _Flusher:
    """Before a timed call, on a stream: a lead kernel that spins LEAD_CYCLES, then zeroes a
    scratch buffer of 2x L2. While the GPU spins, the host issues the call, so the timed span
    (start event after the flush to end event) holds the call's GPU work and the gaps between its
    kernels, not the host time before its first launch: what the benchmark's harness times."""

    def __init__(self, cupy):
        self._cupy = cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.l2_bytes = int(props["l2CacheSize"])
        self.nbytes = max(2 * self.l2_bytes, 1 << 20)
        self.buffer = cupy.empty(self.nbytes, dtype=cupy.uint8)
        self._lead = cupy.RawKernel(LEAD_SOURCE, "lead")

    def lead(self, stream_ptr=None):
        """The spin kernel on the stream at ``stream_ptr`` (default: CuPy's current stream)."""
        stream = (self._cupy.cuda.get_current_stream() if stream_ptr is None
                  else self._cupy.cuda.ExternalStream(stream_ptr))
        with stream:
            self._lead((1,), (1,), (numpy.int64(LEAD_CYCLES),))

    def __call__(self):
        self.lead()
        self.buffer.data.memset_async(0, self.nbytes)


def _event_timing(call, *, n, warmup, reps, flush, new_event, record,
                  elapsed_ms, synchronize, prepare=None):
    """Time ``call(i)`` (i = repetition index) with events and perf_counter.

    Returns (gpu_us list, host_us list). ``prepare(i)`` runs untimed before
    each call (e.g. copying inputs into a CUDA graph's static buffers).
    """
    for i in range(warmup):
        if prepare is not None:
            prepare(i % n)
        call(i % n)
    synchronize()
    starts = [new_event() for _ in range(reps)]
    ends = [new_event() for _ in range(reps)]
    host_us = []
    for r in range(reps):
        i = (warmup + r) % n
        if prepare is not None:
            prepare(i)
        synchronize()
        flush()                # lead spin + L2 flush: the host issues the call meanwhile
        record(starts[r])
        t0 = time.perf_counter()
        call(i)
        t1 = time.perf_counter()
        record(ends[r])
        host_us.append((t1 - t0) * 1e6)
    synchronize()
    gpu_us = [elapsed_ms(s, e) * 1e3 for s, e in zip(starts, ends)]
    return gpu_us, host_us


def _cupy_timing(cupy, flusher, call, *, n, warmup, reps, prepare=None):
    stream = cupy.cuda.get_current_stream()
    return _event_timing(
        call, n=n, warmup=warmup, reps=reps, flush=flusher,
        new_event=lambda: cupy.cuda.Event(),
        record=lambda ev: ev.record(stream),
        elapsed_ms=cupy.cuda.get_elapsed_time,
        synchronize=stream.synchronize, prepare=prepare)


def _all_finite_cupy(cupy, arrays):
    return all(bool(cupy.isfinite(a).all()) for a in arrays)


# --------------------------------------------------------------------------
# ceilings

def _gemm_ceiling(cupy, *, n, dtype, compute_type, reps=10, warmup=3):
    """Square n x n x n GEMM through cublasGemmEx (``gemm.matmul``); returns TFLOP/s and time."""
    a = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
    b = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
    c = cupy.empty((n, n), dtype=dtype)
    gpu_us, _ = _cupy_timing(cupy, lambda: None, lambda _: gemm.matmul(a, b, c, compute=compute_type),
                             n=1, warmup=warmup, reps=reps)
    med = summarize(gpu_us)["median_us"]
    # GEMM FLOP = 2·m·n·k
    return {"tflops": _tflops(2.0 * n * n * n, med), "median_us": med,
            "m": n, "n": n, "k": n}


def _copy_ceiling(cupy, *, nbytes=1 << 30, reps=10, warmup=3):
    """Device-to-device copy; bandwidth counts bytes read + bytes written."""
    src = cupy.random.standard_normal(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    gpu_us, _ = _cupy_timing(cupy, lambda: None, lambda _: dst.data.copy_from_device_async(src.data, src.nbytes),
                             n=1, warmup=warmup, reps=reps)
    med = summarize(gpu_us)["median_us"]
    return {"gbps": 2.0 * src.nbytes / (med * 1e-6) / 1e9, "median_us": med,
            "bytes": int(src.nbytes)}


def measure_ceilings(cupy=None):
    """Measure this card as found: GEMM TFLOP/s (fp32, TF32, fp16) and copy GB/s.

    fp32: cublasGemmEx, fp32 data, CUBLAS_COMPUTE_32F (68), 4096^3.
    tf32: fp32 data, CUBLAS_COMPUTE_32F_FAST_TF32 (77), 8192^3.
    fp16: fp16 operands and output, fp32 accumulation (68), 8192^3.
    copy: 1 GiB device-to-device memcpy, (read + written bytes) / time.
    Random data throughout. A measurement that fails is recorded with its error.
    """
    if cupy is None:
        cupy = _require_gpu()
    result = {}
    plan = (("fp32", 4096, cupy.float32, gemm.COMPUTE_32F),
            ("tf32", 8192, cupy.float32, gemm.COMPUTE_32F_FAST_TF32),
            ("fp16", 8192, cupy.float16, gemm.COMPUTE_32F))
    for key, n, dtype, compute in plan:
        try:
            result[key] = _gemm_ceiling(cupy, n=n, dtype=dtype, compute_type=compute)
        except Exception as exc:
            result[key] = {"tflops": None, "error": f"{type(exc).__name__}: {exc}"}
        cupy.get_default_memory_pool().free_all_blocks()
    try:
        result["copy"] = _copy_ceiling(cupy)
    except Exception as exc:
        result["copy"] = {"gbps": None, "error": f"{type(exc).__name__}: {exc}"}
    cupy.get_default_memory_pool().free_all_blocks()
    return result


# --------------------------------------------------------------------------
# the rows

def _new_row(case, precision, impl, gflop, reps, timer):
    return {
        "batch_size": int(case.batch_size),
        "num_video_tokens": int(case.num_video_tokens),
        "num_text_tokens": int(case.num_text_tokens),
        "precision": precision, "impl": impl,
        "median_us": None, "p20_us": None, "p80_us": None, "host_us": None,
        "gflop": gflop, "tflops": None, "fraction_of_ceiling": None,
        "speedup_vs_torch_tf32_graph": None, "reps": reps, "timer": timer,
        "status": "ok",
    }


def _error_status(exc):
    msg = " ".join(str(exc).split())
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"error: {type(exc).__name__}: {msg}"


def _set_timings(row, gpu_us, host_us):
    row.update(summarize(gpu_us))
    row["host_us"] = summarize(host_us)["median_us"]


def _measure(row, body):
    """Run ``body()`` -> (gpu_us, host_us, finite); record errors in the row."""
    try:
        gpu_us, host_us, finite = body()
    except Exception as exc:  # one failing impl must not end a 10-minute sweep
        row["status"] = _error_status(exc)
        return row
    _set_timings(row, gpu_us, host_us)
    row["status"] = "ok" if finite else "nan"
    return row


def _default_scale(hidden_size, num_heads):
    return 1.0 / math.sqrt(hidden_size // num_heads)


def _sweep_numpy(cases_list, *, precisions, reps, warmup, hidden_size,
                 num_heads, progress):
    import cupy_xattn
    from cupy_xattn import cases as cases_mod
    rows = []
    scale = _default_scale(hidden_size, num_heads)
    for case in cases_list:
        args = list(cases_mod.make_inputs(case, hidden_size=hidden_size, seed=0,
                                          xp=numpy).values())
        gflop = cases_mod.flops(case.batch_size, case.num_video_tokens,
                                case.num_text_tokens, hidden_size) / 1e9
        for precision in precisions:
            row = _new_row(case, precision, IMPL, gflop, reps, "perf_counter")

            def body():
                result = None
                for _ in range(warmup):
                    cupy_xattn.cross_attention_backward(
                        *args, scale, num_heads=num_heads, precision=precision,
                        backend="numpy")
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    result = cupy_xattn.cross_attention_backward(
                        *args, scale, num_heads=num_heads, precision=precision,
                        backend="numpy")
                    times.append((time.perf_counter() - t0) * 1e6)
                finite = all(bool(numpy.isfinite(numpy.asarray(g)).all())
                             for g in result)
                return times, times, finite

            rows.append(_measure(row, body))
        if progress is not None:
            progress(case)
    return rows


def _import_naive():
    try:
        return importlib.import_module("cupy_xattn.naive"), None
    except ImportError as exc:
        return None, f"{NAIVE_IMPL} skipped: cupy_xattn.naive not importable ({exc})"


def _import_torch():
    if importlib.util.find_spec("torch") is None:
        return None, "torch baselines skipped: PyTorch is not installed"
    try:
        import torch
    except Exception as exc:
        return None, f"torch baselines skipped: import torch failed ({exc})"
    if not torch.cuda.is_available():
        return None, "torch baselines skipped: torch.cuda.is_available() is False"
    return torch, None


def _sweep_cupy(cases_list, *, precisions, reps, warmup, hidden_size,
                num_heads, baselines, progress, cupy, torch, naive):
    import cupy_xattn
    from cupy_xattn import cases as cases_mod
    pool = cupy.get_default_memory_pool()
    flusher = _Flusher(cupy)
    scale = _default_scale(hidden_size, num_heads)
    rows = []
    n = NUM_INPUT_SETS
    for case_index, case in enumerate(cases_list):
        gflop = cases_mod.flops(case.batch_size, case.num_video_tokens,
                                case.num_text_tokens, hidden_size) / 1e9
        sets = [list(cases_mod.make_inputs(case, hidden_size=hidden_size,
                                           seed=1000 * case_index + s,
                                           xp=cupy).values())
                for s in range(n)]
        # outputs have the shapes of X, T, Wq, bq, Wk, bk, Wv, bv, Wo, bo
        outs = [tuple(cupy.empty_like(a) for a in args[1:]) for args in sets]
        cupy.cuda.get_current_stream().synchronize()

        for precision in precisions:
            row = _new_row(case, precision, IMPL, gflop, reps, "cuda-events")

            def body():
                def call(i):
                    cupy_xattn.cross_attention_backward(
                        *sets[i], scale, num_heads=num_heads,
                        precision=precision, backend="cupy", out=outs[i])
                gpu_us, host_us = _cupy_timing(cupy, flusher, call, n=n,
                                               warmup=warmup, reps=reps)
                finite = all(_all_finite_cupy(cupy, o) for o in outs)
                return gpu_us, host_us, finite

            rows.append(_measure(row, body))

            if baselines and naive is not None:
                row = _new_row(case, precision, NAIVE_IMPL, gflop, reps,
                               "cuda-events")
                last = {}

                def body():
                    def call(i):
                        last["grads"] = naive.backward(
                            sets[i], precision=precision, num_heads=num_heads,
                            scale=scale)
                    gpu_us, host_us = _cupy_timing(cupy, flusher, call, n=n,
                                                   warmup=warmup, reps=reps)
                    return gpu_us, host_us, _all_finite_cupy(cupy, last["grads"])

                rows.append(_measure(row, body))
                last.clear()

        if baselines and torch is not None:
            rows.extend(_torch_rows(torch, cupy, flusher, case, sets, gflop,
                                    scale=scale, num_heads=num_heads,
                                    warmup=warmup, reps=reps))
        del sets, outs
        cupy.cuda.get_current_stream().synchronize()
        pool.free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
        if progress is not None:
            progress(case)
    return rows


# --------------------------------------------------------------------------
# PyTorch baselines (autograd of the same layer)

def _torch_layer(torch, x, t, wq, bq, wk, bk, wv, bv, wo, bo, *, scale,
                 num_heads):
    F = torch.nn.functional
    batch, nv, d = x.shape
    nt = t.shape[1]
    hd = d // num_heads
    q = F.linear(x, wq, bq).view(batch, nv, num_heads, hd).transpose(1, 2)
    k = F.linear(t, wk, bk).view(batch, nt, num_heads, hd).transpose(1, 2)
    v = F.linear(t, wv, bv).view(batch, nt, num_heads, hd).transpose(1, 2)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, v).transpose(1, 2).reshape(batch, nv, d)
    return F.linear(o, wo, bo)


def _torch_grads(torch, args, *, scale, num_heads):
    """Forward recompute + autograd backward: the grads of X, T and 8 params.

    The layer's backward from its inputs alone needs the forward's saved
    tensors, so the torch rows time forward + backward (our function
    recomputes the forward inside the backward as well).
    """
    dy, leaves = args[0], args[1:]
    y = _torch_layer(torch, *leaves, scale=scale, num_heads=num_heads)
    return torch.autograd.grad(y, leaves, grad_outputs=dy)


def _set_torch_tf32(torch, enabled):
    """Set TF32 for cuBLAS matmuls; returns a callable restoring the old state.

    torch >= 2.9 has ``fp32_precision`` and raises if the legacy ``allow_tf32``
    and the new API are mixed, so only one of them is touched. cuDNN is not
    used by this layer (no convolutions), so its flag is left alone.
    """
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        old = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"

        def restore():
            matmul.fp32_precision = old
    else:
        old = matmul.allow_tf32
        matmul.allow_tf32 = enabled

        def restore():
            matmul.allow_tf32 = old
    return restore


def _torch_timing(torch, flush, call, *, n, warmup, reps, prepare=None):
    def record(ev):
        ev.record(torch.cuda.current_stream())
    return _event_timing(
        call, n=n, warmup=warmup, reps=reps, flush=flush,
        new_event=lambda: torch.cuda.Event(enable_timing=True),
        record=record, elapsed_ms=lambda s, e: s.elapsed_time(e),
        synchronize=torch.cuda.current_stream().synchronize, prepare=prepare)


def _torch_rows(torch, cupy, flusher, case, sets, gflop, *, scale, num_heads,
                warmup, reps):
    cupy.cuda.get_current_stream().synchronize()   # inputs written by CuPy
    n = len(sets)
    # zero-copy views of CuPy's input sets and of the flush buffer
    tsets = []
    for args in sets:
        ts = [torch.from_dlpack(a) for a in args]
        tsets.append([ts[0]] + [a.detach().requires_grad_(True) for a in ts[1:]])
    scratch = torch.from_dlpack(flusher.buffer)

    def flush():
        flusher.lead(torch.cuda.current_stream().cuda_stream)
        scratch.zero_()

    rows = []
    for mode in ("fp32", "tf32"):
        restore = _set_torch_tf32(torch, mode == "tf32")
        try:
            # eager: every repetition on another input set
            row = _new_row(case, mode, f"torch-{mode}-eager", gflop, reps,
                           "cuda-events")
            last = {}

            def body():
                def call(i):
                    last["grads"] = _torch_grads(torch, tsets[i], scale=scale,
                                                 num_heads=num_heads)
                gpu_us, host_us = _torch_timing(torch, flush, call, n=n,
                                                warmup=warmup, reps=reps)
                finite = all(bool(torch.isfinite(g).all()) for g in last["grads"])
                return gpu_us, host_us, finite

            rows.append(_measure(row, body))
            last.clear()

            # graph: forward + backward captured once, replayed; the next input
            # set is copied into the static inputs before each (untimed) replay
            row = _new_row(case, mode, f"torch-{mode}-graph", gflop, reps,
                           "cuda-events")
            holder = {}

            def body():
                static = [a.detach().clone().requires_grad_(i > 0)
                          for i, a in enumerate(tsets[0])]
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        _torch_grads(torch, static, scale=scale,
                                     num_heads=num_heads)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    grads = _torch_grads(torch, static, scale=scale,
                                         num_heads=num_heads)
                holder["graph"], holder["grads"] = graph, grads

                def prepare(i):
                    with torch.no_grad():
                        for dst, src in zip(static, tsets[i]):
                            dst.copy_(src)

                gpu_us, host_us = _torch_timing(
                    torch, flush, lambda i: graph.replay(), n=n,
                    warmup=warmup, reps=reps, prepare=prepare)
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
                return gpu_us, host_us, finite

            rows.append(_measure(row, body))
            holder.clear()
        finally:
            restore()
    torch.cuda.synchronize()
    return rows


# --------------------------------------------------------------------------
# the sweep

def run_sweep(cases, *, precisions=("tf32",), backend="cupy", reps=50,
              warmup=10, hidden_size=1024, num_heads=16, baselines=False,
              ceilings=False, progress=None):
    """Time ``cross_attention_backward`` over cases and precisions.

    Parameters
    ----------
    cases : iterable of cupy_xattn.cases.Case
        The shapes (``batch_size``, ``num_video_tokens``, ``num_text_tokens``).
    precisions : sequence of str
        Precisions passed to ``cross_attention_backward``.
    backend : {"cupy", "numpy"}
        ``"cupy"``: GPU timing with CUDA events, L2 flush and input rotation.
        ``"numpy"``: host timing of the float64 reference (no GPU needed).
    reps, warmup : int
        Timed and untimed repetitions per (case, precision, impl).
    hidden_size, num_heads : int
        D and H of the layer (head_dim = D / H; scale = 1/sqrt(head_dim)).
    baselines : bool
        Also time PyTorch autograd of the same layer (fp32 and TF32, eager and
        CUDA graph; only when PyTorch is installed) and ``cupy_xattn.naive``
        (when it exists). GPU only.
    ceilings : bool
        Measure the card's GEMM TFLOP/s (fp32, TF32, fp16) and copy GB/s first;
        rows then carry their fraction of the ceiling. GPU only.
    progress : callable, optional
        Called as ``progress(case)`` once per finished case.

    Returns
    -------
    dict
        ``{"meta": dict, "rows": list of dict, "ceilings": dict or None,
        "means": list of dict}``; plain Python values only (JSON-ready).

    Raises
    ------
    RuntimeError
        ``backend="cupy"`` on a machine without a usable CUDA GPU.
    """
    if backend not in ("cupy", "numpy"):
        raise ValueError(f"backend must be 'cupy' or 'numpy', got {backend!r}")
    if isinstance(precisions, str):
        precisions = (precisions,)
    precisions = tuple(precisions)
    if not precisions:
        raise ValueError("precisions must name at least one precision")
    if int(reps) < 1 or int(warmup) < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps}, "
                         f"warmup={warmup}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of "
                         f"num_heads ({num_heads})")
    reps, warmup = int(reps), int(warmup)
    cases_list = list(cases)
    settings = {
        "backend": backend, "precisions": list(precisions), "reps": reps,
        "warmup": warmup, "hidden_size": int(hidden_size),
        "num_heads": int(num_heads), "baselines": bool(baselines),
        "ceilings": bool(ceilings), "n_cases": len(cases_list),
    }
    notes = []
    measured = None

    if backend == "numpy":
        if baselines or ceilings:
            notes.append("baselines and ceilings need the GPU; skipped with "
                         "backend='numpy'")
        meta = collect_meta("numpy")
        rows = _sweep_numpy(cases_list, precisions=precisions, reps=reps,
                            warmup=warmup, hidden_size=hidden_size,
                            num_heads=num_heads, progress=progress)
    else:
        cupy = _require_gpu()
        torch = naive = None
        if baselines:
            naive, why = _import_naive()
            if why:
                notes.append(why)
            torch, why = _import_torch()
            if why:
                notes.append(why)
        meta = collect_meta("cupy", torch_module=torch)
        if torch is not None:
            meta["torch_cuda_version"] = torch.version.cuda
        settings.update(input_sets=NUM_INPUT_SETS,
                        flush_bytes=max(2 * meta["l2_bytes"], 1 << 20),
                        lead_cycles=LEAD_CYCLES,
                        stream="CuPy's current stream; torch's current stream "
                               "for torch rows")
        if ceilings:
            measured = measure_ceilings(cupy)
        rows = _sweep_cupy(cases_list, precisions=precisions, reps=reps,
                           warmup=warmup, hidden_size=hidden_size,
                           num_heads=num_heads, baselines=baselines,
                           progress=progress, cupy=cupy, torch=torch,
                           naive=naive)
    meta["settings"] = settings
    meta["notes"] = notes
    _fill_derived(rows, measured)
    return _jsonable({"meta": meta, "rows": rows, "ceilings": measured,
                      "means": suite_means(rows)})


# --------------------------------------------------------------------------
# output

def _jsonable(obj):
    """Plain Python values: NumPy scalars via .item(), non-finite floats -> None."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, numpy.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


_TABLE_COLUMNS = (
    # header, row key, digits
    ("B", "batch_size", 0), ("Nv", "num_video_tokens", 0),
    ("Nt", "num_text_tokens", 0), ("precision", "precision", 0),
    ("impl", "impl", 0), ("median_us", "median_us", 1), ("p20_us", "p20_us", 1),
    ("p80_us", "p80_us", 1), ("host_us", "host_us", 1), ("TFLOP/s", "tflops", 1),
    ("of_ceiling", "fraction_of_ceiling", 3),
    ("x_vs_torch_tf32_graph", "speedup_vs_torch_tf32_graph", 2),
    ("status", "status", 0),
)
_MEANS_COLUMNS = (
    ("precision", "precision", 0), ("impl", "impl", 0), ("cases", "n_cases", 0),
    ("mean_us", "mean_us", 1), ("mean_host_us", "mean_host_us", 1),
    ("mean_TFLOP/s", "mean_tflops", 1),
    ("mean_of_ceiling", "mean_fraction_of_ceiling", 3),
    ("x_vs_torch_tf32_graph", "speedup_vs_torch_tf32_graph", 2),
)


_TEXT_KEYS = ("precision", "impl", "status")
_MAX_CELL = 100   # long error messages: the JSON/CSV keep them whole


def _text_table(records, columns):
    cells = [[header for header, _, _ in columns]]
    for rec in records:
        cells.append([_fmt(rec.get(key), digits)[:_MAX_CELL] for _, key, digits in columns])
    widths = [max(len(row[j]) for row in cells) for j in range(len(columns))]
    lines = []
    for i, row in enumerate(cells):
        lines.append("  ".join(
            c.ljust(w) if columns[j][1] in _TEXT_KEYS else c.rjust(w)
            for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ceilings_lines(ceilings):
    lines = []
    for key in ("fp32", "tf32", "fp16"):
        entry = ceilings.get(key) or {}
        if entry.get("tflops"):
            lines.append(f"  {key} GEMM {entry['m']}x{entry['n']}x{entry['k']}: "
                         f"{entry['tflops']:.1f} TFLOP/s")
        else:
            lines.append(f"  {key} GEMM: not measured ({entry.get('error', '-')})")
    copy = ceilings.get("copy") or {}
    if copy.get("gbps"):
        lines.append(f"  copy {copy['bytes'] / 2**30:.0f} GiB device-to-device: "
                     f"{copy['gbps']:.0f} GB/s (read + written)")
    else:
        lines.append(f"  copy: not measured ({copy.get('error', '-')})")
    return lines


def format_rows(result, fmt="table"):
    """Render a ``run_sweep`` result as ``"table"``, ``"csv"`` or ``"json"``.

    The CSV has one line per row, the meta fields repeated on every line; the
    JSON is the whole result (meta, rows, ceilings, means); the table is for
    reading, floats rounded.
    """
    if fmt == "json":
        return json.dumps(_jsonable(result), indent=1)
    meta = result.get("meta") or {}
    rows = result.get("rows") or []
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(ROW_FIELDS + META_FIELDS)
        for r in rows:
            writer.writerow([_csv_cell(r.get(k)) for k in ROW_FIELDS]
                            + [_csv_cell(meta.get(k)) for k in META_FIELDS])
        return buf.getvalue()
    if fmt != "table":
        raise ValueError(f"fmt must be 'table', 'csv' or 'json', got {fmt!r}")
    out = []
    out.append(f"device: {meta.get('device')}  driver {meta.get('driver_version')}"
               f"  CUDA runtime {meta.get('cuda_runtime_version')}")
    out.append(f"cupy {meta.get('cupy_version')}  numpy {meta.get('numpy_version')}"
               f"  torch {meta.get('torch_version') or '-'}  commit "
               f"{meta.get('git_commit')}  {meta.get('date_utc')}  "
               f"{meta.get('hostname')}")
    settings = meta.get("settings") or {}
    if settings:
        out.append(f"backend {settings.get('backend')}  reps {settings.get('reps')}"
                   f"  warmup {settings.get('warmup')}  D {settings.get('hidden_size')}"
                   f"  H {settings.get('num_heads')}")
    for note in meta.get("notes") or []:
        out.append(f"note: {note}")
    out.append("")
    out.append(_text_table(rows, _TABLE_COLUMNS))
    means = result.get("means")
    if means is None:
        means = suite_means(rows)
    if means:
        out.append("")
        out.append("suite means (over the cases that timed ok)")
        out.append(_text_table(means, _MEANS_COLUMNS))
    if result.get("ceilings"):
        out.append("")
        out.append("ceilings measured on this card")
        out.extend(_ceilings_lines(result["ceilings"]))
    return "\n".join(out) + "\n"


def _csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, numpy.generic):
        value = value.item()
    if isinstance(value, float):
        return repr(round(value, 4))
    return value
