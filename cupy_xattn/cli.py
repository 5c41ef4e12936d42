"""``cupy-xattn``: info, check (correctness) and sweep (timings)."""
import importlib.metadata
import sys

import click
import numpy

from . import __version__, api, cases, checks, reference
from ._cupy import INSTALL_HINT, NoGPUError, cache_dir, require_gpu

NUMPY_HINT = "try --backend numpy on a small shape, e.g. --shape 2x64x77 --hidden-size 256 --num-heads 4"
DEFAULT_ATOL = 0.1  # check's tolerance of a --shape that is no suite's case


class NoGPU(click.ClickException):
    """Printed as one line, no traceback."""

    exit_code = 2


def _gpu_or_exit(backend):
    if backend != "cupy":
        return
    try:
        require_gpu()
    except ImportError:
        raise NoGPU(f"backend cupy needs CuPy: {INSTALL_HINT}; or {NUMPY_HINT}") from None
    except NoGPUError:
        raise NoGPU(f"no CUDA GPU found, and backend cupy needs one; {NUMPY_HINT}") from None


def _shape_case(text, atol, hidden_size, num_heads):
    """The case of a --shape: at ``atol``; or, with atol None, a suite's own case of that size
    (where the suite's hidden size and heads are these), else at DEFAULT_ATOL."""
    case = cases.parse_shape(text, atol=DEFAULT_ATOL if atol is None else atol)
    if atol is None:
        for name in cases.SUITES:
            if cases.suite_sizes(name) == (hidden_size, num_heads):
                case = next((c for c in cases.load_suite(name) if c.label == case.label), case)
    return case


def _cases(suite, shapes, atol, hidden_size, num_heads):
    """(cases, hidden_size, num_heads): suite cases, then one case per --shape (_shape_case); sizes
    not given are the suite's (else 1024 and 16). A usage error when there is no case or a size is bad."""
    default_hidden, default_heads = cases.suite_sizes(suite) if suite else (1024, 16)
    hidden_size = default_hidden if hidden_size is None else hidden_size
    num_heads = default_heads if num_heads is None else num_heads
    if hidden_size % num_heads:
        raise click.BadParameter(f"--hidden-size {hidden_size} is not divisible by --num-heads {num_heads}")
    selected = cases.load_suite(suite) if suite else []
    try:
        selected += [_shape_case(text, atol, hidden_size, num_heads) for text in shapes]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shape") from None
    if not selected:
        raise click.UsageError("give --suite or at least one --shape")
    return selected, hidden_size, num_heads


def _precisions(ctx, param, values):
    """--precision may repeat and take comma lists: 'fp32,tf32' --precision fp16."""
    chosen = [p.strip() for value in values for p in value.split(",") if p.strip()]
    bad = [p for p in chosen if p not in checks.PRECISIONS]
    if bad:
        raise click.BadParameter(f"{', '.join(bad)} not in {', '.join(checks.PRECISIONS)}")
    return tuple(dict.fromkeys(chosen))


def _problem_options(command):
    """The options check and sweep share."""
    for decorator in reversed((
        click.option("--suite", type=click.Choice(list(cases.SUITES)), help="A named suite of cases."),
        click.option("--shape", "shapes", multiple=True, metavar="BxNvxNt",
                     help="A case by size, e.g. 2x64x77; repeatable."),
        click.option("--backend", type=click.Choice(checks.BACKENDS), default="cupy", show_default=True),
        click.option("--hidden-size", type=click.IntRange(min=1),
                     help="D; default: the suite's (sol-execbench 1024, wan22-a14b 5120), else 1024."),
        click.option("--num-heads", type=click.IntRange(min=1),
                     help="H; default: the suite's (sol-execbench 16, wan22-a14b 40), else 16."),
    )):
        command = decorator(command)
    return command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cupy-xattn")
def main():
    """Cross-attention backward on NVIDIA GPUs: check correctness and time it."""


@main.command()
def info():
    """Versions, GPU and compile-cache folder."""
    try:
        import cupy
    except ImportError:
        cupy = None
    click.echo(f"cupy_xattn {__version__}")
    click.echo(f"numpy      {numpy.__version__}")
    click.echo(f"cupy       {cupy.__version__ if cupy else 'not installed (' + INSTALL_HINT + ')'}")
    click.echo(f"click      {importlib.metadata.version('click')}")
    if cupy is not None and cupy.is_available():
        for device_id in range(cupy.cuda.runtime.getDeviceCount()):
            name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"].decode()
            major, minor = cupy.cuda.Device(device_id).compute_capability
            click.echo(f"GPU {device_id}      {name}, compute capability {major}.{minor}")
    else:
        click.echo("GPU        no GPU (CuPy sees no CUDA device)" if cupy else "GPU        no GPU (no CuPy)")
    click.echo(f"cache      {cache_dir()}")


@main.command()
@_problem_options
@click.option("--precision", type=click.Choice(checks.PRECISIONS), default="tf32", show_default=True)
@click.option("--atol", type=click.FloatRange(min=0),
              help=f"Absolute tolerance of --shape cases; default: a suite's own where the shape is one of its "
                   f"cases at the same --hidden-size and --num-heads, else {DEFAULT_ATOL} (--suite cases carry "
                   f"their own).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
def check(suite, shapes, backend, hidden_size, num_heads, precision, atol, seed):
    """Compare each output with the float64 reference under the benchmark's rule.

    Exit code 1 when any output of any case fails.
    """
    selected, hidden_size, num_heads = _cases(suite, shapes, atol, hidden_size, num_heads)
    _gpu_or_exit(backend)
    failed = 0
    for case in selected:
        inputs = cases.make_inputs(case, hidden_size=hidden_size, seed=seed)
        got = api.cross_attention_backward(**inputs, num_heads=num_heads, precision=precision, backend=backend)
        ref = reference.backward(*inputs.values(), num_heads=num_heads)
        rows = cases.compare(got, ref, atol=case.atol, rtol=case.rtol, match_ratio=case.match_ratio)
        click.echo(f"case {case.label} (B x Nv x Nt), D={hidden_size}, heads={num_heads}, "
                   f"{backend}/{precision}, need {case.match_ratio:.0%} within atol + {case.rtol:g}|ref|")
        for row in rows:
            click.echo(f"  {row['name']:<22} max_abs_err {row['max_abs_err']:<10.3g} atol {row['atol']:<6g} "
                       f"match {row['match_ratio']:7.2%}  {'pass' if row['passed'] else 'FAIL'}")
        failed += sum(not row["passed"] for row in rows)
    click.echo(f"{failed} output(s) failed" if failed else "all outputs pass")
    sys.exit(1 if failed else 0)


@main.command()
@_problem_options
@click.option("--precision", "precisions", multiple=True, default=("tf32",), callback=_precisions,
              show_default=True, help=f"Repeatable or comma list of {', '.join(checks.PRECISIONS)}.")
@click.option("--reps", type=click.IntRange(min=1), default=50, show_default=True, help="Timed runs per case.")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True)
@click.option("--baselines/--no-baselines", default=False, show_default=True,
              help="Also time the baseline implementations.")
@click.option("--ceilings", is_flag=True, help="Also measure the GPU's throughput ceilings.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False, writable=True),
              help="Write the result here instead of stdout.")
def sweep(suite, shapes, backend, hidden_size, num_heads, precisions, reps, warmup, baselines, ceilings,
          fmt, out_file):
    """Time the backward over cases and precisions (median of --reps runs, cold L2).

    A progress bar goes to stderr; the table, CSV or JSON to stdout or --out.
    """
    # sweeps time, they do not judge: no tolerance needed
    selected, hidden_size, num_heads = _cases(suite, shapes, 0.0, hidden_size, num_heads)
    _gpu_or_exit(backend)
    from . import bench
    with click.progressbar(length=len(selected), label="sweep", file=sys.stderr) as bar:
        result = bench.run_sweep(selected, precisions=precisions, backend=backend, reps=reps, warmup=warmup,
                                 hidden_size=hidden_size, num_heads=num_heads, baselines=baselines,
                                 ceilings=ceilings, progress=lambda *args, **kwargs: bar.update(1))
    text = bench.format_rows(result, fmt)
    if out_file:
        with open(out_file, "w") as stream:
            stream.write(text if text.endswith("\n") else text + "\n")
    else:
        click.echo(text)
