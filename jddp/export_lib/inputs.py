"""What an exported program takes: the arrays a model is called on, as a :class:`Signature`.

A run's inputs are what its task feeds the model, found by tracing the task's loss on batches
shaped like the run's eval data, with a stand-in for the model that records its call
(:func:`task_signature`): the normalised images ``[B, H, W, C]`` of image classification (the
pixel normalisation is not part of the model), the arrays a custom task's loss passes
(``model(batch["image"], batch["side"])``: two inputs, named after the model's parameters).
Arrays whose leading axis is the batch are inputs; other values are fixed. A module alone is
described by an example batch of its inputs (:func:`signature_of_example`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jddp.errors import ConfigError, JddpError, one_line

TRACE_ROWS = (2, 3)  # a task is traced at two batch sizes: the inputs are what scales with it


PathLike = str | Path


@dataclass(frozen=True)
class Input:
    """One array the exported program takes: its name, one example's shape and the dtype (the
    batch axis comes first)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def spec(self, batch: Any) -> jax.ShapeDtypeStruct:
        """The array of ``batch`` examples (an int or a symbolic dimension)."""
        return jax.ShapeDtypeStruct((batch, *self.shape), self.dtype)


@dataclass(frozen=True)
class Signature:
    """How the exported program calls the model: ``model(*args, **kwargs)``, where each
    :class:`Input` leaf is one of its inputs (in tree order) and every other leaf is fixed."""

    args: tuple
    kwargs: dict

    @property
    def inputs(self) -> list[Input]:
        return [x for x in jax.tree.leaves((self.args, self.kwargs)) if isinstance(x, Input)]

    def call(self, model: Any, arrays: Sequence[Any]) -> Any:
        """``model`` on ``arrays``, one per input."""
        given = iter(arrays)
        args, kwargs = jax.tree.map(
            lambda x: next(given) if isinstance(x, Input) else x, (self.args, self.kwargs)
        )
        return model(*args, **kwargs)

    def renamed(self, name: str) -> Signature:
        """This signature with its inputs called ``name`` (for one input)."""
        args, kwargs = jax.tree.map(
            lambda x: Input(name, x.shape, x.dtype) if isinstance(x, Input) else x,
            (self.args, self.kwargs),
        )
        return Signature(args, kwargs)


def key_name(key: Any) -> str:
    """A pytree path entry as a name: a dict key, a sequence index or an attribute."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def signature_of(model: Any, args: tuple, kwargs: dict) -> Signature:
    """The signature of ``model(*args, **kwargs)``: every leaf with a shape and a dtype (an
    array, a ``jax.ShapeDtypeStruct``) is an input — its leading axis the batch —, named after
    the model's parameter it is passed as (``args2`` past them; a nested leaf adds its path:
    ``batch.image``); any other leaf is fixed."""
    try:
        params = list(inspect.signature(model).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def leaf(path: tuple, x: Any) -> Any:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        where, first, *rest = path
        if where.idx == 0:  # a positional argument
            i = first.idx
            base = positional[i] if i < len(positional) else f"args{i}"
        else:
            base = key_name(first)
        name = ".".join([base, *(key_name(k) for k in rest)])
        if not x.shape:
            raise ConfigError(f"{name}: a scalar input has no batch axis; inputs are [B, ...]")
        return Input(name, tuple(x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype))

    args, kwargs = jax.tree_util.tree_map_with_path(leaf, (tuple(args), dict(kwargs)))
    return Signature(args, kwargs)


def signature_of_example(model: Any, example: Any) -> Signature:
    """The signature of ``model`` on ``example``, a batch of its inputs as
    :func:`jddp.predict` feeds them: ``model(x)`` for an array, ``model(*x)`` for a tuple,
    ``model(**x)`` for a dict."""
    if isinstance(example, tuple):
        return signature_of(model, example, {})
    if isinstance(example, dict):
        return signature_of(model, (), example)
    return signature_of(model, (example,), {})


class _Recorder:
    """Stands in for the model in a task's loss: records what each call passes (shapes of
    traced arrays, other values as they are) and calls the model."""

    def __init__(self, model: Any, calls: list):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_calls", calls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        def abstract(x: Any) -> Any:
            if isinstance(x, jax.core.Tracer):
                return jax.ShapeDtypeStruct(x.shape, x.dtype)
            return x

        self._calls.append(jax.tree.map(abstract, (args, kwargs)))
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def task_signature(model: nnx.Module, task: Any, example: Any, who: str) -> Signature:
    """The model's inputs as ``task`` feeds them (its ``loss_terms``), traced on batches of
    :data:`TRACE_ROWS` examples shaped like ``example`` (one example's shapes and dtypes): the
    arrays whose leading axis is the batch are the inputs, values passed the same way each time
    are fixed. ``who`` names the task in errors (``ConfigError`` saying to pass
    ``--input-shape`` when the inputs cannot be told)."""
    graphdef, state = nnx.split(model)
    advice = "pass --input-shape (or call jddp.export with example=)"
    records = []
    for rows in TRACE_ROWS:
        calls: list = []
        batch = jax.tree.map(
            lambda s, n=rows: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), example
        )

        def feed(state: Any, batch: Any, calls: list = calls) -> Any:
            module = nnx.merge(graphdef, state)
            module.eval()
            return task.loss_terms(_Recorder(module, calls), batch)

        try:
            jax.eval_shape(feed, state, batch)
        except JddpError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's loss, traced on a stand-in
            raise ConfigError(
                f"--input-shape: cannot tell the model's inputs: tracing {who} on a batch of "
                f"the run's data failed ({type(e).__name__}: {one_line(e)}); {advice}"
            ) from None
        if not calls:
            raise ConfigError(
                f"--input-shape: cannot tell the model's inputs: {who} does not call the model "
                f"(model(...)); {advice}"
            )
        records.append(calls[0])
    (small, small_tree), (large, large_tree) = (
        jax.tree_util.tree_flatten(r, is_leaf=lambda x: x is None) for r in records
    )
    if small_tree != large_tree:  # type: ignore[operator]  # jax's PyTreeDef alias: no type to mypy
        raise ConfigError(
            f"--input-shape: cannot tell the model's inputs: {who} calls the model with "
            f"differently structured arguments for different batch sizes; {advice}"
        )
    leaves = []
    for a, b in zip(small, large, strict=True):
        if isinstance(a, jax.ShapeDtypeStruct):
            if a.shape[:1] != (TRACE_ROWS[0],) or b.shape != (TRACE_ROWS[1], *a.shape[1:]):
                raise ConfigError(
                    f"--input-shape: cannot tell the model's inputs: {who} passes the model an "
                    f"array {a.dtype}{list(a.shape)} whose leading axis is not the batch; {advice}"
                )
        leaves.append(a)
    args, kwargs = jax.tree_util.tree_unflatten(small_tree, leaves)
    return signature_of(model, args, kwargs)


def parse_input_shape(text: str) -> jax.ShapeDtypeStruct:
    """``--input-shape``: one example's shape ``32,32,3`` (float32) or ``int32[128]``, as a
    batch of one example."""
    dtype, shape = "float32", text.strip()
    if shape.endswith("]") and "[" in shape:
        dtype, _, shape = shape[:-1].partition("[")
    try:
        dims = tuple(int(d) for d in shape.split(","))
        np_dtype = np.dtype(dtype.strip())
    except (TypeError, ValueError):
        dims, np_dtype = (), None
    if not dims or min(dims) < 1 or np_dtype is None or np_dtype.kind not in "biuf":
        raise ConfigError(
            f"--input-shape: {text!r} is not one example's shape: expected sizes like 32,32,3 "
            "(float32) or a dtype and sizes like int32[128]"
        )
    return jax.ShapeDtypeStruct((1, *dims), np_dtype)


def run_signature(
    path: PathLike, run: Any, example: Any = None, trust_code: bool = False
) -> Signature:
    """The inputs of the model of the run at ``path`` (``run``: its
    :class:`~jddp.inference.LoadedRun`): ``example``'s when given (a batch of the model's
    inputs, see :func:`signature_of_example`), else what the run's task feeds the model on a
    batch of its eval data (the run's data and task code are imported only with
    ``trust_code``: :func:`jddp.eval_lib.run_config`)."""
    from jddp.build import build_task, is_custom_task, load_data
    from jddp.data.pipeline import eval_batch
    from jddp.errors import DataError
    from jddp.eval_lib import run_config

    if example is not None:
        signature = signature_of_example(run.model, example)
    else:
        cfg = run_config(Path(path), trust_code=trust_code)
        custom = is_custom_task(cfg)
        if run.task == "custom" and not custom:
            raise ConfigError(
                "--input-shape: cannot tell the model's inputs: this run's loss was given to "
                "jddp.fit, its config names none (train.loss); pass --input-shape, one "
                "example's shape (e.g. 4, or int32[128]), or call jddp.export with example="
            )
        try:
            source = load_data(cfg, custom).eval
            one = eval_batch(source, np.arange(1), run.augment)
        except (DataError, ConfigError, OSError) as e:
            raise ConfigError(
                f"--input-shape: cannot tell the model's input shape: the run's data "
                f"(data.name={cfg.data.name}) cannot be read here ({one_line(e)}); pass "
                "--input-shape, one example's shape, e.g. 32,32,3 (float32) or int32[128]"
            ) from None
        who = f"train.loss={cfg.train.loss}" if custom else "the image classification task"
        example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), one)
        signature = task_signature(run.model, build_task(cfg), example, who)
    if run.task == "classification" and len(signature.inputs) == 1:
        signature = signature.renamed("images")
    return signature
