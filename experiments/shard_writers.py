"""Image data sets written as the Hugging Face Hub (Parquet) and WebDataset write them, from an
image folder: for the input benchmark (experiments/bench_input.py) and the tests of those
formats (tests/test_shard_formats.py). Benchmarks never import tests: the writers live here."""

import json
from pathlib import Path

import numpy as np


def folder_examples(root: Path, split: str) -> tuple[list[Path], list[int], list[str]]:
    """The files, labels and classes of an image folder's split, in the order jddp reads it."""
    from jddp.data.formats.imagefolder import ImageFolderSource

    source = ImageFolderSource(root, None, split)
    return source.files, [int(y) for y in source.labels], source.classes


def write_parquet_like_the_hub(
    root: Path,
    out: Path,
    shards: int = 2,
    row_group_rows: int = 3,
    eval_name: str = "validation",
    paths_only: bool = False,
) -> list[Path]:
    """The image folder ``root`` as the Hugging Face Hub writes an image data set:
    ``out/data/{train,validation}-0000i-of-0000n.parquet``, an ``image`` struct of the files'
    bytes and paths, an int64 ``label`` and the ``ClassLabel`` names in the file metadata.
    ``paths_only``: as ``datasets`` writes images it did not embed (``to_parquet`` of a data set
    built from files): ``{"bytes": None, "path": <the file's absolute path>}``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = []
    for split, name in (("train", "train"), ("val", eval_name)):
        files, labels, classes = folder_examples(root, split)
        features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
        meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
        image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        bounds = np.linspace(0, len(files), shards + 1).astype(int)
        for s in range(shards):
            rows = range(bounds[s], bounds[s + 1])
            table = pa.table(
                {
                    "image": pa.array(
                        [
                            {"bytes": None, "path": str(files[i].resolve())}
                            if paths_only
                            else {"bytes": files[i].read_bytes(), "path": files[i].name}
                            for i in rows
                        ],
                        image_type,
                    ),
                    "label": pa.array([labels[i] for i in rows], pa.int64()),
                }
            ).replace_schema_metadata(meta)
            path = out / "data" / f"{name}-{s:05d}-of-{shards:05d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path, row_group_size=row_group_rows)
            written.append(path)
    return written


def write_webdataset(root: Path, out: Path, shards: int = 2, label: str = "cls") -> list[Path]:
    """The image folder ``root`` as WebDataset tar shards ``out/{train,val}-00000i.tar``:
    ``<key>.<ext>`` with the file's bytes and ``<key>.cls`` (or ``.json`` ``{"label": y}``)."""
    import io
    import tarfile

    written = []
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        files, labels, _ = folder_examples(root, split)
        bounds = np.linspace(0, len(files), shards + 1).astype(int)
        for s in range(shards):
            path = out / f"{split}-{s:06d}.tar"
            with tarfile.open(path, "w") as tar:
                for i in range(bounds[s], bounds[s + 1]):
                    key = f"{split}/{i:06d}"
                    text = str(labels[i]) if label == "cls" else json.dumps({"label": labels[i]})
                    ext = files[i].suffix.lower().lstrip(".")
                    for member, data in (
                        (f"{key}.{ext}", files[i].read_bytes()),
                        (f"{key}.{label}", text.encode()),
                    ):
                        info = tarfile.TarInfo(member)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
            written.append(path)
    return written
