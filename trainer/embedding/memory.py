"""Large host buffers on transparent huge pages.

Embedding tables are read and written at random rows; with 4 KiB pages nearly every row
access also misses the TLB. Asking the kernel for 2 MiB pages (``madvise(MADV_HUGEPAGE)``,
honoured where transparent huge pages are ``always`` or ``madvise``) before the buffer is
first touched removes most of those misses. Elsewhere the buffer is an ordinary one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor whose whole 2 MiB pages are advised to be huge pages."""
    tensor = torch.empty(numel, dtype=dtype)
    _advise_huge_pages(tensor)
    return tensor


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    madvise = _madvise()
    if madvise is None:
        return
    address = tensor.data_ptr()
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)  # advice: failure is fine


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.madvise
