"""Launcher of ``kernels_cu/half_scaling.cu``: fp16 copies (and remainders) with per-tensor power-of-two scales."""

import math

import numpy

from . import kernels
from ._cupy import import_cupy

SOURCE = "half_scaling.cu"
_THREADS = 256
_QUADS_PER_THREAD = 8  # float4s a thread of the copy takes at least: two rounds of HALF_UNROLL


def _blocks(sizes, sum_cols, sm_count):
    """Blocks of one group's copy: enough for its largest tensor at _QUADS_PER_THREAD float4s a
    thread, at most two per SM, rounded up so that blocks · threads is a multiple of cols / 4 for
    each row length in ``sum_cols`` (the tensors given column sums: see half_scaling.cu). On the
    small cases a group's grid is its largest tensor's blocks times its tensors (eight before the
    attention): at one float4 a thread, two waves of blocks where one serves (perf-notes v50)."""
    blocks = max(1, min(-(-max(sizes) // 4 // (_THREADS * _QUADS_PER_THREAD)), 2 * sm_count))
    step = math.lcm(1, *(cols // 4 // math.gcd(cols // 4, _THREADS) for cols in sum_cols))
    return -(-blocks // step) * step


def _rescale_blocks(sm_count):
    """Blocks of a rescale: one per two SMs. When the guesses stand (the usual run) its blocks but
    block 0 only check and leave, yet each needs a slot on an SM; beside a GEMM that holds the SMs
    (the half modes' dWo beside the second conversion) 264 blocks waited for slots (16.9 µs on the
    fp16 64x128x77 trace against ~2.5 alone). 66 blocks on the H200: fp16 suite −1.3 µs
    (docs/perf-notes.md, v41). A rewrite (when a max leaves its window) has a quarter of the blocks
    that two per SM gave it, so fewer loads in flight: slower, by how much not measured."""
    return max(1, sm_count // 2)


def column_sum_rows(sizes, sum_cols, sm_count):
    """Rows of partial column sums that a group of tensors of ``sizes`` writes for a tensor of row length
    ``cols`` in ``sum_cols`` (the row lengths of the group's tensors with column sums, in order)."""
    threads = _blocks(sizes, sum_cols, sm_count) * _THREADS
    return [4 * threads // cols for cols in sum_cols]


class HalfScaler:
    """Scaled fp16 copies of fp32 tensors, each tensor (or group of tensors) in a numbered slot.

    Per run, for each :meth:`group` of tensors: its ``copy`` and ``rescale`` launches (together
    ``y = half(x · s_slot)`` and, where asked, the remainder ``half(x · s_slot − y)``; ``rescale``
    then updates the alphas; the launches of all groups run in stream order, one after the other:
    each reads the state the previous ones wrote). ``alpha(i, j)`` is the device address
    of ``1 / (s_i · s_j)``, the alpha that undoes the scaling of a GEMM of slots i and j. Nothing
    is read back to the host, so a run can be captured into a graph.
    """

    def __init__(self, n_slots, sm_count):
        if not 1 <= n_slots <= _THREADS:
            raise ValueError(f"a scaler holds 1 to {_THREADS} slots (half_rescale), got {n_slots}")
        cupy = import_cupy()
        self.n_slots = n_slots
        self._sm_count = sm_count
        # One buffer, n entries per part (half_scaling.cu's ScalerState): two buffers of amax bits
        # (zero at first: each copy clears the one its slot's next copy takes), inverse scales, the
        # scales guessed for the next copies (the last ones found), the scales the last copies took
        # (all 1 at first), the amax buffer each slot's next copy takes and the one its last copy
        # took (0 at first), then the n × n alphas (1 at first, as the inverse scales).
        n = n_slots
        self._state = cupy.zeros(7 * n + n * n, numpy.float32)
        self._state[2 * n:5 * n] = 1.0
        self._state[7 * n:] = 1.0
        self._copy = kernels.get_kernel(SOURCE, "half_copy_absmax")
        self._rescale = kernels.get_kernel(SOURCE, "half_rescale")
        self._groups = []  # keeps each group's metadata alive

    def group(self, sources_address, tensors, product_bias=None):
        """Launchers ``(copy, rescale)`` for several tensors at once.

        Parameters
        ----------
        sources_address : device address of consecutive addresses of the fp32 sources (and, with
            ``product_bias``, of that bias after them).
        tensors : list of ``(size, dest, slot, lo, sums, cols[, parts, part_stride])``: element
            count, device address of the fp16 copy, scale slot (tensors sharing a slot share one
            scale), device address of the fp16 remainders (the fp32 mode's lo parts; 0: none), and
            of the partial column sums of the tensor as a matrix of rows of ``cols`` elements (0:
            none): float32 [column_sum_rows(...)][cols], whose sum over rows is the column sums;
            the tensor is the sum of ``parts`` (default 1) slices of the source ``part_stride``
            elements apart, added in order.
        product_bias : ``(length, slot_a, slot_b, alpha, bias, out)`` or None: the rescale also
            writes the bias of an fp16 GEMM alpha · (a·s_a)(b·s_b) (alpha a power of two that keeps
            its sums under 2^14) at the scale of its output (half_scaling.cu's write_product_bias):
            from the fp32 vector of ``length`` (a positive even count) at the source address after
            the tensors', fp16 ``bias`` [length] and float32 ``out`` [2], the GEMM's alpha and the
            scale of its output (device addresses).
        """
        if any(len(t) not in (6, 8) for t in tensors):
            raise ValueError("a tensor is (size, dest, slot, lo, sums, cols) or that and (parts, part_stride)")
        tensors = [tuple(t) if len(t) == 8 else tuple(t) + (1, 0) for t in tensors]  # one part by default
        if any(size % 4 or (sums and (cols <= 0 or cols % 4 or size % cols)) or parts < 1 or stride % 4
               or (parts > 1 and stride < size) for size, _, _, _, sums, cols, parts, stride in tensors):
            raise ValueError("half conversion needs sizes that are multiples of 4, for column sums row lengths "
                             "that are positive multiples of 4 dividing the size, and at least one part, parts "
                             "apart by a multiple of 4 elements, at least the size")
        n = len(tensors)
        if n > _THREADS:
            raise ValueError(f"a group holds at most {_THREADS} tensors (half_rescale), got {n}")
        if any(not 0 <= t[2] < self.n_slots for t in tensors):
            raise ValueError(f"slots run from 0 to {self.n_slots - 1}")
        if product_bias is not None:
            length, slot_a, slot_b, alpha, bias, out = product_bias
            if length <= 0 or length % 2 or not {slot_a, slot_b} <= {t[2] for t in tensors}:
                raise ValueError("a product bias has a positive even length and two slots of the group's tensors")
            mantissa, exponent = math.frexp(alpha)
            if not (alpha > 0 and mantissa == 0.5 and -126 <= exponent - 1 <= 127):
                raise ValueError(f"a product bias's alpha is a power of two in fp32's normal range, got {alpha}")
            if not (bias and out) or bias % 4 or out % 4:
                raise ValueError("a product bias's bias and out are device addresses, 4-byte aligned")
            trailer = [length, slot_a, slot_b, int(numpy.float32(alpha).view(numpy.int32)), bias, out]
        else:
            trailer = [0] * 6
        size, dest, slot, lo, sums, cols, parts, stride = zip(*tensors)
        cupy = import_cupy()
        meta = cupy.array([s // 4 for s in size] + list(dest) + list(slot) + list(lo) + list(sums) + list(parts)
                          + [s // 4 for s in stride] + trailer, numpy.int64)
        self._groups.append(meta)
        blocks = _blocks(size, [c for address, c in zip(sums, cols) if address], self._sm_count)
        args = (numpy.uint64(sources_address), meta, numpy.int32(n), self._state, numpy.int32(self.n_slots))
        return (lambda: self._copy((blocks, n), (_THREADS,), args),
                lambda: self._rescale((_rescale_blocks(self._sm_count),), (_THREADS,), args))

    def inverse_scales(self):
        """1 / s of each slot as of the last ``rescale`` (a CuPy view, for checks and probes)."""
        return self._state[2 * self.n_slots:3 * self.n_slots]

    def alphas(self):
        """The n × n alphas as of the last ``rescale`` (a CuPy view, for checks and probes)."""
        return self._state[7 * self.n_slots:].reshape(self.n_slots, self.n_slots)

    def inverse_scale(self, i):
        """Device address of 1 / s of slot i (float32)."""
        return self.inverse_scales().data.ptr + 4 * i

    def alpha(self, i, j):
        return self.alphas().data.ptr + 4 * (i * self.n_slots + j)
