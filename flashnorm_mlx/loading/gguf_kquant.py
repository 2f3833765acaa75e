"""GGUF tensors MLX's own reader gets wrong: K-quants (and Q5_0/Q5_1), read
from the file's bytes (docs/design.md section 2i).

`mx.load` turns Q2_K/Q4_K/Q6_K into float16 without a word and fails on
Q3_K/Q5_K/Q5_0/Q5_1. A file holding any of them is read here instead, metadata
and tensors in the form `mx.load` gives (numbers as 0-d arrays, block quants as
MLX affine group-32 triples `.weight/.scales/.biases`):
- Q4_K/Q5_K: w = (d*sc)*q - dmin*m per 32 weights, MLX's affine format at 4/5
  bits (scale d*sc, bias -dmin*m, in float32, which holds them exactly):
  repacked, not dequantized;
- Q4_0/Q4_1/Q5_0/Q5_1/Q8_0: 32-weight blocks, affine triples as `mx.load` makes;
- Q6_K/Q3_K/Q2_K (16-weight scales, which MLX's smallest group of 32 cannot
  hold): dequantized to float32 (exact), and listed so the user is told
  (`float_note`).
The K-quants' float32 is cast once to the compute dtype when the model is
built (float32 on the CPU: llama.cpp's dequantized values exactly; float16
where the model computes in float16, as the file's own scales); the config's
`kquant.FILE_DTYPE_KEY` keeps the file's float16 as its dtype.
"""

import math
import mmap
import struct
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..quant.kquant import (  # noqa: F401
    CONFIG_KEY,
    FILE_DTYPE_KEY,
    NEAREST_BITS,
    floats_of,
)
from .checks import GGUF_VALUE, GGUFTensor, Reader

QK_K = 256  # weights per K-quant super-block
# What MLX's reader handles itself; a file holding other types is read here.
MLX_READS = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "I8", "I16", "I32"}
# Types MLX's format cannot hold (scales per 16 weights) -> the nearest MLX
# bits at group 32 (what --requantize rounds them to).
FLOAT_TYPES = NEAREST_BITS
# Stored bits per weight (block bytes * 8 / weights per block).
BITS_PER_WEIGHT = {"Q6_K": 210 * 8 / 256, "Q3_K": 110 * 8 / 256, "Q2_K": 84 * 8 / 256}
CHUNK = 1 << 20  # weights decoded at a time
K_TYPES = {"Q4_K", "Q5_K", *FLOAT_TYPES}  # decoded in float32 (exact)


def needs_own_reader(table: List[GGUFTensor]) -> bool:
    return any(t.type_name not in MLX_READS for t in table)


def read_file(path: Path, table: List[GGUFTensor]) -> Tuple[dict, dict, dict]:
    """(tensors as `mx.load` names them, metadata as it gives them, GGUF name
    -> type of each tensor read as float32 from a type MLX cannot hold)."""
    with open(path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            meta = _metadata(Reader(m, len(m)))
        tensors, floats = {}, {}
        for t in table:  # one tensor's bytes in memory at a time
            shape = tuple(reversed(t.shape))  # GGML lists the innermost first
            f.seek(t.offset)
            raw = np.frombuffer(f.read(t.nbytes), np.uint8)
            tensors.update(_decode(t.name, t.type_name, raw, shape))
            if t.type_name in FLOAT_TYPES:
                floats[t.name] = t.type_name
    return tensors, meta, floats


def _metadata(r: Reader) -> dict:
    """Header metadata, in `mx.load`'s form: 0-d arrays for numbers, 1-D arrays
    for numeric lists, str and lists of str as they are."""
    r.take(8, "magic and version")
    r.unpack("<Q", "tensor count")
    n_kv = r.unpack("<Q", "metadata count")
    meta = {}
    for _ in range(n_kv):
        key = r.string("key")
        meta[key] = _value(r, r.unpack("<I", key), key)
    return meta


def _value(r: Reader, vtype: int, key: str):
    name, fmt = GGUF_VALUE[vtype]
    if name == "string":
        return r.string(key)
    if name == "array":
        itype, count = r.unpack("<I", key), r.unpack("<Q", key)
        iname, ifmt = GGUF_VALUE[itype]
        if iname == "string":
            return [r.string(key) for _ in range(count)]
        size = struct.calcsize(ifmt)
        items = np.frombuffer(r.take(count * size, key), ifmt)
        return mx.array(items.astype(_NP.get(iname, items.dtype)), dtype=_mx(iname))
    return mx.array(r.unpack(fmt, key), dtype=_mx(name))


_NP = {"bool": np.bool_, "float64": np.float32}  # MLX's own choices


def _mx(name: str) -> mx.Dtype:
    return {"bool": mx.bool_, "float64": mx.float32}.get(name) or getattr(mx, name)


# --- decoding ----------------------------------------------------------------


def _decode(name: str, kind: str, raw: np.ndarray, shape: tuple) -> dict:
    """One tensor's entries: `name` (float) or its `.weight/.scales/.biases`."""
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    plain = {"F32": np.float32, "F16": np.float16, "I8": np.int8}
    plain.update({"I16": np.int16, "I32": np.int32})
    if kind in plain:
        return {name: mx.array(raw.view(plain[kind]).reshape(shape))}
    if kind == "BF16":
        return {name: mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)}
    rows, cols = math.prod(shape[:-1]), shape[-1]
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES[kind])
    step = max(1, CHUNK // cols)  # rows a chunk: bounded scratch memory
    out = None  # the tensor's arrays, filled chunk by chunk
    for i in range(0, rows, step):
        b = blocks[i : i + step].reshape(-1, _BLOCK_BYTES[kind])
        # K-quants' products (d*sc, dmin*m, d*sc*q) need float32 to be exact;
        # the other types' scales are the file's own float16.
        exact = np.float32 if kind in K_TYPES else np.float16
        if kind in FLOAT_TYPES:
            parts = [DEQUANTIZE[kind](b).astype(exact).reshape(-1, cols)]
        else:
            q, scales, biases, bits = AFFINE[kind](b)
            parts = [pack(q.reshape(-1, cols), bits)]
            parts += [x.astype(exact).reshape(-1, cols // 32) for x in (scales, biases)]
        if out is None:
            out = [np.empty((rows, p.shape[1]), p.dtype) for p in parts]
        for o, p in zip(out, parts):
            o[i : i + step] = p
    out = [mx.array(o).reshape(*shape[:-1], -1) for o in out]
    if kind in FLOAT_TYPES:
        return {name: out[0]}
    return dict(zip((f"{stem}.{s}" for s in ("weight", "scales", "biases")), out))


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, n) values < 2**bits -> MLX's packing: one little-endian bit stream
    per row (value i at bits [i*bits, (i+1)*bits)), as uint32 words."""
    rows, n = q.shape
    v = q.reshape(rows, n // 8, 8).astype(np.uint64) << (
        np.arange(8, dtype=np.uint64) * np.uint64(bits)
    )
    words = np.bitwise_or.reduce(v, axis=-1)  # 8 values in `bits` bytes
    return words[..., None].view(np.uint8)[..., :bits].reshape(rows, -1).view(np.uint32)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes (n, 2) -> float32 (n, 1)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def k_scale_min(s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins: sub-blocks
    0-3 in the low 6 bits of bytes 0-3 / 4-7; 4-7 in bytes 8-11's nibbles (low:
    scale, high: min) with their top 2 bits in bytes 0-3 / 4-7's top bits."""
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)], axis=1)
    m = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc, m


def _k_affine(b: np.ndarray, high_bit: bool):
    """Q4_K (144 bytes: d, dmin, scales[12], qs[128]) or Q5_K (176: ... qh[32]
    before qs): (q (n, 256), scale d*sc and bias -dmin*m per 32 weights, bits)."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    qs = b[:, 48:] if high_bit else b[:, 16:]
    # 32 bytes hold sub-blocks 2c (low nibbles) and 2c+1 (high nibbles).
    qs = qs.reshape(-1, 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(-1, 256)
    if high_bit:  # bit j of qh[l]: the fifth bit of weight l of sub-block j
        qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q = q | ((qh & 1) << 4).reshape(-1, 256)
    return q, d * sc, -(dmin * m), 5 if high_bit else 4


def _q4_0(b):
    d = _f16(b[:, 0:2])
    q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1)  # j, then j + 16
    return q, d, -8 * d, 4


def _q4_1(b):
    q = np.concatenate([b[:, 4:] & 15, b[:, 4:] >> 4], axis=1)
    return q, _f16(b[:, 0:2]), _f16(b[:, 2:4]), 4


def _q5(b, with_min: bool):
    """Q5_0 (d, qh[4], qs[16]: w = d*(q - 16)) or Q5_1 (d, m, qh, qs: d*q + m)."""
    d, at = _f16(b[:, 0:2]), 4 if with_min else 2
    qh = b[:, at : at + 4].copy().view("<u4")  # bit j: fifth bit of weight j
    qs = b[:, at + 4 :]
    q = np.concatenate([qs & 15, qs >> 4], axis=1)
    q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    return q, d, _f16(b[:, 2:4]) if with_min else -16 * d, 5


def _q8_0(b):
    d = _f16(b[:, 0:2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d, 8


AFFINE = {
    "Q4_K": lambda b: _k_affine(b, False),
    "Q5_K": lambda b: _k_affine(b, True),
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": lambda b: _q5(b, False),
    "Q5_1": lambda b: _q5(b, True),
    "Q8_0": _q8_0,
}


def _q6_k(b):
    """ql[128], qh[64], scales[16] (int8), d: w = d*scale*(q - 32), 16 weights
    a scale; each 128 weights take 64 ql bytes (low nibbles, then high) and 32
    qh bytes (2 bits each for the four 32-weight quarters)."""
    d = _f16(b[:, 208:210])
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (ql & 15).reshape(-1, 2, 4, 32)
    qh = (
        b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    )
    q = (ql | ((qh & 3) << 4)).reshape(-1, 16, 16).astype(np.float32) - 32
    return ((d * scales)[:, :, None] * q).reshape(-1, QK_K)


def _q3_k(b):
    """hmask[32], qs[64], scales[12] (16 six-bit, minus 32), d."""
    d = _f16(b[:, 108:110])
    s = b[:, 96:108]
    lo = (s[:, :8, None] >> np.array([0, 4], np.uint8)).transpose(0, 2, 1)
    hi = (s[:, 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).transpose(0, 2, 1)
    sc = (lo.reshape(-1, 16) & 15) | ((hi.reshape(-1, 16) & 3) << 4)
    sc = sc.astype(np.float32) - 32
    ql = b[:, 32:96].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = b[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    ql = (ql & 3).reshape(-1, 16, 16).astype(np.float32)
    q = ql - 4 * (1 - (qh & 1)).reshape(-1, 16, 16)  # a clear high bit subtracts 4
    return ((d * sc)[:, :, None] * q).reshape(-1, QK_K)


def _q2_k(b):
    """scales[16] (scale | min << 4), qs[64], d, dmin: w = d*sc*q - dmin*m."""
    s, d, dmin = b[:, :16], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = b[:, 16:80].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (q & 3).reshape(-1, 16, 16).astype(np.float32)
    scale, low = d * (s & 15), dmin * (s >> 4)
    return (scale[:, :, None] * q - low[:, :, None]).reshape(-1, QK_K)


DEQUANTIZE = {"Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k}
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q2_K": 84}
_BLOCK_BYTES.update({"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34})


# --- what the user is told ---------------------------------------------------


def float_note(floats: dict, weights: dict, dtype: mx.Dtype, requantize=False) -> str:
    """One line: which tensors a type MLX cannot hold left in float, at what
    cost over their bytes in the file, and what --requantize does instead.
    floats: module -> GGML type (config[CONFIG_KEY])."""
    types = sorted(set(floats.values()))
    n = sum(
        math.prod(weights[f"{m}.weight"].shape)
        for m in floats
        if f"{m}.weight" in weights
    )
    in_file = sum(BITS_PER_WEIGHT[t] for t in floats.values()) / max(len(floats), 1)
    what = f"{len(floats)} {'/'.join(types)} tensors ({_names(floats)})"
    if requantize:
        nearest = ", ".join(f"{t} to {FLOAT_TYPES[t]}-bit" for t in types)
        return (
            f"{what}, which MLX's format cannot hold (16-weight scales), are "
            f"rounded again to group 32 ({nearest}, --requantize): close to the "
            "file's results, not identical"
        )
    name = str(dtype).replace("mlx.core.", "")
    times = 8 * dtype.size / in_file
    return (
        f"{what} run in {name}: MLX's format cannot hold their 16-weight scales; "
        f"{n * dtype.size / 1e6:.1f} MB, {times:.1f}x their bytes in the file "
        "(--requantize rounds them to the nearest MLX setting instead)"
    )


def build_note(source, plan, mode, way: str, quantize) -> Optional[str]:
    """build_model's line for a GGUF with tensors read as float (None if none,
    or where -q / --dequantize already say every weight is taken otherwise);
    `mode`: the modes.Mode built."""
    floats = floats_of(source.config)
    if not floats or quantize or (way == "dequantize" and plan.note):
        return None
    # FlashNorm's stacks that hold them beside quantized tensors: stacks.note.
    return float_note(floats, source.weights, plan.dtype, way == "requantize")


def written_words(floats: dict, dtype: str) -> str:
    """convert's words for K-quant tensors it wrote in float (dtype: 'float16')."""
    types = "/".join(sorted(set(floats.values())))
    size = getattr(mx, dtype).size
    in_file = sum(BITS_PER_WEIGHT[t] for t in floats.values()) / len(floats)
    return (
        f"{len(floats)} {types} tensors in {dtype} (MLX's format cannot hold "
        f"them: {8 * size / in_file:.1f}x their bytes in the GGUF; --requantize "
        "rounds them to the nearest MLX setting)"
    )


def _names(floats: dict) -> str:
    """'output, attn_v, ffn_down': the kinds of module, in the order first met."""
    kinds = dict.fromkeys(m.rsplit(".", 1)[-1] for m in floats)
    return ", ".join(list(kinds)[:4]) + (", ..." if len(kinds) > 4 else "")
