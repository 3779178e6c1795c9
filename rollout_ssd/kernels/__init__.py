"""Attention kernels: span attention in Triton for GPUs and its torch references.

`reference` (torch only) holds SSD's tree-attention layout (`TreeAttentionMetadata`), an SDPA path and
the float64 reference; `tree_attention` holds the Triton kernel (`span_attention`, and
`tree_attention_triton` over the metadata), imported only when used: it needs triton. The engine's
"triton" attention backend (models/attention.py) calls `span_attention`. The tests run the kernel
under Triton's CPU interpreter (README.md here).
"""
