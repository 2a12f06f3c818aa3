"""A tar file's member table read straight from its headers: each regular file's name, data
offset and size (what random access into a WebDataset shard needs), ustar, GNU long names and
pax headers followed, checksums checked, a file cut short named with the member it cuts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jddp.errors import DataError

_BLOCK = 512


# ------------------------------------------------------------------------ the tar headers
def _octal(field: bytes, shard: Path, at: int) -> int:
    """A tar header's numeric field (octal text, or GNU base-256 for large values)."""
    if field and field[0] & 0x80:  # base-256: the rest of the bytes, big-endian
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise DataError(
            f"webdataset: shard {str(shard)!r} is not a tar file (a bad header at byte {at}): "
            "truncated or damaged"
        ) from None


def _checksum_ok(header: bytes) -> bool:
    """Whether a tar header's checksum field matches its bytes (the field summed as spaces;
    old tars summed signed bytes)."""
    try:
        stored = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return False
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    signed = unsigned - 256 * sum(1 for b in (*header[:148], *header[156:]) if b > 127)
    return stored in (unsigned, signed)


def _pax_records(data: bytes) -> dict[str, str]:
    """The ``key=value`` records of a pax extended header (``"%d %s=%s\\n"`` each)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos += length
    return out


def tar_members(shard: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Every regular file of the tar ``shard``: names, data offsets and sizes (bytes), in
    archive order. GNU long names and pax headers are followed; a header or member cut off by
    the end of the file is a :class:`DataError` naming the shard and the member."""
    names: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    file_size = shard.stat().st_size
    long_name: str | None = None
    pax: dict[str, str] = {}
    with open(shard, "rb", buffering=0) as f:
        pos = 0
        while pos + _BLOCK <= file_size:
            f.seek(pos)
            header = f.read(_BLOCK)
            if header == b"\0" * _BLOCK:  # end of archive (two zero blocks; one suffices)
                break
            if not _checksum_ok(header):
                if pos == 0 and header[:2] == b"\x1f\x8b":  # gzip's magic bytes
                    raise DataError(
                        f"webdataset: shard {str(shard)!r} is gzip-compressed (.tar.gz): jddp "
                        "reads examples by their offsets in an uncompressed tar; decompress the "
                        "shards (gunzip), or write them without tar's -z"
                    )
                raise DataError(
                    f"webdataset: shard {str(shard)!r} is not a tar file (no header at byte {pos})"
                )
            size = _octal(header[124:136], shard, pos)
            kind = header[156:157]
            data_at = pos + _BLOCK
            name = header[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
            prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
            if prefix and header[257:262] == b"ustar":
                name = f"{prefix}/{name}"
            if data_at + size > file_size:
                raise DataError(
                    f"webdataset: shard {str(shard)!r} is truncated: member "
                    f"{long_name or pax.get('path') or name!r} needs bytes {data_at}.."
                    f"{data_at + size} but the file ends at {file_size}"
                )
            if kind in (b"L", b"x", b"g"):
                f.seek(data_at)
                extra = f.read(size)
                if kind == b"L":
                    long_name = extra.split(b"\0", 1)[0].decode("utf-8", "replace")
                elif kind == b"x":
                    pax = _pax_records(extra)
            elif kind in (b"0", b"\0", b"7"):
                names.append(long_name or pax.get("path") or name)
                offsets.append(data_at)
                sizes.append(int(pax.get("size", size)))
                long_name, pax = None, {}
            else:  # directories, links: nothing to read
                long_name, pax = None, {}
            pos = data_at + (size + _BLOCK - 1) // _BLOCK * _BLOCK
    if file_size % _BLOCK:  # a tar is whole 512-byte blocks: its end was cut off
        raise DataError(
            f"webdataset: shard {str(shard)!r} is truncated: {file_size} bytes is not a whole "
            f"number of {_BLOCK}-byte tar blocks"
        )
    return names, np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
