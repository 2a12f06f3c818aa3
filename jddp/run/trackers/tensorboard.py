"""TensorBoard (tensorboardX event files in ``workdir/tensorboard``), and reading them back."""

from __future__ import annotations

import contextlib
import logging
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jddp.run.trackers.base import Started


def _records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (an event file), up to the first torn one (a writer
    killed mid-record)."""
    data = path.read_bytes()
    at = 0
    while at + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        end = at + 12 + length + 4
        if end > len(data):
            return
        yield data[at + 12 : at + 12 + length]
        at = end


def tensorboard_points(folder: Path) -> dict[str, set[int]]:
    """Per scalar tag, the steps TensorBoard shows from the event files in ``folder``: the files
    read in the order they were written, a purge (a writer started with ``purge_step``)
    hiding every earlier point at or after its step, as TensorBoard does."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    points: dict[str, set[int]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for record in _records(path):
            try:
                event = Event.FromString(record)
            except Exception:  # noqa: BLE001 - a damaged record: what follows is unreadable
                break
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for steps in points.values():
                    steps.difference_update({s for s in steps if s >= event.step})
            for value in event.summary.value:
                points.setdefault(value.tag, set()).add(int(event.step))
    return points


# tensorboardX warns "NaN or Inf found in input tensor." for every non-finite value it writes
# (three lines before jddp's own one about a non-finite step: the loss and two norms); the value
# is still written, and jddp says it itself (train.on_nonfinite).
_X2NUM = logging.getLogger("tensorboardX.x2num")


class _NoNanWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("NaN or Inf found")


@contextlib.contextmanager
def _quiet_nan() -> Iterator[None]:
    """tensorboardX's NaN warning off for jddp's own writes (a user's keep it)."""
    quiet = _NoNanWarning()
    _X2NUM.addFilter(quiet)
    try:
        yield
    finally:
        _X2NUM.removeFilter(quiet)


class TensorBoardTracker:
    """Event files in ``workdir/tensorboard`` (tensorboardX), on disk within a second of each
    log line (its writer thread flushes every second, not every 120 s). On resume, events of
    steps after the resumed checkpoint are purged, as ``metrics.jsonl`` drops its lines, and
    the points of earlier steps that the files lack (what a ``kill -9`` caught in the writer's
    queue) are refilled from ``metrics.jsonl``: each step once, one value."""

    name, remote = "tensorboard", False

    def __init__(self, folder: Path, resume_step: int):
        self.folder, self.resume_step = folder, resume_step
        self._writer: Any = None
        self._shown: dict[str, set[int]] = {}  # points up to the resumed step already there

    def start(self, config: dict[str, Any], run_id: str | None) -> Started:
        from tensorboardX import SummaryWriter

        if self.resume_step > 0 and self.folder.is_dir():
            self._shown = tensorboard_points(self.folder)
        self._writer = SummaryWriter(
            str(self.folder), purge_step=self.resume_step + 1, flush_secs=1
        )
        return Started("")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            if step <= self.resume_step and step in self._shown.get(key, ()):
                continue  # a refilled step the files already show
            if math.isfinite(value):
                self._writer.add_scalar(key, value, step)
            else:  # shown in TensorBoard as NaN or Inf; said once by jddp, not per value
                with _quiet_nan():
                    self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def finish(self, result: dict[str, Any], checkpoint: str | None, status: str) -> None:
        self._writer.close()
