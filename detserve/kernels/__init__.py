"""Triton kernels of the GPU path; each module holds a kernel, its launcher and a torch reference.

The kernel modules import triton (``config`` does not): import them on the GPU path, or in
a process that set ``TRITON_INTERPRET=1`` before their first import (the CPU tests).

| module | launcher | role |
|---|---|---|
| decode_attention | decode_attention | fast-path decode, split-KV |
| prefill_attention | prefill_attention | fast-path chunked prefill, causal over the cache |
| lane_attention | lane_attention | the fixed-shape lane: position-aligned tiles, no split |
| batch_invariant | matmul_bi, rmsnorm_bi, log_softmax_bi | ``batch_invariant`` mode |
| kv_write | rope_kv_write, kv_write | fused RoPE + paged K/V write |
"""
