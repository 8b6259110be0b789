"""Embedding bag collections: the fused table-batched module, its store-backed variant, their configuration and kernels."""
