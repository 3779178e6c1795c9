"""Attention kernels, installed as `rollout_ssd_kernels` (the name `kernels` is taken on PyPI).

`reference` (torch only) holds the tree-attention layout, an SDPA path and the fp64 reference;
`tree_attention` holds the Triton kernel for GPUs (imported only when used: it needs triton).
Neither is wired into the engine yet: rollout_ssd's attention (models/attention.py) is PyTorch SDPA,
and SSD's tree drafting builds its own mask (ssd/tree.py). The tests run the kernel under Triton's
CPU interpreter.
"""
