"""Attention kernels, installed as `rollout_ssd_kernels` (the name `kernels` is taken on PyPI).

`reference` (torch only) holds the tree-attention layout, the SDPA path used on CPU and the fp64
reference; `tree_attention` holds the Triton kernel (imported only when used: it needs triton).
"""
