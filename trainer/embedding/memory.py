"""Large host buffers on transparent huge pages.

Embedding tables are read and written at random rows; with 4 KiB pages nearly every row
access also misses the TLB. A buffer of at least one huge page gets a mapping of its own,
aligned to 2 MiB, that the kernel is asked to back with 2 MiB pages
(``madvise(MADV_HUGEPAGE)``, honoured where transparent huge pages are ``always`` or
``madvise``) before it is first touched. It is its own mapping, not malloc's, because
malloc may hand out memory that earlier blocks already faulted in with 4 KiB pages (it
does under :mod:`neorec.common.malloc_policy`, which keeps freed memory in its heaps).
Smaller buffers, and every buffer where ``mmap`` has no ``MADV_HUGEPAGE``, are ordinary
tensors.
"""

from __future__ import annotations

import mmap

import torch

_HUGE_PAGE = 2 << 20


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``numel`` elements of ``dtype``, on huge pages where
    the system gives them (see the module's docstring). The tensor holds its mapping: it is
    unmapped when the tensor's storage is freed."""
    nbytes = numel * dtype.itemsize
    if nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room to align
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -address % _HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % _HUGE_PAGE)  # advice: failure is fine
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)
