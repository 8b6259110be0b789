"""Half-precision weight storage: fp16 and bf16 held as uint16 bit patterns (Numba has no
CPU half type), converted to and from float32 with integer operations on the float's bits:
one element at a time (branch-free in the common case, so the kernels' loops over a row
vectorize), and a row's blocks of 16 in explicit 32-bit vector lanes (:func:`encode_row`,
:func:`decode_row`).

Rounding to half precision is to nearest, ties to even (as torch's conversions), or
stochastic: away from zero with probability equal to the remainder's fraction of the gap
between the two half values around it, the noise (32 bits) a hash of ``(seed, step,
element)`` so the result does not depend on the thread count. A value whose nearest half
is infinite stays infinite, and stochastic rounding never rounds up to infinity, as
:func:`neorec.trainer.embedding.kernels.torch_ops._round` does.
"""

from __future__ import annotations

import functools
import re

import llvmlite.binding
import numba
import numba.core.codegen
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from neorec.common.hashing import FMIX32_1, FMIX32_2, GOLDEN, MIX1, MIX2, SALT, fold_mix32_jit

FP32 = 0
FP16 = 1
BF16 = 2
PRECISIONS = {"fp32": FP32, "fp16": FP16, "bf16": BF16}

_FP16_INFINITY = 0x7C00
_FP16_NAN = 0x7E00
_BF16_NAN = 0x7FC0
_FLOAT32_INFINITY = 0x7F800000
_FLOAT32_QUIET = 0x400000
"""The bit that makes a float32 NaN quiet."""
_FP16_REBIAS = 112 << 23
"""float32 bits of a fp16 magnitude shifted into place carry an exponent 112 too small."""
_FP16_SUBNORMAL_UNIT = np.float32(2.0 ** -24)
"""The value of a fp16 subnormal's least significant bit."""


@intrinsic
def _float_of_bits(typingctx, bits):
    """The float32 whose bit pattern is the uint32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_float(typingctx, value):
    """The uint32 bit pattern of the float32 ``value``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@numba.njit(inline="always")
def decode(bits: np.uint16, precision: int) -> np.float32:
    """float32 value of a fp16 or bf16 bit pattern (exact; a fp16 NaN comes back quiet, as
    the CPUs' own conversions return it, so that :func:`decode_lanes` can use them)."""
    h = np.uint32(bits)
    if precision == BF16:
        return _float_of_bits(h << np.uint32(16))
    magnitude = (h & np.uint32(0x7FFF)) << np.uint32(13)
    if magnitude >= np.uint32(_FP16_INFINITY << 13):  # infinity or NaN: all-ones exponent
        quiet = np.uint32(_FLOAT32_QUIET) if magnitude > np.uint32(_FP16_INFINITY << 13) else np.uint32(0)
        value = _float_of_bits(magnitude | np.uint32(_FLOAT32_INFINITY) | quiet)
    elif magnitude >= np.uint32(1 << 23):  # normal: the exponent rebiased
        value = _float_of_bits(magnitude + np.uint32(_FP16_REBIAS))
    else:  # subnormal (zero too): the significand in units of 2**-24, no float32 subnormal
        # on the way (a CPU set to treat those as zero would lose it)
        value = np.float32(h & np.uint32(0x3FF)) * _FP16_SUBNORMAL_UNIT
    return _float_of_bits(_bits_of_float(value) | ((h & np.uint32(0x8000)) << np.uint32(16)))


@numba.njit(inline="always")
def encode(x: np.float32, precision: int, noise: float) -> np.uint16:
    """fp16 or bf16 bit pattern of ``x``: ties to even when ``noise < 0``, else away from
    zero when ``noise >= 1 - fraction`` (``noise`` uniform in [0, 1): stochastic rounding)."""
    b = _bits_of_float(np.float32(x))
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    a = b & np.uint32(0x7FFFFFFF)
    if a > np.uint32(_FLOAT32_INFINITY):
        return np.uint16(sign | np.uint32(_BF16_NAN if precision == BF16 else _FP16_NAN))
    if precision == BF16:
        base, shift, infinity = a, 16, _FLOAT32_INFINITY >> 16
    elif a >= np.uint32(0x47800000):  # >= 2**16, infinity included: beyond fp16 at any rounding
        return np.uint16(sign | np.uint32(_FP16_INFINITY))
    elif a >= np.uint32(0x38800000):  # fp16 normal range (>= 2**-14): rebias the exponent
        base, shift, infinity = a - np.uint32(112 << 23), 13, _FP16_INFINITY
    else:  # fp16 subnormal: the significand, scaled to units of 2**-24
        exponent = max(np.int64(a >> np.uint32(23)), 1) - 127
        base = (a & np.uint32(0x7FFFFF)) | (np.uint32(0x800000) if a >= np.uint32(0x800000) else np.uint32(0))
        shift, infinity = -1 - exponent, _FP16_INFINITY
    kept = min(shift, 31)  # past 25 bits every significand is below halfway: truncated to 0
    truncated, remainder = base >> np.uint32(kept), base & np.uint32((1 << kept) - 1)
    halfway = np.uint32(1 << (kept - 1))
    odd = (truncated & np.uint32(1)) == np.uint32(1)
    # bitwise, not short-circuit, logic throughout: the outcome is a coin toss, and a branch
    # on it would be mispredicted half the time
    nearest = truncated + np.uint32((remainder > halfway) | ((remainder == halfway) & odd))
    if noise < 0 or nearest >= np.uint32(infinity):
        return np.uint16(sign | nearest)
    if shift <= 53:  # noise * 2**53 is an integer; noise >= 1 - remainder / 2**shift, exactly:
        scaled_noise = np.uint64(np.int64(noise * 9007199254740992.0)) >> np.uint64(53 - shift)
        up = scaled_noise + np.uint64(remainder) >= np.uint64(1) << np.uint64(shift)
    else:  # fp16 of |x| < 2**-39: the remainder's fraction rounds in float64, as torch's does
        up = noise >= 1.0 - np.float64(remainder) * 2.0 ** -shift
    up = up & (truncated + np.uint32(1) < np.uint32(infinity))
    return np.uint16(sign | (truncated + np.uint32(up)))


_FAST_LOWEST = {FP16: 95 << 23, BF16: 0}
_FAST_HIGHEST = {FP16: 0x477FE000, BF16: 0x7F7F0000}
"""By half-precision code: nonzero float32 magnitudes (as bits) that :func:`_encode_lanes`
encodes, zero aside: fp16 from 2**-32 (a subnormal's rounding then shifts out at most 31
bits, so the sum of its significand and the noise stays within 32 bits) to 65504, the
largest value no rounding takes to infinity; bf16 up to its largest finite value."""
BLOCK = 16
"""Elements :func:`_encode_lanes` and :func:`decode_lanes` convert at once."""


@numba.njit(inline="always")
def encode_row(row, bits, dim, precision, seed, step, first_element):
    """``bits[:dim]`` = :func:`encode` of float32 ``row[:dim]`` (both C-contiguous), rounding
    to nearest even when ``seed < 0``, else stochastically with element ``first_element + d``'s
    noise (:func:`noise_of`). Equal, bit for bit, to encoding one element at a time: blocks
    of :data:`BLOCK` in 32-bit vector lanes, then, one at a time, the elements past the last
    whole block; a row with an element outside the blocks' range (a NaN, an infinity, a
    value that rounds to infinity, fp16 below 2**-32: rare) is encoded again whole, one
    element at a time."""
    stochastic = seed >= 0
    key = noise_key(seed, step, first_element) if stochastic else np.uint64(0)
    whole = dim - dim % BLOCK
    inside = True
    for d in range(0, whole, BLOCK):
        inside &= _encode_lanes(row, d, bits, d, precision == BF16, stochastic, key + np.uint64(d) * np.uint64(MIX2))
    for d in range(whole if inside else 0, dim):
        noise = noise_of(seed, step, first_element + d) if stochastic else -1.0
        bits[d] = encode(row[d], precision, noise)


@numba.njit(inline="always")
def noise_key(seed: int, step: int, element: int) -> np.uint64:
    """The 64-bit key of element ``element``'s rounding noise at ``step``: a linear
    combination of the three, so consecutive elements' keys differ by ``MIX2``."""
    z = np.uint64(seed) * np.uint64(GOLDEN) + np.uint64(step) * np.uint64(MIX1)
    return z + np.uint64(element) * np.uint64(MIX2) + np.uint64(SALT)


@numba.njit(inline="always")
def noise_of(seed: int, step: int, element: int) -> np.float64:
    """Stochastic rounding's noise, uniform in [0, 1) in steps of 2**-32:
    :func:`neorec.common.hashing.fold_mix32` of :func:`noise_key`, over 2**32."""
    return np.float64(fold_mix32_jit(noise_key(seed, step, element))) * (1.0 / 4294967296.0)


_I32 = ir.IntType(32)
_LANE_VECTOR = ir.VectorType(_I32, BLOCK)
_KEY_VECTOR = ir.VectorType(ir.IntType(64), BLOCK)
_BITS_VECTOR = ir.VectorType(ir.IntType(16), BLOCK)
_FLOAT_VECTOR = ir.VectorType(ir.FloatType(), BLOCK)


def _lanes(value: int, vector: ir.VectorType = _LANE_VECTOR) -> ir.Constant:
    """``value`` in every lane of ``vector``."""
    return ir.Constant(vector, [value] * BLOCK)


def _contiguous(array: types.Type, dtype: types.Type) -> bool:
    """Whether Numba type ``array`` is a 1-D C-contiguous array of ``dtype``."""
    return isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C" and array.dtype == dtype


def _element_pointer(context, builder: ir.IRBuilder, signature, args, position: int) -> ir.Value:
    """Pointer to ``array[index]`` for the intrinsic arguments ``array`` at ``position`` and
    ``index`` after it (cast to ``intp``; unchecked)."""
    array_type, index_type = signature.args[position], signature.args[position + 1]
    array = context.make_array(array_type)(context, builder, args[position])
    index = context.cast(builder, args[position + 1], index_type, types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, array, [index], wraparound=False,
                                    boundscheck=False)


@intrinsic
def _encode_lanes(typingctx, row, start, bits, bits_start, bf16, stochastic, key):
    """``_encode_lanes(row, start, bits, bits_start, bf16, stochastic, key)``:
    ``bits[bits_start : bits_start + 16]`` = :func:`encode` (fp16, or bf16 if ``bf16``) of
    float32 ``row[start : start + 16]``, right where every one of them is zero or inside
    :data:`_FAST_LOWEST`..:data:`_FAST_HIGHEST`, which it returns (bool). Stochastically if
    ``stochastic``, ``key`` being the first element's :func:`noise_key`, else to nearest
    even. In ``<16 x i32>`` vectors: Numba widens 32-bit integer arithmetic (comparisons
    too) to 64 bits, and 64-bit lanes (their products most of all) are slow where vectors
    are 256 bits."""
    if not (_contiguous(row, types.float32) and _contiguous(bits, types.uint16)):
        return None

    def codegen(context, builder, signature, args):
        source = _element_pointer(context, builder, signature, args, 0)
        target = _element_pointer(context, builder, signature, args, 2)
        b = builder.load(builder.bitcast(source, _LANE_VECTOR.as_pointer()), align=4)
        a = builder.and_(b, _lanes(0x7FFFFFFF))
        # fp16 as encode computes it: normal values rebias the exponent; subnormals (zero
        # too) shift the significand by 126 - exponent, at most 31 here
        exponent = builder.lshr(a, _lanes(23))
        normal = builder.icmp_unsigned(">=", exponent, _lanes(113))
        implicit = builder.select(builder.icmp_unsigned("!=", exponent, _lanes(0)), _lanes(0x800000), _lanes(0))
        significand = builder.or_(builder.and_(a, _lanes(0x7FFFFF)), implicit)
        subnormal_shift = builder.sub(_lanes(126), exponent)
        subnormal_shift = builder.select(builder.icmp_unsigned("<", subnormal_shift, _lanes(31)), subnormal_shift,
                                         _lanes(31))
        is_bf16 = context.cast(builder, args[4], signature.args[4], types.boolean)
        base = builder.select(is_bf16, a, builder.select(normal, builder.sub(a, _lanes(112 << 23)), significand))
        shift = builder.select(is_bf16, _lanes(16), builder.select(normal, _lanes(13), subnormal_shift))
        with builder.if_else(context.cast(builder, args[5], signature.args[5], types.boolean)) as (noisy, even):
            with noisy:  # the top `shift` bits of each element's 32 noise bits
                first = builder.insert_element(ir.Constant(_KEY_VECTOR, ir.Undefined), args[6], _I32(0))
                keys = builder.shuffle_vector(first, ir.Constant(_KEY_VECTOR, ir.Undefined), _lanes(0))
                keys = builder.add(keys, ir.Constant(_KEY_VECTOR, [i * MIX2 & (1 << 64) - 1 for i in range(BLOCK)]))
                folded = builder.xor(builder.trunc(keys, _LANE_VECTOR),
                                     builder.trunc(builder.lshr(keys, _lanes(32, _KEY_VECTOR)), _LANE_VECTOR))
                noise_carry = builder.lshr(_fmix32_lanes(builder, folded), builder.sub(_lanes(32), shift))
                noisy_block = builder.block
            with even:  # just under half a unit, plus one if the kept part is odd
                half = builder.sub(builder.shl(_lanes(1), builder.sub(shift, _lanes(1))), _lanes(1))
                even_carry = builder.add(half, builder.and_(builder.lshr(base, shift), _lanes(1)))
                even_block = builder.block
        carry = builder.phi(_LANE_VECTOR)
        carry.add_incoming(noise_carry, noisy_block)
        carry.add_incoming(even_carry, even_block)
        sign = builder.and_(builder.lshr(b, _lanes(16)), _lanes(0x8000))
        encoded = builder.or_(sign, builder.lshr(builder.add(base, carry), shift))
        builder.store(builder.trunc(encoded, _BITS_VECTOR), builder.bitcast(target, _BITS_VECTOR.as_pointer()),
                      align=2)
        return _all_inside(builder, a, is_bf16)

    return types.boolean(row, start, bits, bits_start, bf16, stochastic, key), codegen


def _all_inside(builder: ir.IRBuilder, magnitudes: ir.Value, is_bf16: ir.Value) -> ir.Value:
    """Whether every lane of ``magnitudes`` (``<16 x i32>`` float32 bits, sign cleared) is
    zero or inside the fast range of bf16 (if ``is_bf16``) or fp16, as an ``i1``."""
    lowest = builder.select(is_bf16, _lanes(_FAST_LOWEST[BF16]), _lanes(_FAST_LOWEST[FP16]))
    highest = builder.select(is_bf16, _lanes(_FAST_HIGHEST[BF16]), _lanes(_FAST_HIGHEST[FP16]))
    # below 2**31, so signed comparisons, which vector units have, order them
    inside = builder.and_(builder.icmp_signed(">=", magnitudes, lowest), builder.icmp_signed("<=", magnitudes, highest))
    inside = builder.or_(inside, builder.icmp_signed("==", magnitudes, _lanes(0)))
    return builder.icmp_signed("==", builder.bitcast(inside, ir.IntType(BLOCK)), ir.IntType(BLOCK)(-1))


@numba.njit(inline="always")
def decode_row(bits, row, dim, precision):
    """float32 ``row[:dim]`` = :func:`decode` of ``bits[:dim]`` (both C-contiguous): blocks
    of :data:`BLOCK` in 32-bit vector lanes, the rest one at a time."""
    whole = dim - dim % BLOCK
    for d in range(0, whole, BLOCK):
        decode_lanes(bits, d, precision == BF16, row, d)
    for d in range(whole, dim):
        row[d] = decode(bits[d], precision)


@functools.cache
def converts_half_in_hardware() -> bool:
    """Whether the CPU Numba compiles for (its name and features, ``NUMBA_CPU_NAME`` and
    ``NUMBA_CPU_FEATURES`` included) converts a vector of fp16 to float32 in instructions of
    its own (x86 with F16C: ``vcvtph2ps``; 64-bit ARM: ``fcvtl``): a probe conversion is
    compiled for it, and without them LLVM calls a runtime function, which the JIT may not
    link. Asked when a kernel using :func:`decode_lanes` is compiled, not at import."""
    cpu = numba.config.CPU_NAME or llvmlite.binding.get_host_cpu_name()  # as Numba's JIT chooses them
    features = numba.config.CPU_FEATURES
    if features is None:
        features = numba.core.codegen.get_host_cpu_features()
    triple = llvmlite.binding.get_process_triple()
    machine = llvmlite.binding.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features, opt=2)
    module = ir.Module("half_probe")
    module.triple = triple
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), [_BITS_VECTOR.as_pointer(),
                                                                   _FLOAT_VECTOR.as_pointer()]), "probe")
    builder = ir.IRBuilder(function.append_basic_block())
    loaded = builder.load(function.args[0], align=2)
    builder.store(builder.fpext(builder.bitcast(loaded, ir.VectorType(ir.HalfType(), BLOCK)), _FLOAT_VECTOR),
                  function.args[1], align=4)
    builder.ret_void()
    assembly = machine.emit_assembly(llvmlite.binding.parse_assembly(str(module)))
    return not re.search(r"^\s*(call|callq|jmp|bl|b)\s", assembly, re.MULTILINE)


@intrinsic
def decode_lanes(typingctx, bits, start, bf16, row, row_start):
    """``decode_lanes(bits, start, bf16, row, row_start)``: float32
    ``row[row_start : row_start + 16]`` = :func:`decode` (fp16, or bf16 if ``bf16``) of
    ``bits[start : start + 16]``, bit for bit: bf16 by a shift, fp16 by the CPU's
    conversion where it has one (:func:`converts_half_in_hardware`: on x86 without AVX-512
    three times as fast), else by :func:`decode`'s integer operations in ``<16 x i32>``
    vectors (see :func:`_encode_lanes`). ``bits``: uint16, ``row``: float32, both 1-D and
    C-contiguous."""
    if not (_contiguous(bits, types.uint16) and _contiguous(row, types.float32)):
        return None

    def codegen(context, builder, signature, args):
        source = _element_pointer(context, builder, signature, args, 0)
        target = builder.bitcast(_element_pointer(context, builder, signature, args, 3), _FLOAT_VECTOR.as_pointer())
        loaded = builder.load(builder.bitcast(source, _BITS_VECTOR.as_pointer()), align=2)
        with builder.if_else(context.cast(builder, args[2], signature.args[2], types.boolean)) as (bf16, fp16):
            with bf16:
                shifted = builder.shl(builder.zext(loaded, _LANE_VECTOR), _lanes(16))
                builder.store(builder.bitcast(shifted, _FLOAT_VECTOR), target, align=4)
            with fp16:
                builder.store(_fp16_to_float(builder, loaded), target, align=4)
        return context.get_dummy_value()

    return types.void(bits, start, bf16, row, row_start), codegen


def _fp16_to_float(builder: ir.IRBuilder, loaded: ir.Value) -> ir.Value:
    """``<16 x float>`` of the fp16 bit patterns ``loaded`` (``<16 x i16>``), as
    :func:`decode` gives them."""
    if converts_half_in_hardware():
        return builder.fpext(builder.bitcast(loaded, ir.VectorType(ir.HalfType(), BLOCK)), _FLOAT_VECTOR)
    h = builder.zext(loaded, _LANE_VECTOR)
    # as decode: infinities and NaNs (made quiet) keep an all-ones exponent, normal values
    # rebias theirs, subnormals are their significand times 2**-24
    magnitude = builder.shl(builder.and_(h, _lanes(0x7FFF)), _lanes(13))
    infinity = _lanes(_FP16_INFINITY << 13)
    quiet = builder.select(builder.icmp_unsigned(">", magnitude, infinity), _lanes(_FLOAT32_QUIET | _FLOAT32_INFINITY),
                           _lanes(_FLOAT32_INFINITY))
    significand = builder.uitofp(builder.and_(h, _lanes(0x3FF)), _FLOAT_VECTOR)
    subnormal = builder.fmul(significand, ir.Constant(_FLOAT_VECTOR, [float(_FP16_SUBNORMAL_UNIT)] * BLOCK))
    finite = builder.select(builder.icmp_unsigned(">=", magnitude, _lanes(1 << 23)),
                            builder.add(magnitude, _lanes(_FP16_REBIAS)), builder.bitcast(subnormal, _LANE_VECTOR))
    unsigned = builder.select(builder.icmp_unsigned(">=", magnitude, infinity), builder.or_(magnitude, quiet), finite)
    signed = builder.or_(unsigned, builder.shl(builder.and_(h, _lanes(0x8000)), _lanes(16)))
    return builder.bitcast(signed, _FLOAT_VECTOR)


def _fmix32_lanes(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """:func:`neorec.common.hashing.fold_mix32`'s finalizer on ``<16 x i32>`` lanes."""
    x = builder.xor(x, builder.lshr(x, _lanes(16)))
    x = builder.mul(x, _lanes(FMIX32_1))
    x = builder.xor(x, builder.lshr(x, _lanes(13)))
    x = builder.mul(x, _lanes(FMIX32_2))
    return builder.xor(x, builder.lshr(x, _lanes(16)))
