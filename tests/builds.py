"""The attention kernel's sm_90a-only builds that the CPU tests compile (test_kernels.py,
test_scripts.py): attn_bwd_lean in the fp16 mode's form (fp16 Q0, dO, K0|V0 and O) and in the tf32
mode's (fp32 operands from global memory, O^T and dQ^T); with ATTN_KEYS 80, as the benchmark's 77
text tokens plan them."""

LEAN_FP16 = {"ATTN_KEYS": 80, "ATTN_HALF": 1, "ATTN_WGMMA": 1, "ATTN_LEAN": 1, "ATTN_O_HALF": 1, "ATTN_KV_HALF": 1,
             "ATTN_QDO_HALF": 1}
LEAN_TF32 = {"ATTN_KEYS": 80, "ATTN_HALF": 1, "ATTN_WGMMA": 1, "ATTN_LEAN": 1, "ATTN_O_TRANSPOSED": 1,
             "ATTN_DQ_TRANSPOSED": 1}
