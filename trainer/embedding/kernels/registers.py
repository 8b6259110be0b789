"""Scratch arrays that live in registers: a float32 array of a length fixed at compile time,
allocated on the kernel's stack, and the non-temporal store that writes one out.

Numba's arrays live on the heap, and LLVM cannot tell that a heap array a loop adds into is
not the array it reads from, so every add goes through memory. A stack array whose every
index is a constant (loops of a constant trip count, which LLVM unrolls) is split by LLVM
into scalars and kept in vector registers for the whole loop: a bag's sum is then stored
once, after its last row.

A kernel whose output is written once and read only later (a forward's pooled bags, tens
of MB a batch) gains from storing it around the caches: a plain store first reads the
line it overwrites into the cache and evicts a line of the tables for it.
:func:`store_streaming` writes whole 64-byte lines with non-temporal stores instead.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array


@intrinsic
def stack_floats(typingctx, length):
    """``stack_floats(n)``: an uninitialised float32 ``[n]`` array on the stack (``n`` an
    integer literal). It must not outlive the kernel that makes it."""
    if not isinstance(length, types.IntegerLiteral):
        return None
    size = length.literal_value
    array_type = types.Array(types.float32, 1, "C")

    def codegen(context, builder, signature, args):
        data = cgutils.alloca_once(builder, ir.FloatType(), size=size)
        array = context.make_array(array_type)(context, builder)
        itemsize = context.get_constant(types.intp, 4)
        populate_array(array, data=data, shape=[context.get_constant(types.intp, size)], strides=[itemsize],
                       itemsize=itemsize, meminfo=None)
        return array._getvalue()

    return array_type(length), codegen


STREAM_ALIGNMENT = 64
"""Bytes: where :func:`store_streaming` writes must start on such a boundary."""
_VECTOR = 16
"""float32 lanes of one non-temporal store (one 64-byte line)."""


@intrinsic
def store_streaming(typingctx, out, index, values, length):
    """``store_streaming(out, index, values, n)``: ``out[index : index + n] = values[:n]``
    with non-temporal stores of 16 floats each, for float32 1-D ``out`` and ``values`` (a
    :func:`stack_floats` array) and ``n`` an integer literal, a multiple of 16. The address
    of ``out[index]`` must be a multiple of :data:`STREAM_ALIGNMENT` (the caller checks):
    an unaligned non-temporal store faults. The stored lines are not cached, and other
    threads may see them late until the storing thread calls :func:`fence_streaming`."""
    if not isinstance(length, types.IntegerLiteral) or length.literal_value % _VECTOR:
        return None
    count = length.literal_value

    def codegen(context, builder, signature, args):
        out_type, _, values_type, _ = signature.args
        target = cgutils.get_item_pointer(context, builder, out_type, context.make_array(out_type)(
            context, builder, args[0]), [args[1]], wraparound=False, boundscheck=False)
        source = context.make_array(values_type)(context, builder, args[2]).data
        vector = ir.VectorType(ir.FloatType(), _VECTOR)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for first in range(0, count, _VECTOR):
            offset = [ir.Constant(ir.IntType(64), first)]
            value = builder.load(builder.bitcast(builder.gep(source, offset), vector.as_pointer()), align=4)
            store = builder.store(value, builder.bitcast(builder.gep(target, offset), vector.as_pointer()),
                                  align=STREAM_ALIGNMENT)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(out, index, values, length), codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def fence_streaming(typingctx):
    """``fence_streaming()``: after it, every non-temporal store of this thread
    (:func:`store_streaming`) is visible to all threads. On x86 an ``sfence``: LLVM's
    fences compile to a locked instruction there, which need not order non-temporal
    stores; elsewhere a full fence (on ARM a ``dmb``, which does)."""

    def codegen(context, builder, signature, args):
        if _X86:
            sfence = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                    "llvm.x86.sse.sfence")
            builder.call(sfence, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen
