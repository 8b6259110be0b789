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

_READ, _WRITE, _HIGH_LOCALITY, _DATA_CACHE = 0, 1, 3, 1


def _prefetch_intrinsic(name: str, intent: int, doc: str):
    """An intrinsic ``f(array, index)`` that emits ``llvm.prefetch`` of the line holding
    ``array[index]`` with read or write ``intent``."""

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
                                    ir.Constant(i32, _HIGH_LOCALITY), ir.Constant(i32, _DATA_CACHE)])
            return context.get_dummy_value()

        return signature, codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


prefetch = _prefetch_intrinsic(
    "prefetch", _READ, """``prefetch(array, index)``: start loading the line holding ``array[index]`` (1-D).""")
prefetch_for_write = _prefetch_intrinsic(
    "prefetch_for_write", _WRITE, """``prefetch_for_write(array, index)``: start loading the line holding ``array[index]``
    (1-D) in a state that lets this core write it (on x86, ``prefetchw``): for lines the
    kernel will modify, which saves the later ownership request a plain prefetch leaves.""")
