"""Half-precision weight storage: fp16 and bf16 held as uint16 bit patterns (Numba has no
CPU half type), converted to and from float32 one element at a time with integer
operations on the float's bits (branch-free in the common case, so the kernels' loops over
a row vectorize).

Rounding to half precision is to nearest, ties to even (as torch's conversions), or
stochastic: away from zero with probability equal to the remainder's fraction of the gap
between the two half values around it, from a hash of ``(seed, step, element)`` so the
result does not depend on the thread count. A value whose nearest half is infinite stays
infinite, and stochastic rounding never rounds up to infinity, as
:func:`neorec.trainer.embedding.kernels.torch_ops._round` does.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from neorec.common.hashing import GOLDEN, MIX1, MIX2, SALT, mix64_jit

FP32 = 0
FP16 = 1
BF16 = 2
PRECISIONS = {"fp32": FP32, "fp16": FP16, "bf16": BF16}

_FP16_INFINITY = 0x7C00
_FP16_NAN = 0x7E00
_BF16_NAN = 0x7FC0
_FLOAT32_INFINITY = 0x7F800000
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
    """float32 value of a fp16 or bf16 bit pattern (exact)."""
    h = np.uint32(bits)
    if precision == BF16:
        return _float_of_bits(h << np.uint32(16))
    magnitude = (h & np.uint32(0x7FFF)) << np.uint32(13)
    if magnitude >= np.uint32(_FP16_INFINITY << 13):  # infinity or NaN: all-ones exponent
        value = _float_of_bits(magnitude | np.uint32(_FLOAT32_INFINITY))
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


_FAST_LOWEST = (0, 73 << 23, 0)
_FAST_HIGHEST = (0, 0x477FE000, 0x7F7F0000)
"""By precision code: nonzero float32 magnitudes (as bits) that :func:`encode_row`'s vectorized
loop encodes, zero aside: fp16 from 2**-54 (where a subnormal's rounding needs at most 53
noise bits, as in :func:`encode`) to 65504, the largest value no rounding takes to infinity;
bf16 up to its largest finite value."""


@numba.njit(inline="always")
def encode_row(row, bits, dim, precision, seed, step, first_element, noise_bits):
    """``bits[:dim]`` = :func:`encode` of float32 ``row[:dim]``, rounding to nearest even
    when ``seed < 0``, else stochastically with element ``first_element + d``'s noise;
    ``noise_bits``: uint64 scratch of at least ``dim`` elements. Equal, bit for bit, to
    encoding one element at a time."""
    stochastic = seed >= 0
    if stochastic:
        for d in range(dim):
            noise_bits[d] = noise_bits_of(seed, step, first_element + d)
    lowest, highest = _FAST_LOWEST[precision], _FAST_HIGHEST[precision]
    inside = True
    for d in range(dim):
        a = _bits_of_float(row[d]) & np.uint32(0x7FFFFFFF)
        inside &= (a == np.uint32(0)) | ((a >= np.uint32(lowest)) & (a <= np.uint32(highest)))
    if not inside:
        for d in range(dim):
            noise = np.float64(noise_bits[d]) * (1.0 / 9007199254740992.0) if stochastic else -1.0
            bits[d] = encode(row[d], precision, noise)
        return
    for d in range(dim):
        b = _bits_of_float(row[d])
        a = b & np.uint32(0x7FFFFFFF)
        if precision == BF16:
            base, shift = np.uint64(a), np.uint64(16)
        else:  # fp16 normal: rebias the exponent; subnormal (zero too): the significand, in
            # units of 2**-24 once shifted (see encode); selects, not branches, so it vectorizes
            exponent = a >> np.uint32(23)
            normal = exponent >= np.uint32(113)
            significand = (a & np.uint32(0x7FFFFF)) | (np.uint32(0x800000) if exponent > 0 else np.uint32(0))
            base = np.uint64(a - np.uint32(112 << 23)) if normal else np.uint64(significand)
            shift = np.uint64(13) if normal else np.uint64(min(np.uint32(126) - exponent, np.uint32(53)))
        if stochastic:  # the top `shift` of the noise's 53 bits: see encode
            carry = noise_bits[d] >> (np.uint64(53) - shift)
        else:  # ties to even
            carry = ((np.uint64(1) << (shift - np.uint64(1))) - np.uint64(1)) + ((base >> shift) & np.uint64(1))
        bits[d] = np.uint16(((b >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32((base + carry) >> shift))


@numba.njit(inline="always")
def noise_bits_of(seed: int, step: int, element: int) -> np.uint64:
    """53 uniform random bits from ``(seed, step, element)``: :func:`neorec.common.hashing.mix64`
    of a linear combination of the three."""
    z = np.uint64(seed) * np.uint64(GOLDEN) + np.uint64(step) * np.uint64(MIX1)
    z = z + np.uint64(element) * np.uint64(MIX2) + np.uint64(SALT)
    return mix64_jit(z) >> np.uint64(11)

