"""Launcher of ``kernels_cu/attention_bwd.cu``: the fused attention backward.

Owns the kernel names, their compile-time knobs, the grid arithmetic and the kernel's
workspace (the per-chunk dK/dV partials, the per-key-part dQ partials).
"""

import collections

import numpy

from . import kernels
from ._cupy import import_cupy

SOURCE = "attention_bwd.cu"
BLOCK_Q = 64          # query rows per tile of attn_bwd (4 warps of 16 rows)
BLOCK_KV = 32         # keys per streamed tile (attn_bwd), or WIDE_BLOCK_KV (streamed_block_kv)
WIDE_BLOCK_KV = 64
#: query rows per tile of attn_bwd_resident: 64 (4 warps, two blocks per SM) or 128 (8 warps, one
#: block per SM, half the dK/dV accumulators per warp). 64 is faster in every mode since the
#: kernel stopped spilling (docs/perf-notes.md; scripts/attention_variants.py compares both).
RESIDENT_BLOCK_Q = 64
#: head dimensions the kernels are built for (ATTN_HEAD_DIM); the resident kernel is 64 only.
HEAD_DIMS = (64, 128)
#: up to this many text tokens, attn_bwd_resident keeps all keys and values in shared memory
#: and takes one pass per query tile; longer texts are streamed by attn_bwd in two passes.
RESIDENT_MAX_KEYS = 80
#: warps per 16 query rows of attn_bwd_resident (ATTN_KEY_SPLIT) where its grid is at most one
#: block per SM (launch_layout): two, each with half the keys for S, the softmax and dP and half
#: the columns of O and dQ, keys padded to 32 (77 → 96), one block of 8 warps per SM. Measured on
#: the H200: 2x256x77 and 1x512x77 −4 to −6 µs; on every larger grid slower (+3 to +13 µs at two
#: such blocks per SM, 128 registers; +4 to +118 at one). fp16 operands only.
RESIDENT_KEY_SPLIT = 2
#: the most blocks that share each query chunk of attn_bwd (ATTN_KV_PARTS), each running pass 2 over
#: its part of the keys (key_parts): the small streamed grids (2x256x211: 128 blocks of 4 warps on
#: 132 SMs; 1x100x512: 32) leave most of the issue slots idle. Pass 1 runs in every part, and dQ
#: comes out as parts to be summed.
STREAMED_KV_PARTS = 8
#: blocks per SM the key parts may fill: measured on the H200 (perf-notes v57, v58), parts that made
#: a third block on an SM lost (2x256x211 fp16 and tf32, two parts → three: +2 µs), those up to two
#: gained (1x100x512, 32 blocks, two parts → eight: −3 to −7 µs; 1x256x160, two → four: 0 to −3)
KEY_PARTS_BLOCKS_PER_SM = 2
#: on sm_90 the resident kernel with fp16 operands, 64-row tiles and no key split runs its products as
#: warpgroup MMAs (ATTN_WGMMA, compiled for sm_90a; scripts/wgmma_probe.py), elsewhere as mma.sync
WGMMA = True
_REDUCE_THREADS = 256
#: the most query tiles a block of the resident kernel takes where it reads an fp16 [K0 | V0] (half_kv)
KV_HALF_RESIDENT_TILES = 2
#: the least query tiles a block of attn_bwd_lean takes in the tf32 mode on a grid of split chunks (lean_tf32)
LEAN_TF32_TILES = 4


def kv_half_alpha(hidden_size):
    """The alpha of the GEMM that writes the fp16 [K0 | V0] (kv_half) from the fp16 copies of T and
    [Wk; Wv], each element at most 2^15 in magnitude (half_scaling.cu): 2^-(16 + ⌈log2 D⌉) puts
    each of its sums of D products under 2^14, whatever the inputs (attention_bwd.cu's kv_half_scale)."""
    return 2.0 ** -(16 + (hidden_size - 1).bit_length())


#: the scalars an fp16 O needs (AttentionBackward's o_scales): read, then written
O_SCALES = ("inv_t", "inv_w", "inv_bv", "inv_dy", "inv_o", "alpha_o")


def _padded(n, multiple):
    return -(-n // multiple) * multiple


def streamed_block_kv(num_text_tokens, precision, head_dim=64):
    """Keys per tile of attn_bwd: WIDE_BLOCK_KV in the fp16-operand build (tf32, fp16) at head_dim 64 where that pads
    the text to no more keys than BLOCK_KV does (Nt = 293: 5 tiles of 64 or 10 of 32; Nt = 211:
    4 of 64 would be 32 keys more than 7 of 32), else BLOCK_KV. Half the tiles, each with twice
    the independent mma chains, at two blocks per SM instead of three. Measured on the H200
    (kernel alone, tf32): 4x256x293 130.3 → 119.4 µs, 8x256x373 280.9 → 264.0, 1x100x512
    129.7 → 122.3, but 2x256x211 73.7 → 76.7. The 3xTF32 and head_dim 128 builds would spill."""
    if precision == "fp32" or head_dim != 64:
        return BLOCK_KV
    wide = _padded(num_text_tokens, WIDE_BLOCK_KV) <= _padded(num_text_tokens, BLOCK_KV)
    return WIDE_BLOCK_KV if wide else BLOCK_KV


def operand_bytes(precision):
    """Bytes of one operand in the kernels' shared memory: fp32 for the fp32 mode's 3xTF32 split,
    fp16 (with per-tile power-of-two scales, ATTN_HALF) for tf32 and fp16."""
    return 4 if precision == "fp32" else 2


def kernel_choice(num_text_tokens, precision, head_dim=64, key_split=1, wgmma=False, kv_half=False, qdo_half=False,
                  lean=False):
    """(kernel name, ATTN_KEYS, query rows per tile, shared-memory bytes, blocks per SM that fit)
    for this text length and head_dim (and the resident kernel's ATTN_KEY_SPLIT, and whether it
    runs on wgmma: its tiles are then unpadded core matrices; and whether the kernel reads an fp16
    [K0 | V0], ATTN_KV_HALF: the resident kernel's shared memory is the same; and whether it is
    attn_bwd_lean, which with qdo_half, fp16 Q0 and dO, keeps two tiles of each).

    Shared memory, rows padded by 8 operands: Q and dO tiles, K and V (one tile, or all keys), and
    the P and dS tiles (one tile with fp32 operands: dS overwrites P); with fp16 operands, the
    streamed kernel's next K and V tiles staged as fp32, or with kv_half copied as they are
    into a second pair of operand tiles.
    Aim for as many blocks per SM when splitting the query rows of a (batch, head) pair: each
    extra chunk costs a dK/dV partial to reduce. head_dim 128 always streams (the resident
    kernel's dK/dV accumulators would double), two blocks per SM.
    """
    row = head_dim + 8
    p_ds_tiles = 2 if operand_bytes(precision) == 2 else 1  # P and dS, or dS over P
    if num_text_tokens <= RESIDENT_MAX_KEYS and head_dim == 64:
        keys, rows = _padded(num_text_tokens, 16 * key_split), RESIDENT_BLOCK_Q
        if wgmma:  # fp16, unpadded: K, V, Q, dO, P, dS (attn_bwd_lean: with qdo_half Q and dO twice, else
            # also the next Q and dO as fp32)
            smem = 2 * (2 * keys * head_dim + 2 * (1 + qdo_half) * rows * head_dim + 2 * rows * keys)
            smem += 4 * 2 * rows * head_dim if lean and not qdo_half else 0
        else:
            p_ds = rows * (_padded(keys, 32) + 8) * p_ds_tiles
            smem = operand_bytes(precision) * (2 * keys * row + 2 * rows * row + p_ds)
        name = "attn_bwd_lean" if lean or qdo_half else "attn_bwd_resident"
        return name, keys, rows, smem, 2 if rows == 64 and key_split == 1 else 1
    kv = streamed_block_kv(num_text_tokens, precision, head_dim)
    p_ds = BLOCK_Q * (kv + 8) * p_ds_tiles
    smem = operand_bytes(precision) * (2 * BLOCK_Q * row + 2 * kv * row * (1 + kv_half) + p_ds)
    if operand_bytes(precision) == 2 and not kv_half:
        smem += 4 * 2 * kv * head_dim  # the next key/value tile, staged as fp32
    blocks = 2 if precision == "fp32" or head_dim > 64 or kv > 32 else 3  # ATTN_MIN_BLOCKS in the source
    return "attn_bwd", 0, BLOCK_Q, smem, blocks


#: launch_layout's answer: kernel name, ATTN_KEYS, query rows per tile, shared-memory bytes, blocks per
#: SM, query chunks, tiles per chunk, ATTN_KEY_SPLIT, ATTN_KV_PARTS. The name and bytes are those of the
#: mma.sync build on fp32 K0|V0; AttentionBackward takes kernel_choice's for its wgmma (lean) or
#: fp16-K0|V0 build, with the layout's blocks per SM.
Layout = collections.namedtuple("Layout", "name keys rows smem_bytes blocks_per_sm n_chunks tiles_per_chunk "
                                          "key_split kv_parts")


def uses_wgmma(layout, precision, compute_capability):
    """Whether a launch_layout runs on wgmma (WGMMA) on a GPU of this compute capability ("90")."""
    return (WGMMA and str(compute_capability) == "90" and layout.keys > 0 and layout.rows == 64
            and layout.key_split == 1 and operand_bytes(precision) == 2)


def half_qdo(problem, precision, sm_count):
    """Whether Q0 and dO reach the attention as fp16, from their GEMMs at the alpha of [K0 | V0]'s
    (attn_bwd_lean, ATTN_QDO_HALF): the fp16 mode where the resident kernel runs on wgmma. Then
    [K0 | V0] is fp16 too (half_kv). Measured on the H200 (perf-notes v63): the fp16 suite mean
    −6.0 / −6.2 µs, 64x128x77 −20, 2x4096x77 −23, every resident case of 2048 video rows or more
    −8 to −12; the smaller ones within ±1."""
    return precision == "fp16" and _wgmma_here(launch_layout(problem, precision, sm_count), precision)


def _wgmma_here(layout, precision):
    """uses_wgmma on the current GPU."""
    return uses_wgmma(layout, precision, import_cupy().cuda.Device().compute_capability)


def lean_tf32(problem, layout, sm_count):
    """Whether the tf32 mode's wgmma build is attn_bwd_lean (its fp32 Q0 and dO tiles staged by cp.async,
    ATTN_LEAN) rather than attn_bwd_resident's: where its blocks take LEAN_TF32_TILES query tiles or
    more, or the (batch, head) pairs alone fill the slots (several waves: no chunks). Measured on the
    H200 (perf-notes v64): the tf32 suite mean −1.6 to −1.7 µs (three A/B pairs); 2x4096x77 −7 to −12,
    64x128x77 −7 to −8, 8x512x77 −2 to −4. Everywhere (all lean): blocks of one or
    two tiles of a split grid (2x512x77, 4x512x77, 2x691x77) +1 to +3, a cost per block (the staging's
    round trip, dS's observed scale) against a saving per tile."""
    pairs = problem.batch_size * problem.num_heads
    return pairs >= layout.blocks_per_sm * sm_count or layout.tiles_per_chunk >= LEAN_TF32_TILES


def half_kv(problem, precision, sm_count):
    """Whether [K0 | V0] reaches the attention as fp16 (ATTN_KV_HALF), its tiles copied by cp.async as
    they are: in the fp16 mode, by the streamed kernel, and by the resident one where its blocks take
    at most KV_HALF_RESIDENT_TILES query tiles (everywhere half_qdo holds). Measured on the H200 (perf-notes v47, v48): streamed
    8x256x373 −31 to −35 µs; resident, two tiles a block or fewer −0.5 to −4 µs a case, four or eight +1.5 to
    +2.4 (the kernel ~5 % slower there: a cost per tile, not found, against a saving per block).
    In the tf32 mode, by the streamed kernel, through a conversion of its fp32 [K0 | V0] (its TF32
    GEMM cannot write fp16): 8x256x373 −17 to −18 µs, 4x256x293 −11, 2x256x211 ±0.4 (v49)."""
    if precision not in ("fp16", "tf32"):
        return False
    layout = launch_layout(problem, precision, sm_count)
    return layout.keys == 0 or (precision == "fp16" and (layout.tiles_per_chunk <= KV_HALF_RESIDENT_TILES
                                                         or _wgmma_here(layout, precision)))


def o_t_stride(rows):
    """Row stride (floats) of the O^T the kernel writes with o_transposed, for ``rows`` = B·Nv:
    rounded up to 32 floats (16-byte aligned rows for cuBLAS's TMA kernels). The tf32 mode pads the
    other transposed operands the same way."""
    return _padded(rows, 32)


def dq_sums_rows(batch_size, num_video_tokens):
    """Rows of the dQ column sums that the kernel writes with dq_transposed: one per 16 query rows of
    a sample (each warp's rows)."""
    return batch_size * -(-num_video_tokens // 16)


def check_head_dim(problem):
    if problem.head_dim not in HEAD_DIMS:
        raise ValueError(f"the CuPy backend supports head_dim {' or '.join(map(str, HEAD_DIMS))}; got hidden size "
                         f"{problem.hidden_size} / {problem.num_heads} heads = head_dim {problem.head_dim}")


def chunking(batch_size, num_heads, num_video_tokens, sm_count, blocks_per_sm, block_q=BLOCK_Q):
    """Split each (batch, head)'s query tiles (of block_q rows) into chunks, one block each.

    A block's time is about its tiles plus a fixed part (K and V loaded, the dK/dV partial
    written: ~half a tile); blocks run in waves of ``blocks_per_sm * sm_count``. The chunk length
    with the least waves × block time wins, the longest among equals (fewest partials): e.g. 128
    (batch, head) pairs of 8 tiles on 264 slots take one wave of 4-tile chunks (256 blocks), where
    3-tile chunks take two (384 blocks). Where the pairs alone fill the slots, no split: each chunk
    adds a dK/dV partial ([B·Nt, 2·D] fp32, written and read back), which at D = 5120, Nt = 512 is
    hundreds of MiB, and such grids are not measured split.

    Returns ``(n_chunks, tiles_per_chunk)``; every chunk owns at least one tile.
    """
    n_q_tiles = -(-num_video_tokens // block_q)
    pairs, slots = batch_size * num_heads, blocks_per_sm * sm_count
    if pairs >= slots:
        return 1, n_q_tiles

    def chunks(tiles):
        return -(-n_q_tiles // tiles)

    def cost(tiles):
        waves = -(-pairs * chunks(tiles) // slots)
        return waves * (tiles + 0.5), -tiles

    tiles_per_chunk = min(range(1, n_q_tiles + 1), key=cost)
    return chunks(tiles_per_chunk), tiles_per_chunk


def key_parts(blocks, slots, key_tiles):
    """ATTN_KV_PARTS of a streamed grid of ``blocks`` with ``key_tiles`` key tiles, where ``slots``
    blocks run at once: the most, up to STREAMED_KV_PARTS and key_tiles, whose multiple of the grid
    fits those slots."""
    return max(1, min(STREAMED_KV_PARTS, key_tiles, slots // blocks))


def launch_layout(problem, precision, sm_count):
    """The Layout of the kernel for ``problem``. The resident kernel splits its keys
    (RESIDENT_KEY_SPLIT) where its grid has at most one block per SM: there each SM runs one tile
    as one chain of dependent instructions, and two warps a row halve it. The streamed kernel gives
    each query chunk up to STREAMED_KV_PARTS blocks (key_parts)."""
    def layout(key_split):
        name, keys, rows, smem, blocks_per_sm = kernel_choice(problem.num_text_tokens, precision, problem.head_dim,
                                                              key_split)
        n_chunks, tiles_per_chunk = chunking(problem.batch_size, problem.num_heads, problem.num_video_tokens,
                                             sm_count, blocks_per_sm, rows)
        blocks = problem.batch_size * problem.num_heads * n_chunks
        # Chunks of several tiles only come from grids over half a wave, which leave no room for
        # parts anyway; gated here so that the kernel's path for parts over several query tiles
        # (dK/dV accumulated per part, a part with no key tile prefetching the next tile's pass 1)
        # stays unplanned: it has not run on a GPU.
        slots = min(blocks_per_sm, KEY_PARTS_BLOCKS_PER_SM) * sm_count
        kv_parts = 1 if keys or tiles_per_chunk > 1 else key_parts(blocks, slots,
                                            -(-problem.num_text_tokens // streamed_block_kv(
                                                problem.num_text_tokens, precision, problem.head_dim)))
        return Layout(name, keys, rows, smem, blocks_per_sm, n_chunks, tiles_per_chunk, key_split, kv_parts)

    unsplit = layout(1)
    one_block_per_sm = problem.batch_size * problem.num_heads * unsplit.n_chunks <= sm_count
    if unsplit.keys and unsplit.rows == 64 and operand_bytes(precision) == 2 and one_block_per_sm:
        return layout(RESIDENT_KEY_SPLIT)
    return unsplit


class AttentionBackward:
    """S → P → O, dP, dS → dQ, dK, dV for every (batch, head) of one problem size.

    Parameters
    ----------
    problem : checks.Problem
    precision : "fp32" (3xTF32 products) or "tf32"/"fp16" (fp16 operands with per-tile power-of-two
        scales: the significands of TF32, kernels_cu/attention_common.cuh).
    sm_count : multiprocessors of the GPU, for the grid.
    o_transposed : write O as O^T, D rows of B·Nv with row stride ``o_t_stride(B·Nv)`` (ATTN_O_TRANSPOSED).
    dq_transposed : with o_transposed and one key part (launch_layout), also write dQ^T, laid out as
        O^T, and dQ's column sums by 16 rows of a sample (ATTN_DQ_TRANSPOSED): the tf32 mode's dWq
        and dbq read them, with no transposed copy of dQ.
    o_half : write O as fp16, O · s_O, at a power-of-two scale set from a bound on |V| (ATTN_O_HALF,
        the operand of dWo in the fp16 and fp32 modes, where the fp32 mode's kernel also writes its
        fp16 remainder, at 2^11 times that scale: attention_bwd.cu's O_LO_SCALE): calls then pass
        ``o_scales`` (fp32: and ``o_lo``).
    reduce_parts : sum the query chunks' dK/dV partials into ``dkv`` and the key parts' dQ
        partials into ``dq``; without, the caller sums :attr:`partials` and :attr:`dq_partials`
        (the fp16 and fp32 modes' conversion does, reading them once).
    kv_half : ``kv0`` is float16, [K0 | V0] · s_KV (ATTN_KV_HALF; where half_kv says), with s_KV =
        s_T · s_W · kv_half_alpha(D), where 1 / s_T and 1 / s_W are ``o_scales``' inv_t and inv_w
        (fp16 mode), or 1 / ``kv_scale`` (tf32 mode: a power of two, from a conversion).
    qdo_half : ``q0`` and ``dout`` are float16 at the scales ``qdo_scales`` give (where half_qdo
        says: the fp16 mode's attn_bwd_lean, with kv_half and o_half).
    """

    @staticmethod
    def workspace_bytes(problem, precision, sm_count):
        """Bytes of the dK/dV partials (one slice per query chunk, when there is more than one) and
        of the dQ partials (one per key part, when there is more than one)."""
        layout = launch_layout(problem, precision, sm_count)
        n_chunks, kv_parts = layout.n_chunks, layout.kv_parts
        p = problem
        return 4 * p.hidden_size * ((n_chunks if n_chunks > 1 else 0) * p.batch_size * p.num_text_tokens * 2
                                    + (kv_parts if kv_parts > 1 else 0) * p.batch_size * p.num_video_tokens)

    def __init__(self, problem, precision, sm_count, o_transposed=False, o_half=False, reduce_parts=True,
                 kv_half=False, dq_transposed=False, qdo_half=False):
        check_head_dim(problem)
        if o_half and (o_transposed or precision not in ("fp16", "fp32")):
            raise ValueError(f"an fp16 O is written row-major in the fp16 and fp32 modes, not with "
                             f"o_transposed={o_transposed}, precision={precision!r}")
        if kv_half and not (half_kv(problem, precision, sm_count) and o_half == (precision == "fp16")):
            raise ValueError("an fp16 [K0 | V0] goes where half_kv says (fp16 mode with o_half, whose o_scales "
                             "give its scale; tf32 mode)")
        if qdo_half and not (half_qdo(problem, precision, sm_count) and kv_half and o_half and not dq_transposed):
            raise ValueError("an fp16 Q0 and dO go where half_qdo says, with an fp16 [K0 | V0] and O (no dQ^T)")
        cupy = import_cupy()
        self.o_half, self.kv_half, self.qdo_half = o_half, kv_half, qdo_half
        self._o_lo = o_half and precision == "fp32"  # O's remainder too (3xFP16 dWo)
        self.problem = problem
        layout = launch_layout(problem, precision, sm_count)
        (name, keys, rows, self._smem_bytes, blocks_per_sm, self.n_chunks, self.tiles_per_chunk, split,
         self.kv_parts) = layout
        if dq_transposed and not (o_transposed and self.kv_parts == 1):
            raise ValueError(f"dQ^T is written beside O^T (o_transposed={o_transposed}) where dQ is not split over "
                             f"key parts (here {self.kv_parts})")
        self.dq_transposed = dq_transposed
        self.wgmma = _wgmma_here(layout, precision)
        # attn_bwd_lean in place of the resident kernel's wgmma build: the fp16 mode's (qdo_half), and the
        # tf32 mode's where lean_tf32 holds
        self.lean = qdo_half or (self.wgmma and precision == "tf32" and lean_tf32(problem, layout, sm_count))
        if self.wgmma or kv_half:
            name, _, _, self._smem_bytes, _ = kernel_choice(problem.num_text_tokens, precision, problem.head_dim, split,
                                                            self.wgmma, kv_half, qdo_half, self.lean)
        arch = "sm_90a" if self.wgmma else None
        self._threads = rows // 16 * 32 * split
        self._ld_o = o_t_stride(problem.batch_size * problem.num_video_tokens) if o_transposed else problem.hidden_size
        block_kv = streamed_block_kv(problem.num_text_tokens, precision, problem.head_dim) if not keys else BLOCK_KV
        defines = {"ATTN_BLOCK_Q": rows, "ATTN_BLOCK_KV": block_kv, "ATTN_HEAD_DIM": problem.head_dim,
                   "ATTN_SPLIT3": int(precision == "fp32"), "ATTN_HALF": int(operand_bytes(precision) == 2),
                   "ATTN_KEYS": keys, "ATTN_KEY_SPLIT": split,
                   "ATTN_RESIDENT_MIN_BLOCKS": blocks_per_sm, "ATTN_O_TRANSPOSED": int(o_transposed),
                   "ATTN_O_HALF": int(o_half), "ATTN_WGMMA": int(self.wgmma), "ATTN_KV_HALF": int(kv_half),
                   "ATTN_KV_PARTS": self.kv_parts, "ATTN_DQ_TRANSPOSED": int(dq_transposed),
                   "ATTN_LEAN": int(self.lean), "ATTN_QDO_HALF": int(qdo_half)}
        self._main = kernels.get_kernel(SOURCE, name, defines, arch)
        if self._main.max_dynamic_shared_size_bytes < self._smem_bytes:
            self._main.max_dynamic_shared_size_bytes = self._smem_bytes
        # All of the unified L1/shared storage as shared memory: the default split measured on the
        # H200 left room for fewer blocks than the shared memory allows (also below 48 KiB, as the
        # fp16 operands' tiles are).
        self._main.preferred_shared_memory_carveout = 100
        self._reduce = kernels.get_kernel(SOURCE, "attn_sum_parts", defines, arch) if reduce_parts else None
        n_text_rows = problem.batch_size * problem.num_text_tokens
        n_video_rows = problem.batch_size * problem.num_video_tokens
        self._dkv_part = (cupy.empty((self.n_chunks, n_text_rows, 2 * problem.hidden_size), numpy.float32)
                          if self.n_chunks > 1 else None)
        self._dq_part = (cupy.empty((self.kv_parts, n_video_rows, problem.hidden_size), numpy.float32)
                         if self.kv_parts > 1 else None)
        # Lengths for callers that pass none (the tests, scripts); Backward passes its own buffer.
        self._all_keys = cupy.full(problem.batch_size, problem.num_text_tokens, numpy.int32)
        # float4s of dK|dV (summed over the chunks) and of dQ (over the key parts), and their grids
        self._n4 = n_text_rows * 2 * problem.hidden_size // 4, n_video_rows * problem.hidden_size // 4
        self._reduce_grids = [(max(1, min(-(-n4 // _REDUCE_THREADS), 8 * sm_count)),) for n4 in self._n4]

    @property
    def partials(self):
        """The query chunks' dK/dV partials, (n_chunks, B·Nt, 2D) float32, summed over axis 0 into
        ``dkv`` with reduce_parts; None with one chunk (the kernel writes ``dkv`` itself)."""
        return self._dkv_part

    @property
    def dq_partials(self):
        """The key parts' dQ partials, (kv_parts, B·Nv, D) float32, summed over axis 0 into ``dq``
        with reduce_parts; None with one part (the kernel writes ``dq`` itself)."""
        return self._dq_part

    def __call__(self, q0, kv0, bias_addresses, dout, o, dq, dkv, text_lengths=None, o_scales=None, o_lo=None,
                 kv_scale=None, dq_t=None, dq_sums=None, qdo_scales=None):
        """Launch on the current stream.

        Parameters
        ----------
        q0 : (B·Nv, D) float32, X Wq^T without the bias (with qdo_half float16 X Wq^T + bq, see qdo_scales).
        kv0 : (B·Nt, 2D) float32, T [Wk; Wv]^T without the biases (with kv_half float16, times s_KV).
        bias_addresses : device address of three consecutive addresses: bq, bk, bv ((D,) float32).
        dout : (B·Nv, D) float32, dO = dY Wo (with qdo_half float16).
        o, dq : (B·Nv, D) float32 outputs: the attention output O (with o_transposed O^T, a
            (D, o_t_stride(B·Nv)) array whose first B·Nv columns are written; with o_half, float16
            O · s_O) and dQ.
        dkv : (B·Nt, 2D) float32 output: dK in columns [0, D), dV in [D, 2D) (not written without
            reduce_parts where there are ``partials``; nor ``dq`` where there are ``dq_partials``).
        text_lengths : (B,) int32 device array, optional
            Text tokens each sample attends to (1..Nt); default: all of them.
        o_scales : with o_half, device addresses (float32 scalars) of inv_t, inv_w and inv_bv, where
            max|T| ≤ 2^15 · inv_t and max|[Wk; Wv]| ≤ 2^15 · inv_w hold for the T and weights that
            kv0 was computed from, and max|bv| ≤ 2^15 · inv_bv (as for the fp16 copies' inverse
            scales, half_scaling.cu), of inv_dy, and of inv_o and alpha_o, where 1 / s_O and
            inv_dy / s_O (the alpha of dWo = dY^T O over the fp16 copies) are written; in the fp32
            mode alpha_o is two floats, the second inv_dy / (s_O · 2^11), the alpha of dY's copy
            times O's remainder.
        o_lo : with o_half in the fp32 mode (and only then), the device address of a float16 array
            like ``o`` (at a multiple of 8 bytes from it, not overlapping it) where O's remainders,
            (O · s_O − fp16(O · s_O)) · 2^11, go (attention_bwd.cu's O_LO_SCALE says why).
        kv_scale : with kv_half in the tf32 mode (and only then), the device address of 1 / s_KV
            (float32, a power of two: the conversion's inverse scale, half_scaling.py).
        dq_t, dq_sums : with dq_transposed (and only then), device addresses of dQ^T (float32, laid out
            as O^T; its columns from B·Nv on are not written) and of dQ's column sums, float32
            (dq_sums_rows(B, Nv), D): row b·⌈Nv/16⌉ + k holds the sums of rows [16k, 16k + 16) of
            sample b (rows past Nv count as 0).
        qdo_scales : with qdo_half (and only then), device addresses of s_Q and inv_wo (float32 scalars):
            q0 is float16 (X Wq^T + bq) · s_Q (its GEMM adds bq: half_scaling.cu's write_product_bias,
            every element under 2^15), dout float16 dO · s_dY · s_Wo · kv_half_alpha(D), where 1 / s_Wo
            is inv_wo, the inverse scale of the fp16 copy of Wo that dout was computed from (inv_dy is
            ``o_scales``').
        """
        p = self.problem
        if (q0.dtype == numpy.float16) != self.qdo_half or dout.dtype != q0.dtype:
            raise ValueError(f"q0 and dout are float16 with qdo_half, else float32: got {q0.dtype}, {dout.dtype} "
                             f"with qdo_half={self.qdo_half}")
        if (qdo_scales is None) == self.qdo_half or (qdo_scales is not None and len(qdo_scales) != 2):
            raise ValueError("qdo_scales (s_q, inv_wo) go with qdo_half, and only with it")
        if (kv0.dtype == numpy.float16) != self.kv_half:
            raise ValueError(f"kv0 is float16 with kv_half, else float32: got {kv0.dtype} with kv_half={self.kv_half}")
        if (kv_scale is None) == (self.kv_half and not self.o_half):
            raise ValueError("kv_scale (1 / s_KV) goes with kv_half in the tf32 mode, and only with it")
        if (o_scales is None) == self.o_half or (o_scales is not None and len(o_scales) != len(O_SCALES)):
            raise ValueError(f"o_scales ({', '.join(O_SCALES)}) goes with o_half, and only with it")
        if (o_lo is None) == self._o_lo:
            raise ValueError("o_lo (O's fp16 remainder) goes with o_half in the fp32 mode, and only with it")
        if (dq_t is None or dq_sums is None) == self.dq_transposed or (dq_t is None) != (dq_sums is None):
            raise ValueError("dq_t and dq_sums go with dq_transposed, and only with it")
        o_address = int(o) if isinstance(o, (int, numpy.integer)) else o.data.ptr
        lo_offset = 0 if o_lo is None else int(o_lo) - o_address
        if lo_offset % 8:
            raise ValueError(f"o_lo must be a multiple of 8 bytes from o, not {lo_offset}")
        o_bytes = 2 * p.batch_size * p.num_video_tokens * p.hidden_size
        if o_lo is not None and abs(lo_offset) < o_bytes:
            raise ValueError(f"o_lo overlaps o: {lo_offset} bytes from it, within O's {o_bytes}")
        dkv_part = dkv if self._dkv_part is None else self._dkv_part
        dq_part = dq if self._dq_part is None else self._dq_part
        self._main(
            (self.n_chunks * self.kv_parts, p.num_heads, p.batch_size), (self._threads,),
            (q0, kv0, numpy.uint64(bias_addresses), dout, o, dq_part, dkv_part,
             self._all_keys if text_lengths is None else text_lengths, numpy.int32(p.num_video_tokens),
             numpy.int32(p.num_text_tokens), numpy.int32(p.hidden_size), numpy.int32(self._ld_o),
             numpy.int32(self.tiles_per_chunk), numpy.float32(p.scale))
            + tuple(numpy.uint64(a) for a in (o_scales or (0,) * len(O_SCALES)))
            + (numpy.int64(lo_offset // 2), numpy.uint64(kv_scale or 0), numpy.uint64(dq_t or 0),
               numpy.uint64(dq_sums or 0))
            + tuple(numpy.uint64(a) for a in (qdo_scales or ((0, 0) if self.lean else ()))),
            shared_mem=self._smem_bytes)
        if self._reduce is not None:
            for parts, total, n4, grid in zip((self._dkv_part, self._dq_part), (dkv, dq), self._n4, self._reduce_grids):
                if parts is not None:
                    self._reduce(grid, (_REDUCE_THREADS,), (parts, total, numpy.int64(n4), numpy.int32(parts.shape[0])))
