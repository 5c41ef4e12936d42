"""Launcher of ``kernels_cu/attention_fwd.cu``: the fused attention forward."""

import numpy

from . import kernels
from .attention_bwd import BLOCK_KV, BLOCK_Q, check_head_dim

SOURCE = "attention_fwd.cu"


class AttentionForward:
    """O = softmax(scale (Q0 + bq)(K0 + bk)^T) (V0 + bv) for every (batch, head) of one problem size.

    Parameters
    ----------
    problem : checks.Problem
    precision : "fp32" (3xTF32 products) or "tf32" (TF32 products).
    """

    def __init__(self, problem, precision):
        check_head_dim(problem)
        self.problem = problem
        defines = {"ATTN_BLOCK_Q": BLOCK_Q, "ATTN_BLOCK_KV": BLOCK_KV, "ATTN_HEAD_DIM": problem.head_dim,
                   "ATTN_SPLIT3": int(precision == "fp32")}
        self._kernel = kernels.get_kernel(SOURCE, "attn_fwd", defines)
        row = problem.head_dim + 8  # shared-memory rows are padded by 8 floats (see the source)
        self._smem_bytes = 4 * (BLOCK_Q * row + 2 * BLOCK_KV * row + BLOCK_Q * (BLOCK_KV + 8))
        if self._kernel.max_dynamic_shared_size_bytes < self._smem_bytes:
            self._kernel.max_dynamic_shared_size_bytes = self._smem_bytes
        self._grid = (-(-problem.num_video_tokens // BLOCK_Q), problem.num_heads, problem.batch_size)

    def __call__(self, q0, kv0, bias_addresses, text_lengths, o):
        """Launch on the current stream.

        Parameters
        ----------
        q0 : (B·Nv, D) float32, X Wq^T without the bias.
        kv0 : (B·Nt, 2D) float32, T [Wk; Wv]^T without the biases.
        bias_addresses : device address of three consecutive addresses: bq, bk, bv ((D,) float32).
        text_lengths : (B,) int32 device array, the text tokens each sample attends to (1..Nt).
        o : (B·Nv, D) float32 output.
        """
        p = self.problem
        self._kernel(self._grid, (BLOCK_Q // 16 * 32,),
                     (q0, kv0, numpy.uint64(bias_addresses), text_lengths, o, numpy.int32(p.num_video_tokens),
                      numpy.int32(p.num_text_tokens), numpy.int32(p.hidden_size), numpy.float32(p.scale)),
                     shared_mem=self._smem_bytes)
