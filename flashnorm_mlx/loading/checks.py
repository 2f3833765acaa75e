"""Structure checks on model files before MLX reads them.

MLX's GGUF reader (gguflib) trusts every length, count and offset in the file:
`b"GGUF"` plus junk kills the process with a segmentation fault. So a GGUF is
walked here first (header, every metadata value, every tensor's name, type,
shape and data range), and so are safetensors headers and config values; a
problem is one `LoadError` line naming the file. Only structure is checked:
what the bytes mean is the loaders' business.
"""

import dataclasses
import json
import math
import mmap
import struct
from pathlib import Path
from typing import Dict, List, Tuple

from ..errors import LoadError
from ..limits import is_int

# --- GGUF --------------------------------------------------------------------

# Metadata value types: id -> (name, struct format of one item; None: variable).
GGUF_VALUE = {
    0: ("uint8", "<B"),
    1: ("int8", "<b"),
    2: ("uint16", "<H"),
    3: ("int16", "<h"),
    4: ("uint32", "<I"),
    5: ("int32", "<i"),
    6: ("float32", "<f"),
    7: ("bool", "<B"),
    8: ("string", None),
    9: ("array", None),
    10: ("uint64", "<Q"),
    11: ("int64", "<q"),
    12: ("float64", "<d"),
}
# GGML tensor types we read (MLX, or loading/gguf_kquant.py for the K-quants and
# Q5_0/Q5_1; others crash gguflib, e.g. 4 and 5 divide by zero, or it refuses
# them): id -> (name, items per block, bytes per block).
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    30: ("BF16", 1, 2),
}
_OTHER_GGML = {9: "Q8_1", 15: "Q8_K"}
MAX_DIMS = 4  # GGML_MAX_DIMS; gguflib's dimension array holds no more
MAX_DIM = 2**31 - 1  # MLX shapes are int32


class _Bad(Exception):
    """A structural problem; turned into one LoadError line naming the file."""


class Reader:
    """Bounds-checked little-endian reads from a byte buffer."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise _Bad(f"{what} runs past the end of the file (truncated?)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"{what} length")
        if n > self.size - self.pos:
            raise _Bad(f"{what} length {n} runs past the end of the file")
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} is not UTF-8") from None


@dataclasses.dataclass
class GGUFTensor:
    name: str
    type_name: str
    shape: Tuple[int, ...]  # GGML order: innermost dimension first
    offset: int  # from the start of the file
    nbytes: int


def check_gguf(path) -> List[GGUFTensor]:
    """Walk a GGUF file's header, metadata and tensor table; raise LoadError
    (one line naming the file) on anything MLX's reader would trip over."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise _Bad("the file is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk_gguf(Reader(buf, size))
    except _Bad as e:
        raise LoadError(f"{path}: not a valid GGUF file: {e}") from None
    except OSError as e:
        raise LoadError(f"{path}: cannot read: {e.strerror or e}") from None


def _walk_gguf(r: Reader) -> List[GGUFTensor]:
    if bytes(r.take(4, "magic")) != b"GGUF":
        raise _Bad("it does not start with the GGUF magic")
    version = r.unpack("<I", "version")
    if version not in (2, 3):
        raise _Bad(f"GGUF version {version} (readable: 2 and 3)")
    n_tensors = r.unpack("<Q", "tensor count")
    n_kv = r.unpack("<Q", "metadata count")
    left = r.size - r.pos
    # Each entry takes at least 13 (metadata) / 24 (tensor info) bytes.
    if n_kv > left // 13 or n_tensors > left // 24:
        raise _Bad(f"counts ({n_kv} metadata, {n_tensors} tensors) exceed the file")
    alignment = 32
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}")
        vtype = r.unpack("<I", f"type of {key!r}")
        value = _gguf_value(r, vtype, key)
        if key == "general.alignment":
            if vtype != 4 or value <= 0 or value & (value - 1):
                raise _Bad("general.alignment must be a power-of-two uint32")
            alignment = value
    tensors, names = [], set()
    for i in range(n_tensors):
        name = r.string(f"tensor name #{i}")
        if name in names:
            raise _Bad(f"tensor {name!r} appears twice")
        names.add(name)
        ndim = r.unpack("<I", f"{name}: dimension count")
        if not 1 <= ndim <= MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {ndim} dimensions (1 to {MAX_DIMS})")
        shape = tuple(r.unpack("<Q", f"{name}: shape") for _ in range(ndim))
        if any(not 1 <= d <= MAX_DIM for d in shape):
            raise _Bad(f"tensor {name!r} has shape {list(shape)}")
        ttype = r.unpack("<I", f"{name}: type")
        if ttype not in GGML_TYPES:
            what = _OTHER_GGML.get(ttype, f"unknown type {ttype}")
            raise _Bad(f"tensor {name!r} is {what}, which MLX cannot read")
        offset = r.unpack("<Q", f"{name}: offset")
        tname, per_block, block_bytes = GGML_TYPES[ttype]
        if shape[0] % per_block:
            raise _Bad(
                f"tensor {name!r}: {tname} rows of {shape[0]} are not whole blocks"
            )
        if offset % alignment:
            raise _Bad(f"tensor {name!r}: offset {offset} is not {alignment}-aligned")
        nbytes = math.prod(shape) // per_block * block_bytes
        tensors.append(GGUFTensor(name, tname, shape, offset, nbytes))
    data_start = r.pos + (-r.pos) % alignment
    for t in tensors:
        t.offset += data_start
        if t.offset + t.nbytes > r.size:
            raise _Bad(
                f"tensor {t.name!r} ({t.type_name} {list(t.shape)}) runs past the "
                "end of the file (truncated?)"
            )
    return tensors


def _gguf_value(r: Reader, vtype: int, key: str, in_array: bool = False):
    if vtype not in GGUF_VALUE:
        raise _Bad(f"metadata {key!r} has unknown value type {vtype}")
    name, fmt = GGUF_VALUE[vtype]
    if name == "string":
        return r.string(f"metadata {key!r}")
    if name == "array":
        if in_array:
            raise _Bad(f"metadata {key!r} nests arrays, which MLX cannot read")
        itype = r.unpack("<I", f"metadata {key!r} item type")
        count = r.unpack("<Q", f"metadata {key!r} length")
        if count >= 2**31 or count > r.size - r.pos:  # MLX takes the count as int
            raise _Bad(f"metadata {key!r} claims {count} items")
        if itype in GGUF_VALUE and GGUF_VALUE[itype][1] is not None:
            # Fixed-size items: one bounds check, no per-item loop.
            isize = struct.calcsize(GGUF_VALUE[itype][1])
            r.take(count * isize, f"metadata {key!r}")
            return None
        for _ in range(count):
            _gguf_value(r, itype, key, in_array=True)
        return None
    value = r.unpack(fmt, f"metadata {key!r}")
    if name == "bool" and value not in (0, 1):
        raise _Bad(f"metadata {key!r} is a bool of value {value}")
    return value


# --- safetensors -------------------------------------------------------------

# safetensors dtype -> bytes per item, for the dtypes mx.load reads.
SAFETENSORS_DTYPES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
}
MAX_HEADER = 100 << 20  # the safetensors library's own limit


def check_safetensors(path) -> Dict[str, dict]:
    """Check a safetensors header: its length, JSON, and every tensor's dtype,
    shape and byte range inside the file. Returns the header's tensor entries."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            return _walk_safetensors(f, size)
    except _Bad as e:
        raise LoadError(f"{path}: not a valid safetensors file: {e}") from None
    except OSError as e:
        raise LoadError(f"{path}: cannot read: {e.strerror or e}") from None


def _walk_safetensors(f, size: int) -> Dict[str, dict]:
    if size < 8:
        raise _Bad(f"{size} bytes, shorter than the 8-byte header length")
    n = struct.unpack("<Q", f.read(8))[0]
    if n > min(size - 8, MAX_HEADER):
        raise _Bad(f"header length {n} exceeds the file ({size} bytes)")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _Bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise _Bad("the header is not a JSON object")
    data = size - 8 - n
    meta = header.pop("__metadata__", None) or {}  # MLX writes null for none
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _Bad("__metadata__ is not a map of strings")
    for name, t in header.items():
        if not isinstance(t, dict):
            raise _Bad(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise _Bad(f"tensor {name!r}: dtype {dtype!r} is not readable")
        if not isinstance(shape, list) or not all(
            is_int(d) and 0 <= d <= MAX_DIM for d in shape
        ):
            raise _Bad(f"tensor {name!r}: bad shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise _Bad(f"tensor {name!r}: data offsets {offsets!r} outside the file")
        if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPES[dtype]:
            raise _Bad(
                f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for a "
                f"{dtype} tensor of shape {shape}"
            )
    return header
