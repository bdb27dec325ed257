"""Array conversions: numpy or torch in, little-endian numpy bytes out.

numpy has no bfloat16, so bf16 data travels as uint16 bit patterns; a torch bf16 tensor is
viewed as int16 bits (no copy on the host, one device-to-host copy on a GPU). Nor has it an fp8
type: an e4m3 KV pool (torch.float8_e4m3fn) travels as uint8 bit patterns.
"""

import sys

import numpy as np

from .errors import InvalidBundleError

BF16_NAN = np.uint16(0x7FC0)


def is_torch(x):
    """True for a torch.Tensor; torch itself stays optional."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def bf16_bits(name, x):
    """bf16 data as a C-contiguous uint16 numpy array of bit patterns.

    Accepts a torch.bfloat16 tensor (any device) or a numpy uint16/int16 array of bf16 bits.
    """
    if is_torch(x):
        import torch  # noqa: PLC0415 - present whenever x is a tensor

        if x.dtype != torch.bfloat16:
            raise InvalidBundleError(
                f"{name}: dtype {x.dtype}, expected torch.bfloat16")
        return np.ascontiguousarray(x.detach().contiguous().view(torch.int16).cpu().numpy()
                                    .view(np.uint16))
    a = np.asarray(x)
    if a.dtype not in (np.uint16, np.int16):
        raise InvalidBundleError(
            f"{name}: dtype {a.dtype}, expected bf16 bits (uint16 or int16; "
            f"convert floats with verifyd_client.to_bf16)")
    return np.ascontiguousarray(a.view(np.uint16))


KV_BF16 = "bf16"
KV_E4M3 = "e4m3"


def kv_dtype_of(name, x):
    """The pool's element type without touching its data: "bf16" for torch.bfloat16 or numpy
    uint16/int16 bits, "e4m3" for torch.float8_e4m3fn or numpy uint8/int8 bits."""
    if is_torch(x):
        import torch  # noqa: PLC0415 - present whenever x is a tensor

        if x.dtype == torch.bfloat16:
            return KV_BF16
        if x.dtype == torch.float8_e4m3fn:
            return KV_E4M3
    else:
        a = np.asarray(x)
        if a.dtype in (np.uint16, np.int16):
            return KV_BF16
        if a.dtype in (np.uint8, np.int8):
            return KV_E4M3
    raise InvalidBundleError(
        f"{name}: dtype {x.dtype}, expected torch.bfloat16 or torch.float8_e4m3fn (numpy: uint16 "
        f"bf16 bits or uint8 e4m3 bits)")


def kv_bits(name, x):
    """A KV pool's data as a C-contiguous numpy array of bit patterns: uint16 for bf16, uint8
    for e4m3 (kv_dtype_of)."""
    if kv_dtype_of(name, x) == KV_BF16:
        return bf16_bits(name, x)
    if is_torch(x):
        import torch  # noqa: PLC0415 - present whenever x is a tensor

        return np.ascontiguousarray(x.detach().contiguous().view(torch.uint8).cpu().numpy())
    return np.ascontiguousarray(np.asarray(x).view(np.uint8))


def int32_array(name, x):
    """An integer array as C-contiguous int32, refusing values that do not fit."""
    a = x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)
    if a.dtype.kind not in "iu":
        raise InvalidBundleError(f"{name}: dtype {a.dtype}, expected an integer type")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise InvalidBundleError(f"{name}: values do not fit in int32")
    return np.ascontiguousarray(a, dtype=np.int32)


def uint8_array(name, x):
    """A 0/1 or bit-packed mask as C-contiguous uint8 (bool is taken as 0/1)."""
    a = x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    if a.dtype not in (np.uint8, np.int8):
        raise InvalidBundleError(f"{name}: dtype {a.dtype}, expected uint8 or bool")
    return np.ascontiguousarray(a.view(np.uint8))


def to_bf16(x):
    """float array -> bf16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
               >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(f), BF16_NAN, rounded).astype(np.uint16)


def from_bf16(bits):
    """bf16 bit patterns (uint16) -> float32."""
    b = np.ascontiguousarray(bits).view(np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _e4m3_table():
    """The float32 value of each of the 256 e4m3 bit patterns (NaN for S.1111.111)."""
    x = np.arange(256, dtype=np.uint32)
    e, m = (x >> 3) & 0xF, (x & 7).astype(np.float32)
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e.astype(np.float32) - 10))
    mag = np.where((x & 0x7F) == 0x7F, np.nan, mag).astype(np.float32)
    return np.where(x & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()
_E4M3_POSITIVE = E4M3_VALUES[:0x7F]  # 0 .. 448, increasing


def to_e4m3(x):
    """float array -> e4m3 bit patterns (uint8), nearest value with ties to even; magnitudes past
    448 saturate to 448 and NaN stays NaN (kernels/e4m3.h's FloatToE4m3)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    a = np.minimum(np.abs(f), np.float32(448))
    hi = np.clip(np.searchsorted(_E4M3_POSITIVE, a, side="left"), 0, 0x7E)
    lo = np.maximum(hi - 1, 0)
    d_hi, d_lo = _E4M3_POSITIVE[hi] - a, a - _E4M3_POSITIVE[lo]
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = np.where(pick_lo, lo, hi).astype(np.uint8)
    code = np.where(np.signbit(f), code | np.uint8(0x80), code)
    return np.where(np.isnan(f), np.uint8(0x7F), code).astype(np.uint8)


def from_e4m3(bits, scale=1.0):
    """e4m3 bit patterns (uint8) -> float32 values times ``scale`` (an fp8 pool's kv_scale)."""
    return E4M3_VALUES[np.ascontiguousarray(bits).view(np.uint8)] * np.float32(scale)


def pack_mask(mask):
    """A [B, T, T] 0/1 mask -> bit-packed uint8 [B, T, ceil(T/8)] (MASK_FORMAT_BITS).

    Bit j % 8 of byte j / 8 holds tree_mask[b, i, j]: numpy.packbits with bitorder="little".
    """
    a = mask.detach().cpu().numpy() if is_torch(mask) else np.asarray(mask)
    if a.ndim != 3 or a.shape[1] != a.shape[2]:
        raise InvalidBundleError(f"tree_mask: shape {list(a.shape)} is not [B, T, T]")
    if a.size and not np.isin(a, (0, 1)).all():
        raise InvalidBundleError("tree_mask: values must be 0 or 1")
    return np.packbits(a.astype(np.uint8), axis=2, bitorder="little")


def unpack_mask(bits, draft):
    """The inverse of pack_mask: uint8 [B, T, ceil(T/8)] -> uint8 [B, T, T]."""
    return np.unpackbits(np.asarray(bits, dtype=np.uint8), axis=2, count=draft,
                         bitorder="little")
