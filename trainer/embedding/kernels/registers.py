"""Scratch arrays that live in registers: a float32 array of a length fixed at compile time,
allocated on the kernel's stack.

Numba's arrays live on the heap, and LLVM cannot tell that a heap array a loop adds into is
not the array it reads from, so every add goes through memory. A stack array whose every
index is a constant (loops of a constant trip count, which LLVM unrolls) is split by LLVM
into scalars and kept in vector registers for the whole loop: a bag's sum is then stored
once, after its last row.
"""

from __future__ import annotations

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
