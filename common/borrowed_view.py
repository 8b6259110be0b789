"""Views of part of an array that Numba kernels can make in their inner loops for free.

Two obvious ways of reaching part of an array cost a kernel's loop dearly:

- A slice such as ``weights[start : start + dim]`` is a new array that shares the
  source's memory and so takes a reference to it: an atomic increment of the source's
  reference count when made and an atomic decrement when dropped. LLVM removes such pairs
  when they are close together, but not across the branches of a loop body that passes
  the slice on (an optimizer update choosing its rule per row). There, every row pays
  several locked instructions, each of which also waits for the loads before it, so the
  rows' cache misses no longer overlap.
- An index such as ``values[offset + k]``: Numba wraps negative indices, and with an
  offset of unknown sign LLVM cannot prove that the loop reads a contiguous run, so it
  vectorizes the loop with gather and scatter instructions, an element at a time (several
  times slower than plain vector loads and stores). A view that starts at ``offset``,
  indexed by the loop counter from 0, is a contiguous run.

:func:`borrowed_view` makes the view without a reference. It is only valid while the
source array is alive, which holds for the arrays a kernel was called with, and for its
own scratch arrays while they are in scope. (Here, beside the prefetches: a kernel of any
package may need it.) :func:`view_at` makes one at an address, for a kernel that writes
to one of several arrays chosen per element.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array


@intrinsic
def borrowed_view(typingctx, array, start, length):
    """``borrowed_view(array, start, length)``: ``array[start : start + length]`` of a 1-D
    C-contiguous array, holding no reference to it. Nothing is checked: the range must
    lie inside ``array`` (or ``length`` be 0, when ``start`` may lie anywhere)."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"
            and isinstance(start, types.Integer) and isinstance(length, types.Integer)):
        return None
    signature = array.copy(layout="C")(array, start, length)

    def codegen(context, builder, sig, args):
        source = context.make_array(sig.args[0])(context, builder, args[0])
        first = context.cast(builder, args[1], sig.args[1], types.intp)
        data = builder.gep(source.data, [first], inbounds=True)
        return _view(context, builder, sig.return_type, data, args[2], sig.args[2])

    return signature, codegen


@intrinsic
def view_at(typingctx, address, length, like):
    """``view_at(address, length, like)``: a 1-D C-contiguous array of ``length`` elements of
    ``like``'s dtype that starts at the integer ``address``, holding no reference to
    anything: so that a kernel can write to one of several arrays picked at run time by
    their addresses (``array.ctypes.data``), which a tuple indexed in the loop would
    make several times slower. Nothing is checked: the memory must be alive (its arrays
    held by the caller) and large enough."""
    if not (isinstance(address, types.Integer) and isinstance(length, types.Integer)
            and isinstance(like, types.Array)):
        return None
    signature = types.Array(like.dtype, 1, "C")(address, length, like)

    def codegen(context, builder, sig, args):
        element = context.get_data_type(like.dtype)
        data = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.intp), element.as_pointer())
        return _view(context, builder, sig.return_type, data, args[1], sig.args[1])

    return signature, codegen


def _view(context, builder, array_type, data, length, length_type):
    """The LLVM value of a 1-D C-contiguous ``array_type`` of ``length`` elements at the
    pointer ``data``, with no meminfo (so no reference counting)."""
    view = context.make_array(array_type)(context, builder)
    count = context.cast(builder, length, length_type, types.intp)
    itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(array_type.dtype)))
    populate_array(view, data=data, shape=[count], strides=[itemsize], itemsize=itemsize, meminfo=None)
    return view._getvalue()
