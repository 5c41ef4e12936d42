"""Launcher of ``kernels_cu/attention_bwd.cu``: the fused attention backward.

Owns the kernel names, their compile-time knobs and the grid arithmetic.
"""

import numpy

from . import kernels
from ._cupy import import_cupy

SOURCE = "attention_bwd.cu"
BLOCK_Q = 64          # query rows per tile (4 warps of 16 rows)
BLOCK_KV = 32         # keys per streamed tile
HEAD_DIM = 64
_THREADS = BLOCK_Q // 16 * 32
# Shared memory: Q and dO tiles, K and V tiles (rows padded by 8 floats), and the P/dS tile.
_SMEM_BYTES = 4 * (2 * BLOCK_Q * (HEAD_DIM + 8) + 2 * BLOCK_KV * (HEAD_DIM + 8) + BLOCK_Q * (BLOCK_KV + 8))
# Aim for this many blocks per SM when splitting the query rows of a (batch, head) pair:
# three blocks fit by shared memory, and each extra chunk costs a dK/dV partial to reduce.
_BLOCKS_PER_SM = 3
_REDUCE_THREADS = 256


def _defines(precision):
    return {"ATTN_BLOCK_Q": BLOCK_Q, "ATTN_BLOCK_KV": BLOCK_KV, "ATTN_HEAD_DIM": HEAD_DIM,
            "ATTN_SPLIT3": int(precision == "fp32")}


def chunking(batch_size, num_heads, num_video_tokens, sm_count):
    """Split each (batch, head)'s query tiles into chunks so the grid fills the GPU.

    Returns ``(n_chunks, tiles_per_chunk)``; every chunk owns at least one tile.
    """
    n_q_tiles = -(-num_video_tokens // BLOCK_Q)
    want = -(-_BLOCKS_PER_SM * sm_count // (batch_size * num_heads))
    n_chunks = max(1, min(n_q_tiles, want))
    tiles_per_chunk = -(-n_q_tiles // n_chunks)
    return -(-n_q_tiles // tiles_per_chunk), tiles_per_chunk


def _kernel(name, precision):
    kernel = kernels.get_kernel(SOURCE, name, _defines(precision))
    if name == "attn_bwd" and kernel.max_dynamic_shared_size_bytes < _SMEM_BYTES:
        kernel.max_dynamic_shared_size_bytes = _SMEM_BYTES
    return kernel


def attention_backward(problem, q0, kv0, dout, query_bias, key_bias, value_bias, *,
                       o, dq, dkv, precision):
    """Fused S → P → O, dP, dS → dQ, dK, dV for every (batch, head).

    Parameters
    ----------
    q0 : (B·Nv, D) float32, X Wq^T without the bias.
    kv0 : (B·Nt, 2D) float32, T [Wk; Wv]^T without the biases.
    dout : (B·Nv, D) float32, dO = dY Wo.
    query_bias, key_bias, value_bias : (D,) float32.
    o, dq : (B·Nv, D) float32 outputs: the attention output O and dQ.
    dkv : (B·Nt, 2D) float32 output: dK in columns [0, D), dV in [D, 2D).
    """
    cupy = import_cupy()
    if problem.head_dim != HEAD_DIM:
        raise ValueError(f"the CuPy backend supports head_dim {HEAD_DIM}; got "
                         f"{problem.hidden_size} / {problem.num_heads} = {problem.head_dim}")
    b, nv, nt, d = (problem.batch_size, problem.num_video_tokens, problem.num_text_tokens,
                    problem.hidden_size)
    sm_count = cupy.cuda.Device().attributes["MultiProcessorCount"]
    n_chunks, tiles_per_chunk = chunking(b, problem.num_heads, nv, sm_count)
    dkv_part = dkv if n_chunks == 1 else cupy.empty((n_chunks,) + dkv.shape, numpy.float32)
    _kernel("attn_bwd", precision)(
        (n_chunks, problem.num_heads, b), (_THREADS,),
        (q0, query_bias, kv0, key_bias, value_bias, dout, o, dq, dkv_part,
         numpy.int32(nv), numpy.int32(nt), numpy.int32(d), numpy.int32(tiles_per_chunk),
         numpy.float32(problem.scale)),
        shared_mem=_SMEM_BYTES)
    if n_chunks > 1:
        n4 = dkv.size // 4
        blocks = min(-(-n4 // _REDUCE_THREADS), 8 * sm_count)
        _kernel("attn_dkdv_reduce", precision)(
            (blocks,), (_REDUCE_THREADS,), (dkv_part, dkv, numpy.int64(n4), numpy.int32(n_chunks)))
