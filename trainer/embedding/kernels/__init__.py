"""Numba CPU kernels of the fused embedding module, one file per concern.

* ``forward``: pooled lookups of every table in one call.
* ``backward``: grouping of gradient contributions by row (deterministic order) and the
  fused optimizer update.
* ``routing``: a batch's ids routed to the shards holding their rows (sharded tables).
* ``precision``: fp16/bf16 storage conversions and stochastic rounding noise.
* ``prefetch``: a software prefetch intrinsic for the random row accesses.
* ``torch_ops``: the same lookup and fused update in torch ops (CUDA, or any device).
"""
