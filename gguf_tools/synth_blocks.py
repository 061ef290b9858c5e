"""Random but valid quantized blocks (Q8_0, Q4_0, MXFP4, Q4_K, Q5_K, Q6_K) for synthetic models.

Writing quants directly is 5-20x faster than generating float32 weights and quantizing them with
gguf-py (which cannot quantize K-quants at all), and full-size synthetic models are mostly expert
bytes. Each block gets a fixed scale and random quants, with the scale chosen so the
dequantized weights have mean ~0 and standard deviation ~``std``. Layouts follow ggml-common.h;
``gguf.quants.dequantize`` reads them back.
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

BLOCK_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# types gguf-py cannot quantize from floats: an embedding table of one is written as blocks too
# (``unit_col0``, Q4_K only: llama-quantize puts token_embd in Q4_K in Q4_K_M files)
UNIT_COL0_TYPES = frozenset({Q.Q4_K})

# std of the integer quant grid per unit of scale, for uniformly random quants
_Q8_0_STD = math.sqrt((255 ** 2 - 1) / 12)          # q in -127..127
_Q4_0_STD = math.sqrt((16 ** 2 - 1) / 12 + 0.25)     # q - 8 in -8..7 (RMS, mean -0.5)
_MXFP4_STD = math.sqrt(2 * (0 + 1 + 4 + 9 + 16 + 36 + 64 + 144) / 16)   # doubled e2m1 values
# Q4_K: w = d * sc * q - dmin * m, q in 0..15. With sc = 8, m = 60 and dmin = d the weights are
# d * (8q - 60): zero mean. The 12 packed scale bytes encode sc = 8, m = 60 for all 8 sub-blocks.
_Q4K_SCALES = np.array([8, 8, 8, 8, 252, 252, 252, 252, 200, 200, 200, 200], np.uint8)
_Q4K_STD = 8 * math.sqrt((16 ** 2 - 1) / 12)
# Q5_K: as Q4_K with q in 0..31; sc = 4, m = 62, dmin = d: w = d * (4q - 62), zero mean.
_Q5K_SCALES = np.array([4, 4, 4, 4, 254, 254, 254, 254, 228, 228, 228, 228], np.uint8)
_Q5K_STD = 4 * math.sqrt((32 ** 2 - 1) / 12)
# Q6_K: w = d * scale * (q - 32), q in 0..63; scales alternate +16/-16 so the -0.5 mean of
# (q - 32) cancels over a super-block.
_Q6K_SCALES = np.array([16, -16] * 8, np.int8).view(np.uint8)
_Q6K_STD = 16 * math.sqrt((64 ** 2 - 1) / 12)


def _f16_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.float16(value).tobytes(), np.uint8)


def random_blocks(rng: np.random.Generator, qtype: Q, rows: int, row_len: int, *,
                  std: float, zero_row0: bool = False, unit_col0: bool = False) -> np.ndarray:
    """``rows`` rows of ``row_len`` random weights as ``qtype`` blocks: uint8 (rows, row_bytes).

    ``zero_row0`` makes every weight of row 0 exactly zero. ``unit_col0`` (Q4_K, std 1 only:
    embedding tables) makes the first weight of every row the same value, 0.99976 (f16(1/36)
    * 36), the constant bias channel the layouts rely on.
    """
    if unit_col0 and (qtype not in UNIT_COL0_TYPES or std != 1.0):
        raise ValueError(f"unit_col0 needs Q4_K and std 1, got {qtype.name} and std {std}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if row_len % block:
        raise ValueError(f"{qtype.name} rows must be a multiple of {block}, got {row_len}")
    per_row = row_len // block
    n = rows * per_row
    out = np.empty((n, type_size), np.uint8)
    if qtype == Q.Q8_0:
        out[:, 0:2] = _f16_bytes(std / _Q8_0_STD)
        out[:, 2:34] = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    elif qtype == Q.Q4_0:
        out[0::2, 0:2] = _f16_bytes(std / _Q4_0_STD)
        out[1::2, 0:2] = _f16_bytes(-std / _Q4_0_STD)   # alternate signs: the -0.5 mean cancels
        out[:, 2:18] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    elif qtype == Q.MXFP4:
        # e8m0 scale: d = 2 ** (e - 128) for e >= 2 (gguf's e8m0_to_fp32_half)
        e = int(np.clip(round(math.log2(std / _MXFP4_STD)) + 128, 2, 254))
        out[:, 0] = e
        out[:, 1:17] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    elif qtype == Q.Q4_K:
        # unit_col0: d = 1/36 keeps std ~1.02, and q = 12 gives d * (8 * 12 - 60) = 36 d ~ 1
        out[:, 0:2] = _f16_bytes(1 / 36 if unit_col0 else std / _Q4K_STD)   # d
        out[:, 2:4] = out[:, 0:2]                 # dmin
        out[:, 4:16] = _Q4K_SCALES
        out[:, 16:144] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
        if unit_col0:   # weight 0 of a super-block is the low nibble of its first qs byte
            out[::per_row, 16] = (out[::per_row, 16] & 0xF0) | 12
    elif qtype == Q.Q5_K:
        out[:, 0:2] = _f16_bytes(std / _Q5K_STD)   # d
        out[:, 2:4] = out[:, 0:2]                 # dmin
        out[:, 4:16] = _Q5K_SCALES
        out[:, 16:176] = rng.integers(0, 256, (n, 160), dtype=np.uint8)   # qh, qs
    elif qtype == Q.Q6_K:
        out[:, 0:192] = rng.integers(0, 256, (n, 192), dtype=np.uint8)   # ql, qh
        out[:, 192:208] = _Q6K_SCALES
        out[:, 208:210] = _f16_bytes(std / _Q6K_STD)
    else:
        raise ValueError(f"no random-block writer for {qtype.name}")
    if zero_row0:
        out[:per_row] = 0     # all-zero blocks dequantize to exactly 0 in every type here
    return out.reshape(rows, per_row * type_size)
