"""Lazy access to CuPy, so that ``import cupy_xattn`` works without it and without a GPU."""
import os

import numpy

INSTALL_HINT = "pip install 'cupy-xattn[cuda12]' (CUDA 12) or 'cupy-xattn[cuda13]' (CUDA 13)"


class NoGPUError(RuntimeError):
    """CuPy is installed but sees no usable CUDA device."""


def import_cupy():
    """Return the ``cupy`` module, or raise an ImportError that names the extras to install."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"CuPy is not installed; GPU work needs it: {INSTALL_HINT}") from exc
    except OSError as exc:  # CuPy 14 creates its kernel cache folder when it is imported
        raise RuntimeError(f"CuPy failed to start: {exc}. It creates its kernel cache folder "
                           f"({cache_dir()}) on import: point CUPY_CACHE_DIR at a folder that can be "
                           "created and written") from exc
    return cupy


def cache_dir():
    """CuPy's on-disk kernel cache folder: ``CUPY_CACHE_DIR``, else CuPy's default."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def require_gpu():
    """Return the ``cupy`` module when a CUDA device is usable, else raise NoGPUError."""
    cupy = import_cupy()
    if not cupy.is_available():
        raise NoGPUError("no CUDA GPU is visible to CuPy (no device, or no driver)")
    return cupy


def to_numpy(array):
    """A NumPy array with the contents of a NumPy or CuPy ``array`` (no copy for NumPy)."""
    return array if isinstance(array, numpy.ndarray) else import_cupy().asnumpy(array)
