"""Half-precision weight storage: fp16 and bf16 held as uint16 bit patterns (Numba has no
CPU half type), converted to and from float32 one element at a time.

Rounding to half precision is to nearest, ties to even (as torch's conversions), or
stochastic: up with probability equal to the remainder, from a hash of
``(seed, step, element)`` so the result does not depend on the thread count.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ingest.hashing import GOLDEN, MIX1, MIX2, SALT, mix64_jit

FP32 = 0
FP16 = 1
BF16 = 2
PRECISIONS = {"fp32": FP32, "fp16": FP16, "bf16": BF16}

# per half format: mantissa bits, exponent bias, largest finite exponent field
_MANTISSA = (0, 10, 7)
_BIAS = (0, 15, 127)
_MAX_EXPONENT = (0, 30, 254)


@numba.njit(inline="always")
def decode(bits: np.uint16, precision: int) -> np.float32:
    """float32 value of a fp16 or bf16 bit pattern."""
    m_bits, bias = _MANTISSA[precision], _BIAS[precision]
    h = np.int64(bits)
    exponent = (h >> m_bits) & ((1 << (15 - m_bits)) - 1)
    mantissa = h & ((1 << m_bits) - 1)
    if exponent == _MAX_EXPONENT[precision] + 1:
        value = np.inf if mantissa == 0 else np.nan
    elif exponent == 0:
        value = math.ldexp(np.float64(mantissa), 1 - bias - m_bits)
    else:
        value = math.ldexp(np.float64(mantissa + (1 << m_bits)), exponent - bias - m_bits)
    return np.float32(-value if h & 0x8000 else value)


@numba.njit(inline="always")
def encode(x: np.float32, precision: int, noise: float) -> np.uint16:
    """fp16 or bf16 bit pattern of ``x``: ties to even when ``noise < 0``, else rounded up
    when the remainder exceeds ``noise`` (uniform in [0, 1): stochastic rounding)."""
    m_bits, bias = _MANTISSA[precision], _BIAS[precision]
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = abs(np.float64(x))
    if a != a:
        return np.uint16(sign | (((1 << (15 - m_bits)) - 1) << m_bits) | (1 << (m_bits - 1)))
    infinity = sign | ((_MAX_EXPONENT[precision] + 1) << m_bits)
    if a == np.inf:
        return np.uint16(infinity)
    if a == 0.0:
        return np.uint16(sign)
    exponent = math.frexp(a)[1] - 1
    exponent = max(exponent, 1 - bias)  # below: subnormal, fixed scale
    scaled = math.ldexp(a, m_bits - exponent)
    if noise < 0:
        mantissa = np.int64(np.rint(scaled))
    else:
        mantissa = np.int64(math.floor(scaled + noise))
    if mantissa >= (2 << m_bits):
        mantissa >>= 1
        exponent += 1
    if mantissa < (1 << m_bits):  # subnormal (exponent field 0); carry into 1 is normal
        return np.uint16(sign | mantissa)
    if exponent + bias > _MAX_EXPONENT[precision]:
        return np.uint16(infinity)
    return np.uint16(sign | ((exponent + bias) << m_bits) | (mantissa - (1 << m_bits)))


@numba.njit(inline="always")
def uniform_noise(seed: int, step: int, element: int) -> float:
    """Uniform [0, 1) from ``(seed, step, element)``: :func:`ingest.hashing.mix64` of a
    linear combination of the three."""
    z = np.uint64(seed) * np.uint64(GOLDEN) + np.uint64(step) * np.uint64(MIX1)
    z = z + np.uint64(element) * np.uint64(MIX2) + np.uint64(SALT)
    return np.float64(mix64_jit(z) >> np.uint64(11)) * (1.0 / 9007199254740992.0)
