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

import platform

import llvmlite.binding
import numba
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
_FP16_SCALE = np.float32(2.0 ** 112)
"""float32 bits of a fp16 magnitude shifted into place carry an exponent 112 too small."""


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
    else:  # normal and subnormal alike: the product is exact
        value = _float_of_bits(magnitude) * _FP16_SCALE
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


_FAST_LOWEST = (0, 95 << 23, 0)
_FAST_HIGHEST = (0, 0x477FE000, 0x7F7F0000)
"""By precision code: nonzero float32 magnitudes (as bits) that :func:`_encode_lanes`
encodes, zero aside: fp16 from 2**-32 (a subnormal's rounding then shifts out at most 31
bits, so the sum of its significand and the noise stays within 32 bits) to 65504, the
largest value no rounding takes to infinity; bf16 up to its largest finite value."""
LANES = 16
"""Elements :func:`_encode_lanes` encodes at once."""


@numba.njit(inline="always")
def encode_row(row, bits, dim, precision, seed, step, first_element):
    """``bits[:dim]`` = :func:`encode` of float32 ``row[:dim]`` (both C-contiguous), rounding
    to nearest even when ``seed < 0``, else stochastically with element ``first_element + d``'s
    noise (:func:`noise_of`). Equal, bit for bit, to encoding one element at a time: blocks
    of :data:`LANES` in 32-bit vector lanes, then, one at a time, the elements past the last
    whole block and those outside the blocks' range (NaNs, infinities, values that round
    to infinity, fp16 below 2**-32), whose blocks' bits are overwritten."""
    stochastic = seed >= 0
    key = noise_key(seed, step, first_element) if stochastic else np.uint64(0)
    whole = dim - dim % LANES
    for d in range(0, whole, LANES):
        _encode_lanes(row, d, bits, d, precision == BF16, stochastic, key + np.uint64(d) * np.uint64(MIX2))
    lowest, highest = _FAST_LOWEST[precision], _FAST_HIGHEST[precision]
    inside = True
    for d in range(whole):
        a = _bits_of_float(row[d]) & np.uint32(0x7FFFFFFF)
        inside &= (a == np.uint32(0)) | ((a >= np.uint32(lowest)) & (a <= np.uint32(highest)))
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
_LANE_VECTOR = ir.VectorType(_I32, LANES)
_KEY_VECTOR = ir.VectorType(ir.IntType(64), LANES)
_BITS_VECTOR = ir.VectorType(ir.IntType(16), LANES)


def _lanes(value: int, vector: ir.VectorType = _LANE_VECTOR) -> ir.Constant:
    """``value`` in every lane of ``vector``."""
    return ir.Constant(vector, [value] * LANES)


@intrinsic
def _encode_lanes(typingctx, row, start, bits, bits_start, bf16, stochastic, key):
    """``_encode_lanes(row, start, bits, bits_start, bf16, stochastic, key)``:
    ``bits[bits_start : bits_start + 16]`` = :func:`encode` (fp16, or bf16 if ``bf16``) of
    float32 ``row[start : start + 16]``, every one of them zero or inside
    :data:`_FAST_LOWEST`..:data:`_FAST_HIGHEST` (others get wrong bits). Stochastically if
    ``stochastic``, ``key`` being the first element's :func:`noise_key`, else to nearest
    even. In ``<16 x i32>`` vectors: Numba widens 32-bit integer arithmetic to 64 bits,
    and 64-bit lanes (their products most of all) are slow where vectors are 256 bits."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (row, bits)):
        return None

    def codegen(context, builder, signature, args):
        row_type, _, bits_type, _, _, _, _ = signature.args
        source = cgutils.get_item_pointer(context, builder, row_type, context.make_array(row_type)(
            context, builder, args[0]), [args[1]], wraparound=False, boundscheck=False)
        target = cgutils.get_item_pointer(context, builder, bits_type, context.make_array(bits_type)(
            context, builder, args[2]), [args[3]], wraparound=False, boundscheck=False)
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
                keys = builder.add(keys, ir.Constant(_KEY_VECTOR, [i * MIX2 & (1 << 64) - 1 for i in range(LANES)]))
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
        return context.get_dummy_value()

    return types.void(row, start, bits, bits_start, bf16, stochastic, key), codegen


@numba.njit(inline="always")
def decode_row(bits, row, dim, precision):
    """float32 ``row[:dim]`` = :func:`decode` of ``bits[:dim]`` (both C-contiguous): blocks
    of :data:`LANES` in 32-bit vector lanes, the rest one at a time."""
    whole = dim - dim % LANES
    for d in range(0, whole, LANES):
        decode_lanes(bits, d, precision == BF16, row, d)
    for d in range(whole, dim):
        row[d] = decode(bits[d], precision)


def _converts_half_in_hardware() -> bool:
    """Whether LLVM turns a vector conversion from fp16 to float32 into a few instructions
    for the CPU Numba compiles for: the host (no ``NUMBA_CPU_NAME`` set), 64-bit ARM or x86
    with F16C. Elsewhere it would call a runtime function the JIT may not link."""
    if numba.config.CPU_NAME is not None:
        return False
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    try:
        return bool(llvmlite.binding.get_host_cpu_features().get("f16c", False))
    except RuntimeError:  # features unknown on this host
        return False


HARDWARE_HALF = _converts_half_in_hardware()
"""Whether :func:`decode_lanes` converts fp16 with the CPU's instructions (``vcvtph2ps``,
``fcvtl``): on x86 without AVX-512, three times as fast as the integer operations."""


@intrinsic
def decode_lanes(typingctx, bits, start, bf16, row, row_start):
    """``decode_lanes(bits, start, bf16, row, row_start)``: float32
    ``row[row_start : row_start + 16]`` = :func:`decode` (fp16, or bf16 if ``bf16``) of
    ``bits[start : start + 16]``, bit for bit: bf16 by a shift, fp16 by the CPU's
    conversion where it has one (:data:`HARDWARE_HALF`), else by :func:`decode`'s integer
    operations in ``<16 x i32>`` vectors (see :func:`_encode_lanes`)."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (bits, row)):
        return None

    def codegen(context, builder, signature, args):
        bits_type, _, _, row_type, _ = signature.args
        source = cgutils.get_item_pointer(context, builder, bits_type, context.make_array(bits_type)(
            context, builder, args[0]), [args[1]], wraparound=False, boundscheck=False)
        target = cgutils.get_item_pointer(context, builder, row_type, context.make_array(row_type)(
            context, builder, args[3]), [args[4]], wraparound=False, boundscheck=False)
        float_vector = ir.VectorType(ir.FloatType(), LANES)
        target = builder.bitcast(target, float_vector.as_pointer())
        loaded = builder.load(builder.bitcast(source, _BITS_VECTOR.as_pointer()), align=2)
        with builder.if_else(context.cast(builder, args[2], signature.args[2], types.boolean)) as (bf16, fp16):
            with bf16:
                shifted = builder.shl(builder.zext(loaded, _LANE_VECTOR), _lanes(16))
                builder.store(builder.bitcast(shifted, float_vector), target, align=4)
            with fp16:
                builder.store(_fp16_to_float(builder, loaded), target, align=4)
        return context.get_dummy_value()

    return types.void(bits, start, bf16, row, row_start), codegen


def _fp16_to_float(builder: ir.IRBuilder, loaded: ir.Value) -> ir.Value:
    """``<16 x float>`` of the fp16 bit patterns ``loaded`` (``<16 x i16>``), as
    :func:`decode` gives them."""
    float_vector = ir.VectorType(ir.FloatType(), LANES)
    if HARDWARE_HALF:
        return builder.fpext(builder.bitcast(loaded, ir.VectorType(ir.HalfType(), LANES)), float_vector)
    h = builder.zext(loaded, _LANE_VECTOR)
    # infinities and NaNs (made quiet) keep an all-ones exponent; every other magnitude is
    # exact times 2**112
    magnitude = builder.shl(builder.and_(h, _lanes(0x7FFF)), _lanes(13))
    special = builder.icmp_unsigned(">=", magnitude, _lanes(_FP16_INFINITY << 13))
    nan = builder.icmp_unsigned(">", magnitude, _lanes(_FP16_INFINITY << 13))
    quiet = builder.select(nan, _lanes(_FLOAT32_QUIET | _FLOAT32_INFINITY), _lanes(_FLOAT32_INFINITY))
    scaled = builder.fmul(builder.bitcast(magnitude, float_vector),
                          ir.Constant(float_vector, [float(_FP16_SCALE)] * LANES))
    unsigned = builder.select(special, builder.or_(magnitude, quiet), builder.bitcast(scaled, _LANE_VECTOR))
    signed = builder.or_(unsigned, builder.shl(builder.and_(h, _lanes(0x8000)), _lanes(16)))
    return builder.bitcast(signed, float_vector)


def _fmix32_lanes(builder: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """:func:`neorec.common.hashing.fold_mix32`'s finalizer on ``<16 x i32>`` lanes."""
    x = builder.xor(x, builder.lshr(x, _lanes(16)))
    x = builder.mul(x, _lanes(FMIX32_1))
    x = builder.xor(x, builder.lshr(x, _lanes(13)))
    x = builder.mul(x, _lanes(FMIX32_2))
    return builder.xor(x, builder.lshr(x, _lanes(16)))
