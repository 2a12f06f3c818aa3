"""Orbax checkpoints of the train state in ``workdir/checkpoints/<step>/``, verified on restore.

Orbax writes each step to a temporary folder and renames it when complete, so a crash during a
save never leaves a half checkpoint under a step name. Saves are asynchronous: training goes on
while the previous save is written; :meth:`Checkpoints.close` waits for the last one.

Every checkpoint also holds a manifest: each state leaf's path, shape, dtype and CRC-32. On
resume the newest checkpoint whose files restore *and* whose restored values match the manifest
is used; a damaged one is named in a warning and skipped. A checkpoint written for another model
(different leaf paths or shapes) is refused with the first mismatch named.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jddp.checkpoint import room
from jddp.checkpoint.manifest import (
    EMA_PREFIX,
    WEIGHT_PREFIXES,
    check_same_model,
    manifest,
    weights_manifest,
)
from jddp.checkpoint.orbax_quiet import (
    collect_abandoned_reads,
    quiet_orbax_errors,
    silence_late_read_callbacks,
)
from jddp.compat.orbax_writes import cut_cpu_slices_on_host, wait_for_failed_writes
from jddp.errors import (
    CheckpointDamaged,
    CheckpointError,
    CheckpointGone,
    ConfigError,
    JddpError,
)
from jddp.state import TrainState
from jddp.workdir import RunFolder, unwritable

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's name for a save not yet finalised


def _warn(message: str) -> None:
    print(f"jddp: warning: {message}", file=sys.stderr, flush=True)


class Checkpoints:
    """Save (when :class:`~jddp.checkpoint.policy.SavePolicy` says), keep the newest ``keep``,
    restore.

    Under ``jax.distributed`` every process calls :meth:`save` (orbax makes process 0 the
    primary host). With ``writes=False`` (MPI ranks other than 0, which share no JAX runtime
    and would each act as primary) the process only restores.
    """

    @classmethod
    def of(cls, folder: RunFolder, **options: Any) -> Checkpoints:
        """The checkpoints of run folder ``folder`` (options as for the constructor)."""
        return cls(folder.checkpoints, damaged_directory=folder.damaged_checkpoints, **options)

    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int = 0,  # (unused: when to save is jddp.checkpoint.policy's)
        keep: int,
        async_save: bool,
        writes: bool = True,
        primary: bool = True,
        damaged_directory: str | Path,
        pixel_norm: dict[str, Any] | None = None,
        task: str = "classification",
        classes: list[str] | None = None,
        agree: Callable[[bool], bool] | None = None,
        preserve: Any = None,
    ):
        """``preserve``: which checkpoints rotation keeps (an orbax ``PreservationPolicy``,
        e.g. :class:`~jddp.checkpoint.best.KeepNewestAndBest`) instead of the newest
        ``keep``."""
        self.directory = Path(directory).absolute()
        # How the run turns integer pixels into model input (PixelNorm.to_json), and what its
        # task is (jddp.tasks: "classification" or "custom"): recorded with every checkpoint so
        # that jddp.predict/evaluate of the run feed it as training did.
        self.pixel_norm = pixel_norm
        self.task = task
        self.classes = classes  # the train data's class names, where it names them
        self.primary = primary  # process 0: moves damaged checkpoints aside
        self.damaged_directory = Path(damaged_directory)
        self.writes = writes
        # Across JAX processes (all of which save), True on every process iff ok on every one:
        # they start a save, or refuse it for want of room, together.
        self._agree = agree or (lambda ok: ok)
        self._saving: int | None = None  # the step of the save in flight
        # Told ``(step, path)`` once a save is complete on disk (the callbacks'
        # on_checkpoint): at :meth:`poll`, :meth:`wait` or :meth:`close`, never at its start.
        self.on_durable: Callable[[int, str], None] | None = None
        self._untold: int | None = None  # a step saved, not yet told complete
        self._failed: CheckpointError | None = None
        self._state_bytes = 0  # the training state's bytes, known at the first save
        if writes and primary:
            self._remove_cut_saves()
        quiet_orbax_errors()
        cut_cpu_slices_on_host()
        # Reads and writes alike: a failed save (disk full) leaves tensorstore writes in flight
        # whose callbacks print the same late tracebacks as a failed restore.
        silence_late_read_callbacks()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep if preserve is None else None,
                preservation_policy=preserve,
                create=writes,
                enable_async_checkpointing=async_save,
            ),
        )

    def _remove_cut_saves(self, say: bool = True) -> None:
        """A save cut short (kill -9, a stall, a full disk) leaves orbax's temporary folder,
        never a step: the run that writes here (the workdir lock makes it the only one) removes
        it when it starts, and after a save of its own failed. Readers (``python -m
        jddp.evaluate``) never do: a live run's save in flight is such a folder."""
        # A failed save's other writes may still run (orbax's close does not wait for them):
        # one landing after the removal would re-create the folder.
        wait_for_failed_writes()
        for cut in sorted(self.directory.glob(f"*{TMP_SUFFIX}*")):
            shutil.rmtree(cut, ignore_errors=True)
            if say:
                _warn(f"removed {cut}: a save cut short (the checkpoints before it are intact)")

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: TrainState, config: dict[str, Any]) -> bool:
        """Start saving ``state``, its manifest and the resolved config as ``step``; whether a
        save started. A no-op (False) on processes that don't write (MPI ranks other than 0)
        and for a step already saved.
        """
        if not self.writes or step in self._manager.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            manifest=ocp.args.JsonSave(
                {"leaves": manifest(state), "task": self.task}
                | ({} if self.pixel_norm is None else {"pixel_norm": self.pixel_norm})
                | ({} if self.classes is None else {"classes": self.classes})
            ),
            config=ocp.args.JsonSave(config),
        )
        # What a checkpoint takes on disk, about: said when the disk turns out too small.
        self._state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
        self.wait()  # the save before: on disk, or its failure raised here
        self._check_room(step)
        self._guard(lambda: self._manager.save(step, args=args), step)
        self._saving = self._untold = step
        self.poll()  # a synchronous save is complete already
        return True

    def poll(self) -> None:
        """Without waiting: tell :attr:`on_durable` of the save in flight if it is complete
        on disk (orbax's commit and rename done on every process). A save that failed is left
        to :meth:`wait` to report (it never appears under its step's name)."""
        step = self._untold
        if step is None or self.on_durable is None or self._manager.is_saving_in_progress():
            return
        if (self.directory / str(step)).is_dir():
            self._tell()

    def _tell(self) -> None:
        step, self._untold = self._untold, None
        if step is not None and self.on_durable is not None:
            self.on_durable(step, str(self.directory / str(step)))

    def _check_room(self, step: int) -> None:
        """Refuse (``CheckpointError``, on every process together) a save into a folder that
        cannot be written (made read-only, replaced, gone since the run started) or that the
        disk has no room for, before any of it is written: a save that fails part-way across
        processes can fail on one process alone while the others wait for it in orbax's
        commit (a stall; a read-only folder had ended a 2-process run in a timeout)."""
        intact = [int(p.name) for p in sorted_steps(self.directory)]
        refused = unwritable(self.directory)
        if refused is not None:
            problem = f"{refused}: {self.directory}"
        else:
            missing = room.shortfall(self.directory, intact, self._state_bytes)
            problem = None if missing is None else f"not enough space{missing}"
        if self._agree(problem is None):
            return
        self._failed = CheckpointError(
            f"checkpoint {self.directory / str(step)} could not be written ("
            f"{problem or 'on another process'}); the checkpoints before it are intact: "
            f"{intact or 'none'}"
        )
        raise self._failed

    def restore_newest_good(
        self,
        like: TrainState,
        agree: Callable[[bool], bool] = lambda ok: ok,
        check_config: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> tuple[TrainState, int] | None:
        """The newest checkpoint that restores and verifies, as ``(state, step)``; None if none.

        ``agree(ok)`` must return True only if every process found the candidate good, so all
        processes fall back together. ``check_config(step, saved_config)`` may refuse a
        candidate (raising) before its arrays are compared. Raises ``ConfigError`` for a
        checkpoint of another model and ``CheckpointError`` when none is usable.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        steps = self.all_steps()
        damaged: list[int] = []
        try:
            return self._restore_newest_good(abstract, like, steps, damaged, agree, check_config)
        finally:
            if damaged:
                self._set_aside(damaged, agree)

    def _set_aside(self, damaged: list[int], agree: Callable[[bool], bool]) -> None:
        # Keep damaged checkpoints (nothing written is deleted) but out of the step namespace,
        # so a later save of the same step is not skipped as "already there".
        if self.writes and self.primary:
            aside = self.damaged_directory
            aside.mkdir(exist_ok=True)
            for step in damaged:
                target = aside / f"{step}-{int(time.time())}"
                shutil.move(str(self.directory / str(step)), str(target))
                _warn(f"moved damaged checkpoint {self.directory / str(step)} to {target}")
        agree(True)  # everyone waits for the move before looking at the folder again
        self._manager.reload()

    def _restore_newest_good(self, abstract, like, steps, damaged, agree, check_config):
        for step in reversed(steps):
            where = self.directory / str(step)
            read = {"like": like, "abstract": abstract}  # as the checkpoint holds the EMA

            def accept(
                saved: list[list[Any]], step: int = step, where: Path = where, read: dict = read
            ) -> None:
                if check_config is not None:
                    check_config(step, self.saved_config(step))
                read["like"] = _ema_as_saved(like, saved)
                if read["like"] is not like:
                    read["abstract"] = jax.tree.map(ocp.utils.to_shape_dtype_struct, read["like"])
                check_same_model(saved, read["like"], where)

            def restore(step: int = step, read: dict = read) -> TrainState:
                args = ocp.args.Composite(state=ocp.args.StandardRestore(read["abstract"]))
                return self._manager.restore(step, args=args)["state"]

            state, problem = None, None
            try:
                state = self._verified(step, restore, manifest, accept)
            except CheckpointDamaged as e:  # (CheckpointGone: another run deletes; it surfaces)
                problem = e.problem
            if agree(problem is None):
                return state, step
            damaged.append(step)
            _warn(
                f"checkpoint {where} is damaged: {problem or 'on another process'}; "
                "falling back to an older one"
            )
        if steps:
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}: all {len(steps)} are damaged (moved "
                f"to {self.damaged_directory}); rerun to start from step "
                "0, or repair them by hand"
            )
        return None

    def _verified(
        self,
        step: int,
        restore: Callable[[], Any],
        rows_of: Callable[[Any, dict[str, list[Any]]], list[list[Any]]],
        accept: Callable[[list[list[Any]]], None] | None = None,
    ) -> Any:
        """``restore()``'s value, read from checkpoint ``step`` and checked against its
        manifest: ``rows_of(value, saved rows by name)`` (manifest rows of what was read, with
        the saved rows' kind of checksum) must equal the saved rows of the same names.
        ``accept(saved rows)`` may refuse the checkpoint first (raising).
        :class:`CheckpointDamaged` naming the problem (:class:`CheckpointGone` if the
        checkpoint was deleted meanwhile) otherwise."""
        silence_late_read_callbacks()
        saved = self._manifest(step)["leaves"]
        if accept is not None:
            accept(saved)
        problem = None
        try:
            value = restore()
            saved_rows = {row[0]: row for row in saved}
            bad = [row[0] for row in rows_of(value, saved_rows) if saved_rows.get(row[0]) != row]
        except Exception as e:  # noqa: BLE001 - any read failure means "damaged"
            problem = f"it cannot be restored ({_short(e)})"
        if problem is not None:  # outside the except block: its traceback is garbage now
            collect_abandoned_reads()
            self._raise_unreadable(step, problem)
        if bad:
            raise CheckpointDamaged(
                self.directory / str(step),
                f"{len(bad)} arrays differ from their checksums, e.g. {bad[0]}",
            )
        return value

    def _read(self, step: int, item: str, read: Callable[[], Any]) -> Any:
        """``read()`` of checkpoint ``step``'s ``item``; a failure is :class:`CheckpointDamaged`
        (or :class:`CheckpointGone`) naming the checkpoint."""
        try:
            return read()
        except JddpError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
            problem = f"its {item} cannot be read ({_short(e)})"
        collect_abandoned_reads()
        self._raise_unreadable(step, problem)

    def _raise_unreadable(self, step: int, problem: str) -> None:
        where = self.directory / str(step)
        if not where.is_dir():  # a running trainer's keep-N rotation deleted it meanwhile
            raise CheckpointGone(where) from None
        raise CheckpointDamaged(where, problem) from None

    def saved_config(self, step: int) -> dict[str, Any]:
        """The resolved config checkpoint ``step`` was written under."""
        args = ocp.args.Composite(config=ocp.args.JsonRestore())
        return self._read(step, "config", lambda: self._manager.restore(step, args=args)["config"])

    def _manifest(self, step: int) -> dict[str, Any]:
        args = ocp.args.Composite(manifest=ocp.args.JsonRestore())
        return self._read(
            step, "manifest", lambda: self._manager.restore(step, args=args)["manifest"]
        )

    def weight_shapes(self, step: int, ema: bool = False) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of the parameters and model state saved at ``step`` (from its
        manifest; names as :func:`jddp.checkpoint.manifest.weight_leaves` spells them).
        ``ema``: the parameters' moving average in place of the parameters, under their names
        (``ConfigError`` when the checkpoint holds none)."""
        saved = self._manifest(step)["leaves"]
        shapes = {p: tuple(shape) for p, shape, *_ in saved if p.startswith(WEIGHT_PREFIXES)}
        if not ema:
            return shapes
        averaged = {
            ".params" + p.removeprefix(EMA_PREFIX): tuple(shape)
            for p, shape, *_ in saved
            if p.startswith(EMA_PREFIX)
        }
        if not averaged:
            raise ConfigError(
                f"checkpoint {self.directory / str(step)} holds no EMA of the parameters (its "
                "run had train.ema_decay=0): read its parameters (ema=False, no --ema)"
            )
        return {p: s for p, s in shapes.items() if not p.startswith(".params")} | averaged

    def saved_pixel_norm(self, step: int) -> dict[str, Any] | None:
        """The pixel normalisation checkpoint ``step`` was trained with (``PixelNorm.to_json``);
        None for checkpoints written before jddp recorded it."""
        return self._manifest(step).get("pixel_norm")

    def saved_classes(self, step: int) -> list[str] | None:
        """The class names of checkpoint ``step``'s train data, label order (output ``k`` is
        ``classes[k]``); None where the data named none (arrays, a custom task) or for
        checkpoints written before jddp recorded them."""
        return self._manifest(step).get("classes")

    def saved_task(self, step: int) -> str:
        """The task kind checkpoint ``step`` was trained on (``"classification"`` for
        checkpoints written before jddp recorded it: every run was one then)."""
        return self._manifest(step).get("task", "classification")

    def restore_weights(self, step: int, like: dict[str, Any], ema: bool = False) -> dict[str, Any]:
        """Only ``params`` and ``model_state`` of checkpoint ``step`` (the optimizer state is
        not read), as host numpy arrays in the structure of ``like`` (``{"params": ...,
        "model_state": ...}``, whose leaves give each array's shape and dtype), checked against
        the checkpoint's checksums. :class:`CheckpointDamaged` (naming the checkpoint and the
        cause) when it cannot be read or its arrays differ; :class:`CheckpointGone` when it was
        deleted while being read. ``ema``: the parameters' moving average
        (``train.ema_decay``) read in place of the parameters."""
        if ema:
            self.weight_shapes(step, ema=True)  # a checkpoint without one: said in one line
            like = {"ema_params": like["params"], "model_state": like["model_state"]}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), like)
        args = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=as_numpy, partial_restore=True)
        )
        weights = self._verified(
            step, lambda: self._manager.restore(step, args=args)["state"], weights_manifest
        )
        if ema:
            return {"params": weights["ema_params"], "model_state": weights["model_state"]}
        return weights

    def newest_intact(self, like_of: Callable[[int], dict[str, Any]], but: int) -> int | None:
        """The newest checkpoint other than step ``but`` whose weights restore and match their
        checksums (``like_of(step)``: the ``like`` of :meth:`restore_weights` for that step);
        None if there is none. Reads checkpoints newest first and stops at the first good one.
        """
        for step in reversed(self.all_steps()):
            if step == but or not (self.directory / str(step)).is_dir():
                continue
            try:
                self.restore_weights(step, like_of(step))
            except JddpError:  # damaged, deleted meanwhile, or written for another model
                continue
            return step
        return None

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk (told to :attr:`on_durable`);
        ``CheckpointError`` if it failed."""
        self._guard(self._manager.wait_until_finished, self._saving)
        self._tell()

    def close(self) -> None:
        """Finish pending saves and release the manager; ``CheckpointError`` if a save failed
        (reported once: closing again after a failure only releases)."""
        if self._failed is not None:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 - the failure was reported already
                pass
            if self.writes and self.primary:
                self._remove_cut_saves(say=False)
            return
        self.wait()
        # orbax's close waits for its checkpointer's background commit again and can raise what
        # that failed with: a save's failure surfacing here is the same one line as at wait.
        self._guard(self._manager.close, self._saving)

    def _guard(self, action: Callable[[], Any], step: int | None) -> Any:
        """Run ``action``; a failure of a save becomes one :class:`CheckpointError` line naming
        the checkpoint, the cause, and the checkpoints that are intact."""
        try:
            return action()
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
            done = self.all_steps()
            if self._saving is not None and self._saving not in done:
                step = self._saving  # a save in the background failed; it surfaces now
            where = self.directory / (str(step) if step is not None else "?")
            # From the disk, not orbax's cached list (it can lag a save that just finished):
            # a step's own folder appears only when its save is complete.
            intact = [int(p.name) for p in sorted_steps(self.directory) if p.name != str(step)]
            if self.writes and self.primary:
                self._remove_cut_saves(say=False)  # the failed save's half: never a step
            cause = _cause(e)
            if cause in _DISK_FULL:  # (measured with that half removed)
                cause += room.space_note(self.directory, intact, self._state_bytes)
            self._failed = CheckpointError(
                f"checkpoint {where} could not be written ({cause}); the checkpoints "
                f"before it are intact: {intact or 'none'}"
            )
            raise self._failed from None


_DISK_FULL = ("No space left on device", "Disk quota exceeded")


def _ema_as_saved(like: TrainState, saved: list[list[Any]]) -> TrainState:
    """``like`` with an EMA of the parameters exactly when checkpoint rows ``saved`` hold one
    (``train.ema_decay`` turned on or off since: the caller adds or drops it after reading)."""
    has_ema = any(row[0].startswith(".ema_params") for row in saved)
    if has_ema == (like.ema_params is not None):
        return like
    return like.replace(ema_params=like.params if has_ema else None)


def sorted_steps(directory: Path) -> list[Path]:
    """The step folders in checkpoints folder ``directory``, oldest first (none if it is
    missing). Orbax writes a save under a temporary name and renames it when complete."""
    if not directory.is_dir():
        return []
    return sorted(
        (c for c in directory.iterdir() if c.name.isdigit() and c.is_dir()),
        key=lambda c: int(c.name),
    )


def _cause(e: BaseException) -> str:
    """The operating-system cause of a failed write if one is named (disk full, permission),
    else the error's first 200 characters."""
    text = " ".join(str(e).split())
    for cause in (*_DISK_FULL, "Permission denied", "Read-only file system"):
        if cause in text:
            return cause
    return f"{type(e).__name__}: {text[:200]}"


def _short(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"
