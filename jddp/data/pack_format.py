"""The packed data set format: ArrayRecord shards of checksummed records plus a JSON manifest.

A pack is a folder::

    pack.json                                  the manifest, written last
    train-00000-of-00004.array_record ...      ArrayRecord shards (one record per example)
    eval-00000-of-00001.array_record

Every record is a 44-byte little-endian header and the payload:

    magic  b"JDPR"       4 bytes
    crc32  uint32        CRC-32 (zlib) of every byte after this field
    pack   16 bytes      the pack id (a shard copied from another pack is detected)
    label  int32
    kind   uint8         0: the encoded image file (JPEG/PNG bytes), 1: a raw pixel array
    dtype  uint8         raw arrays: 0 uint8, 1 float32 (0 for encoded images)
    pad    2 bytes
    shape  3 x uint32    raw arrays: (H, W, C) (zeros for encoded images)
    payload

Example ``i`` of a split is record ``i - first`` of the shard whose ``first <= i`` (the
manifest lists each shard's record count): the source's order is kept.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from jddp.errors import DataError

__all__ = [
    "ENCODED",
    "MANIFEST",
    "RAW",
    "VERSION",
    "Record",
    "encode_record",
    "parse_record",
    "shard_name",
]

VERSION = 1
"""Version of the manifest and record layout this jddp writes and reads."""

MANIFEST = "pack.json"
"""The manifest's file name in the pack folder; a pack without it is incomplete."""

MAGIC = b"JDPR"
_HEADER = struct.Struct("<4sI16siBBxxIII")
HEADER_BYTES = _HEADER.size
ENCODED, RAW = 0, 1
_DTYPES = {0: np.dtype(np.uint8), 1: np.dtype(np.float32)}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
WRITER_OPTIONS = "group_size:1,uncompressed"  # one record per chunk: cheap random access
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"  # random access, no readahead


def shard_name(split: str, index: int, count: int) -> str:
    """File name of shard ``index`` of ``count`` of ``split``."""
    return f"{split}-{index:05d}-of-{count:05d}.array_record"


@dataclass(frozen=True)
class Record:
    """One parsed record: the label and either encoded image bytes or a pixel array."""

    label: int
    kind: int
    payload: bytes | np.ndarray


def encode_record(pack_id: bytes, label: int, payload: bytes | np.ndarray) -> bytes:
    """The record bytes of one example: ``payload`` is an encoded image file or an
    ``[H, W, C]`` uint8/float32 array."""
    if isinstance(payload, np.ndarray):
        array = np.ascontiguousarray(payload)
        if array.ndim != 3 or array.dtype not in _DTYPE_CODES:
            raise ValueError(
                f"pack record: need a uint8/float32 [H,W,C] array, got {array.dtype} {array.shape}"
            )
        kind, dtype, shape, body = RAW, _DTYPE_CODES[array.dtype], array.shape, array.tobytes()
    else:
        kind, dtype, shape, body = ENCODED, 0, (0, 0, 0), bytes(payload)
    header = _HEADER.pack(MAGIC, 0, pack_id, int(label), kind, dtype, *shape)
    crc = zlib.crc32(body, zlib.crc32(header[8:]))
    return header[:4] + struct.pack("<I", crc) + header[8:] + body


def parse_record(data: bytes, pack_id: bytes, where: str) -> Record:
    """Check and split one record; :class:`DataError` naming ``where`` (the shard and record)
    if it is damaged or belongs to another pack."""
    if len(data) < HEADER_BYTES:
        raise DataError(f"{where}: {len(data)} bytes, shorter than a record header: damaged shard")
    magic, crc, record_pack, label, kind, dtype, h, w, c = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DataError(f"{where}: not a jddp pack record (magic {magic!r}): damaged shard")
    if zlib.crc32(memoryview(data)[8:]) != crc:
        raise DataError(f"{where}: CRC-32 mismatch, the record is corrupt: re-pack the data set")
    if record_pack != pack_id:
        raise DataError(
            f"{where}: belongs to pack {record_pack.hex()}, not to this pack {pack_id.hex()}: "
            "a shard from another pack"
        )
    body = memoryview(data)[HEADER_BYTES:]
    if kind == ENCODED:
        return Record(label, kind, bytes(body))
    if kind != RAW or dtype not in _DTYPES:
        raise DataError(f"{where}: unknown record kind {kind}/dtype {dtype}: damaged shard")
    array = np.frombuffer(body, _DTYPES[dtype])
    if array.size != h * w * c:
        raise DataError(f"{where}: payload holds {array.size} values, header says {h}x{w}x{c}")
    return Record(label, kind, array.reshape(h, w, c))
