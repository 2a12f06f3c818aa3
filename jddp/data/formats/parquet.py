"""``parquet``: Parquet shards (the Hugging Face Hub's layout, or any table), read by index.

The Hub writes a data set as ``data/train-00000-of-00004.parquet``, ``validation-*``,
``test-*`` (or ``<config>/train/0000.parquet``): the split comes from those names, or the eval
shards are ``data.eval_path``. Image classification reads an ``image`` column (the Hub's struct
of encoded ``bytes`` and ``path``, or plain binary; ``data.image_key`` names another) and an
integer ``label`` column (``data.label_key``); the Hub's ``ClassLabel`` names, kept in the
file's metadata, become the class names. Images go through the image folder's decoder and
augmentation, so the same files give the same pixels.

Random access: example ``i`` is a row of a row group; reading it decodes that row group's image
column (Parquet cannot read one value alone), kept in a per-process cache of
``ROW_GROUP_CACHE_BYTES`` so its other rows cost nothing. A data set whose image bytes exceed
the cache rereads a row group for most examples (the Hub's image shards hold 100 rows per
group): train it as a pack (``python -m jddp.pack DIR OUT`` reads Parquet) instead.

A custom task (``train.loss`` set) gets the numeric columns as the leaves of its batch dict:
scalars ``[B]``, fixed-length lists ``[B, L]`` (nested lists add axes), read into memory once.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from jddp.data.formats.shards import EncodedImageSource, check_labels_in_range, split_files
from jddp.data.source import Splits
from jddp.errors import DataConfigError, DataError, one_line

HINT = (
    "point it at Parquet shards (a folder, a glob or a brace pattern), e.g. a Hugging Face "
    "data set's data/ folder with train-*.parquet and validation-*.parquet"
)
IMAGE_COLUMNS: tuple[str, ...] = ("image", "img", "jpg", "png", "webp")
LABEL_COLUMNS: tuple[str, ...] = ("label", "labels", "cls", "class")
ROW_GROUP_CACHE_BYTES = 512 << 20
"""Decoded row groups kept per process (least recently used dropped first)."""


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is in requirements.lock
        raise DataConfigError(
            "data.name=parquet needs pyarrow: pip install 'jddp[formats]' (or pyarrow)"
        ) from None
    return pq


def open_shard(path: Path) -> Any:
    """``pyarrow.parquet.ParquetFile`` of ``path``, or a :class:`DataError` naming it."""
    try:
        return _pq().ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - any reader failure is a damaged shard
        raise DataError(
            f"parquet: shard {str(path)!r} cannot be read: {one_line(err)} (truncated or not "
            "a Parquet file)"
        ) from err


def class_names(schema: Any, column: str) -> list[str] | None:
    """The Hub's ``ClassLabel`` names of ``column`` from a file's metadata, if it has them."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return None
    try:
        feature = json.loads(meta)["info"]["features"][column]
        names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


def _is_image_type(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        return index >= 0 and _is_image_type(kind.field(index).type)
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _pick(schema: Any, wanted: str | None, defaults: tuple[str, ...], key: str, where: str) -> str:
    names = list(schema.names)
    if wanted:
        if wanted not in names:
            raise DataError(
                f"parquet: {where} has no column {wanted!r} ({key}); its columns: "
                f"{', '.join(names)}"
            )
        return wanted
    found = next((c for c in defaults if c in names), None)
    if found is None:
        raise DataError(
            f"parquet: {where} has no {' or '.join(repr(c) for c in defaults)} column; its "
            f"columns: {', '.join(names)}: set {key}"
        )
    return found


class ParquetSource(EncodedImageSource):
    """A :class:`~jddp.data.source.Source` over the encoded-image rows of Parquet ``shards``.

    Args:
      shards: the split's files in order (example ``i`` counts across them).
      image_size: output side; ``None`` means 224.
      num_classes: if given, the labels must be below it; else the ``ClassLabel`` count or the
        largest label + 1.
      image_key / label_key: the columns (``data.image_key`` / ``data.label_key``).

    Opening reads every shard's footer and label column (checked: present, integer, no nulls,
    in range, the same column types in every shard); nothing is decoded here.
    """

    def __init__(
        self,
        shards: list[Path],
        image_size: int | None = None,
        num_classes: int | None = None,
        image_key: str | None = None,
        label_key: str | None = None,
        split: str = "train",
    ) -> None:
        """Read the footers and labels; choose and check the columns."""
        import pyarrow as pa

        self.shards = list(shards)
        self.split = split
        self.image_size = 224 if image_size is None else int(image_size)
        first = open_shard(self.shards[0])
        schema = first.schema_arrow
        where0 = f"shard {str(self.shards[0])!r}"
        self.image_column = _pick(schema, image_key, IMAGE_COLUMNS, "data.image_key", where0)
        self.label_column = _pick(schema, label_key, LABEL_COLUMNS, "data.label_key", where0)
        image_type = schema.field(self.image_column).type
        if not _is_image_type(image_type):
            raise DataError(
                f"parquet: {where0} column {self.image_column!r} is {image_type}, not encoded "
                "images (binary, or a struct with binary 'bytes'): set data.image_key"
            )
        label_type = schema.field(self.label_column).type
        self._nested = pa.types.is_struct(image_type)
        # datasets writes {"bytes": null, "path": ...} for images it did not embed (a data set
        # built from files, load_dataset("imagefolder")): such a row is read from its path.
        self._paths = self._nested and image_type.get_field_index("path") >= 0
        self.classes = class_names(schema, self.label_column)
        groups: list[tuple[int, int, int]] = []  # (shard, row group, rows)
        group_bytes: list[int] = []
        labels: list[np.ndarray] = []
        for s, path in enumerate(self.shards):
            file = first if s == 0 else open_shard(path)
            where = f"shard {str(path)!r}"
            for column, kind in ((self.image_column, image_type), (self.label_column, label_type)):
                names = file.schema_arrow.names
                if column not in names:
                    raise DataError(
                        f"parquet: {where} has no column {column!r} (the first shard has it); "
                        f"its columns: {', '.join(names)}"
                    )
                found = file.schema_arrow.field(column).type
                if found != kind:
                    raise DataError(
                        f"parquet: {where} column {column!r} is {found} but in "
                        f"{str(self.shards[0])!r} it is {kind}: every shard needs one schema"
                    )
            meta = file.metadata
            groups.extend((s, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups))
            group_bytes.extend(
                meta.row_group(g).total_byte_size // max(meta.row_group(g).num_rows, 1)
                for g in range(meta.num_row_groups)
            )
            labels.append(self._labels(file, path))
        all_labels = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        if not all_labels.size:
            raise DataError(f"parquet: the {split} shards ({str(self.shards[0])!r}...) hold no row")
        self._groups = np.asarray(groups, np.int64).reshape(-1, 3)
        self._group_starts = np.cumsum([0, *self._groups[:, 2]])
        self._group_bytes = [int(b) for b in group_bytes]
        self._shard_starts = np.cumsum([0, *(len(x) for x in labels)])
        limit = (
            num_classes
            if num_classes is not None
            else (len(self.classes) if self.classes else None)
        )
        self.num_classes = check_labels_in_range("parquet", all_labels, limit, self.where)
        self.labels = all_labels.astype(np.int32)
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[int, int], tuple[Any, int]] = (
            collections.OrderedDict()
        )
        self._cached_bytes = 0
        self._files: dict[tuple[int, int], Any] = {}  # (thread, shard)
        self._pid = os.getpid()
        self.payloads(np.zeros(1, np.int64))  # a null image or a path not there: said at start

    def _labels(self, file: Any, path: Path) -> np.ndarray:
        """The label column of one shard as int64, checked for nulls and non-integers."""
        import pyarrow as pa

        try:
            column = file.read(columns=[self.label_column]).column(0)
        except Exception as err:  # noqa: BLE001 - a damaged shard
            raise DataError(
                f"parquet: shard {str(path)!r} cannot be read: {one_line(err)}"
            ) from err
        if column.null_count:
            row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"parquet: shard {str(path)!r} row {row} has no {self.label_column!r} (null)"
            )
        if not pa.types.is_integer(column.type):
            raise DataError(
                f"parquet: shard {str(path)!r} column {self.label_column!r} is {column.type}, "
                "not integer class labels: set data.label_key"
            )
        return column.to_numpy().astype(np.int64)

    def stored_bytes(self, i: int) -> int:
        """Example ``i``'s row group's bytes per row (Parquet keeps no size per value)."""
        group = int(np.searchsorted(self._group_starts, i, side="right") - 1)
        return self._group_bytes[group]

    def where(self, i: int) -> str:
        """``shard '...' row r`` of example ``i``."""
        shard = int(np.searchsorted(self._shard_starts, i, side="right") - 1)
        return f"shard {str(self.shards[shard])!r} row {i - int(self._shard_starts[shard])}"

    def _file(self, shard: int) -> Any:
        """This thread's open ``ParquetFile`` of ``shard`` (opened on first use). One per
        thread: pyarrow's reader is not safe to share, two input threads reading row groups of
        one file at once crashed a rank with SIGSEGV in ``read_row_group`` (2026-11-28)."""
        if self._pid != os.getpid():  # a forked copy: the parent's files and cache are not ours
            self._files, self._cache, self._cached_bytes = {}, collections.OrderedDict(), 0
            self._pid = os.getpid()
        key = (threading.get_ident(), shard)  # a finished thread's id reused: its file is free
        file = self._files.get(key)
        if file is None:
            file = open_shard(self.shards[shard])
            with self._lock:
                self._files[key] = file
        return file

    def _row_group(self, group: int) -> Any:
        """The image bytes (an Arrow binary array) of row group ``group`` and, where the column
        has them, its paths (else None), via the cache."""
        shard, g, _ = (int(v) for v in self._groups[group])
        with self._lock:
            hit = self._cache.get((shard, g))
            if hit is not None:
                self._cache.move_to_end((shard, g))
                return hit[0]
        column = f"{self.image_column}.bytes" if self._nested else self.image_column
        columns = [column, f"{self.image_column}.path"] if self._paths else [column]
        try:
            table = self._file(shard).read_row_group(g, columns=columns)
        except Exception as err:  # noqa: BLE001 - a damaged shard
            start = int(self._group_starts[group] - self._shard_starts[shard])
            raise DataError(
                f"parquet: shard {str(self.shards[shard])!r} rows {start}.."
                f"{start + int(self._groups[group, 2]) - 1} (row group {g}) cannot be read: "
                f"{one_line(err)}"
            ) from err
        column = table.column(0).combine_chunks()  # a struct's chosen fields come as one
        images = column.field("bytes") if self._nested and hasattr(column, "field") else column
        paths = column.field("path") if self._paths and hasattr(column, "field") else None
        values = (images, paths)
        size = int(images.nbytes) + (int(paths.nbytes) if paths is not None else 0)
        with self._lock:
            if (shard, g) not in self._cache:
                self._cache[(shard, g)] = (values, size)
                self._cached_bytes += size
                while self._cached_bytes > ROW_GROUP_CACHE_BYTES and len(self._cache) > 1:
                    _, (_, dropped) = self._cache.popitem(last=False)
                    self._cached_bytes -= dropped
        return values

    def payloads(self, indices: np.ndarray) -> list[tuple[bytes, str]]:
        """Each example's encoded bytes, read through its row group (rows of one group once)."""
        groups = np.searchsorted(self._group_starts, indices, side="right") - 1
        out: list[tuple[bytes, str]] = []
        for i, group in zip(indices, groups, strict=True):
            values, paths = self._row_group(int(group))
            row = int(i - self._group_starts[group])
            data = values[row].as_py()
            where = f"parquet: {self.where(int(i))}"
            if data is None and paths is not None and paths[row].as_py():
                shard = int(self._groups[group, 0])
                data = self._read_path(paths[row].as_py(), self.shards[shard], where)
            if data is None:
                raise DataError(f"{where} has no image (null {self.image_column!r})")
            out.append((data, f"{where}: cannot decode image"))
        return out

    def _read_path(self, path: str, shard: Path, where: str) -> bytes:
        """The bytes of an image the shard holds by path: an absolute path as it is; a relative
        one from the shard's folder, else from the working folder; a :class:`DataError` saying
        how to embed the images when it is in neither place."""
        given = Path(path).expanduser()
        tried = [given] if given.is_absolute() else [shard.parent / given, given]
        for candidate in tried:
            if candidate.is_file():
                try:
                    return candidate.read_bytes()
                except OSError as err:
                    raise DataError(f"{where}: image {str(candidate)!r}: {one_line(err)}") from err
        raise DataError(
            f"{where}: the image is not in the shard but a path, {path!r}, and no file is there "
            f"(looked at {', '.join(repr(str(t)) for t in tried)}): the data set was written "
            "from files without their "
            "bytes; embed them (datasets: ds.with_format('arrow').map(datasets.table."
            "embed_table_storage, batched=True) before ds.to_parquet(...); push_to_hub embeds "
            "them) or put the files at that path"
        )

    def __repr__(self) -> str:
        """Stable description (no memory addresses)."""
        return (
            f"ParquetSource(shards={len(self.shards)}, first={str(self.shards[0])!r}, "
            f"split={self.split!r}, n={len(self)}, image_size={self.image_size}, "
            f"num_classes={self.num_classes})"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without open files, the cache or the lock (workers open their own)."""
        state = {**self.__dict__, "_files": {}, "_lock": None, "_cached_bytes": 0}
        state["_cache"] = collections.OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()


def numeric_table(shards: list[Path], who: str) -> dict[str, np.ndarray]:
    """The numeric columns of ``shards`` as arrays sharing a leading row axis: scalars
    ``[N]``, fixed-length (nested) lists ``[N, L, ...]``; other columns are left out. A list
    column of varying length, a null, or a column that differs between shards is a
    :class:`DataError` naming the shard and the column."""
    import pyarrow as pa

    columns: dict[str, list[np.ndarray]] = {}
    types: dict[str, Any] = {}
    for path in shards:
        table = open_shard(path).read()
        where = f"parquet: shard {str(path)!r}"
        for name, column in zip(table.column_names, table.columns, strict=True):
            kind = column.type
            inner = kind
            while (
                pa.types.is_list(inner)
                or pa.types.is_large_list(inner)
                or (pa.types.is_fixed_size_list(inner))
            ):
                inner = inner.value_type
            if not (
                pa.types.is_integer(inner)
                or pa.types.is_floating(inner)
                or pa.types.is_boolean(inner)
            ):
                continue
            if name in types and types[name] != kind:
                raise DataError(
                    f"{where} column {name!r} is {kind} but {types[name]} in {str(shards[0])!r}: "
                    "every shard needs one schema"
                )
            types[name] = kind
            if column.null_count:
                row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
                raise DataError(f"{where} row {row}: column {name!r} is null")
            try:
                array = np.asarray(column.to_pylist() if kind != inner else column.to_numpy())
            except (ValueError, pa.ArrowInvalid) as err:
                raise DataError(f"{where} column {name!r}: {one_line(err)}") from err
            if array.dtype == object:
                raise DataError(
                    f"{where} column {name!r} holds lists of different lengths: pad them to one "
                    "length (a batch leaf needs one shape)"
                )
            columns.setdefault(name, []).append(array)
    missing = [n for n, parts in columns.items() if len(parts) != len(shards)]
    if missing:
        raise DataError(f"parquet: column {missing[0]!r} is missing from some {who} shards")
    if not columns:
        raise DataError(
            f"parquet: the {who} shards ({str(shards[0])!r}...) have no numeric column for a "
            "custom task's batch"
        )
    out = {name: np.concatenate(parts) for name, parts in columns.items()}
    for name, array in out.items():
        if array.dtype == np.float64:
            out[name] = array.astype(np.float32)
    return out


def load(
    path: str | None,
    image_size: int | None,
    seed: int,
    num_classes: int | None,
    *,
    eval_path: str | None = None,
    image_key: str | None = None,
    label_key: str | None = None,
    custom: bool = False,
    index_dir: str | None = None,
) -> Splits:
    """The train and eval splits of the shards ``path`` (and ``eval_path``): labelled images,
    or a custom task's numeric columns when ``custom``. ``seed``/``index_dir`` are unused."""
    del seed, index_dir
    train_files, eval_files = split_files("parquet", path, eval_path, (".parquet",), HINT)
    if eval_files is not None and set(eval_files) & set(train_files):
        raise DataConfigError("data.eval_path names shards that data.path trains on")
    if custom:
        from jddp.data.trees import ArrayTreeSource

        train = ArrayTreeSource(numeric_table(train_files, "train"), "parquet/train")
        if eval_files is None:
            return Splits(train=train, eval=train)
        evaluation = ArrayTreeSource(numeric_table(eval_files, "eval"), "parquet/eval")
        return Splits(train=train, eval=evaluation)
    keys = {"image_key": image_key, "label_key": label_key}
    train = ParquetSource(train_files, image_size, num_classes, split="train", **keys)
    if eval_files is None:
        return Splits(train=train, eval=train)
    evaluation = ParquetSource(eval_files, image_size, train.num_classes, split="eval", **keys)
    return Splits(train=train, eval=evaluation)
