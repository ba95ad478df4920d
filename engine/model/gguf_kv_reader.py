"""A fast reader for the key/value metadata at the head of a GGUF file.

`gguf.GGUFReader` builds a numpy view for every part of every field, which for a 49k-token
vocabulary plus its merges takes 2-5 s on a small CPU. The tokenizer needs only the metadata, so
this reads the key/value section directly with `struct` (about 0.2 s) and stops before the
tensor directory. Layout (GGUF v2/v3, little-endian):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key, type u32, value)

A string is a u64 byte length followed by UTF-8 bytes; an array is an element type u32, a u64
count and the elements.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np


class GGUFMetadataError(ValueError):
    """The file is not a GGUF file, or its metadata section is truncated or malformed."""


# GGUF value type -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING = 8
_ARRAY = 9
_MAX_STRING_BYTES = 1 << 26  # a sane cap, so a corrupt length fails fast instead of allocating


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """All metadata of a GGUF file as Python values (arrays as lists)."""
    try:
        with open(path, "rb") as f:
            return _read(f, path)
    except OSError as exc:
        raise GGUFMetadataError(f"cannot read {path}: {exc}") from exc
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, GGUFMetadataError):
            raise
        raise GGUFMetadataError(f"{path}: the GGUF metadata is truncated or corrupt ({exc}); download the file again") from exc


def _read(f: BinaryIO, path: Path) -> dict[str, Any]:
    magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFMetadataError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    version, _tensor_count, kv_count = struct.unpack("<IQQ", _exact(f, 20))
    if version < 2:
        raise GGUFMetadataError(f"{path}: GGUF version {version} is too old; convert it again with a current llama.cpp")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = _read_string(f)
        (value_type,) = struct.unpack("<I", _exact(f, 4))
        metadata[key] = _read_value(f, value_type)
    return metadata


def _exact(f: BinaryIO, size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise GGUFMetadataError("the file ends inside its metadata (truncated download?)")
    return data


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", _exact(f, 8))
    if length > _MAX_STRING_BYTES:
        raise GGUFMetadataError(f"a metadata string claims {length} bytes; the file is corrupt")
    return _exact(f, length).decode("utf-8")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type][0]
        return struct.unpack(fmt, _exact(f, struct.calcsize(fmt)))[0]
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        element_type, count = struct.unpack("<IQ", _exact(f, 12))
        if element_type in _SCALARS:
            dtype = np.dtype(_SCALARS[element_type][1])
            return np.frombuffer(_exact(f, dtype.itemsize * count), dtype=dtype).tolist()
        if element_type == _STRING:
            return [_read_string(f) for _ in range(count)]
        return [_read_value(f, element_type) for _ in range(count)]
    raise GGUFMetadataError(f"unknown GGUF value type {value_type}; the file is corrupt or from a newer GGUF version")
