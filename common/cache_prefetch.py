"""Software prefetches for Numba kernels: ask the CPU to start loading the cache line of
``array[index]`` now, so that a later access does not wait for memory; for reading, or for
a line the kernel will write (the optimizer updates' rows, their state and flags).

Embedding lookups and updates touch random rows of tables far larger than the caches, and
the store's cache kernels random sets of a tag array larger than them; the kernels
prefetch a few ids or rows ahead of the one they work on. A prefetch never faults, and an
index past the end is harmless (the line is just not used). (Here, beside the hashing,
because both the trainer's kernels and the embedding store's use it.)
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_READ, _WRITE, _DATA_CACHE = 0, 1, 1
_ALL_LEVELS, _FROM_L2 = 3, 2
"""``llvm.prefetch`` locality: into every cache level (x86 ``prefetcht0``), or into L2 and
below, not L1 (``prefetcht1``)."""


def _prefetch_intrinsic(name: str, intent: int, locality: int, doc: str):
    """An intrinsic ``f(array, index)`` that emits ``llvm.prefetch`` of the line holding
    ``array[index]`` with read or write ``intent`` and cache ``locality``."""

    def typer(typingctx, array, index):
        signature = types.void(array, index)

        def codegen(context, builder, sig, args):
            array_type = sig.args[0]
            view = context.make_array(array_type)(context, builder, args[0])
            pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False,
                                               boundscheck=False)
            byte_pointer = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]), "llvm.prefetch.p0i8")
            builder.call(function, [builder.bitcast(pointer, byte_pointer), ir.Constant(i32, intent),
                                    ir.Constant(i32, locality), ir.Constant(i32, _DATA_CACHE)])
            return context.get_dummy_value()

        return signature, codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


prefetch = _prefetch_intrinsic(
    "prefetch", _READ, _ALL_LEVELS,
    """``prefetch(array, index)``: start loading the line holding ``array[index]`` (1-D).""")
prefetch_to_l2 = _prefetch_intrinsic(
    "prefetch_to_l2", _READ, _FROM_L2, """``prefetch_to_l2(array, index)``: start loading the line holding ``array[index]`` (1-D)
    into L2, not L1: for kernels that keep many lines in flight (several lines of each of
    many rows or bags ahead), which then do not wait for L1's few outstanding-miss slots nor
    evict from L1 what they are working on: the embedding kernels' rows, read by the
    forward and updated by the backward, and the ingest bag gather.""")
prefetch_for_write = _prefetch_intrinsic(
    "prefetch_for_write", _WRITE, _ALL_LEVELS, """``prefetch_for_write(array, index)``: start loading the line holding ``array[index]``
    (1-D) in a state that lets this core write it (on x86, ``prefetchw``): for lines the
    kernel will modify, which saves the later ownership request a plain prefetch leaves.""")
