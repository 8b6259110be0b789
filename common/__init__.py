"""Helpers every package uses: hashing, offsets, the CPU prefetch intrinsic, transport security."""
