"""Export a trained model for inference: StableHLO (``jax.export``) or ONNX (jax2onnx).

What is exported is the model as :func:`jddp.load` returns it, in eval mode (BatchNorm uses its
running statistics, dropout is off), as one program of the arrays the model takes:

* a run's inputs are what its task feeds the model, found by tracing the task's loss on a batch
  shaped like the run's eval data with a stand-in for the model that records its call: the
  normalised images ``[B, H, W, C]`` of image classification (the normalisation is not part of
  the export), the leaves a custom task's loss passes (``model(batch["image"],
  batch["side"])``: two inputs, named after the model's parameters);
* the batch axis is symbolic (``batch``: any size) unless a fixed size is asked for;
* the weights are constants of the program.

StableHLO: ``jax.export`` lowered for CPU and CUDA, serialized; ``jax.export.deserialize(b)
.call(*inputs)`` runs it. ONNX: the program is traced to a jaxpr first and jax2onnx converts
that (its own Flax NNX Conv and BatchNorm plugins mix NHWC and NCHW on a ResNet: onnxruntime
refuses the graph; traced first, only ``lax`` primitives reach the converter). Each export is
run once on random inputs and compared with the model in JAX before it is written.

The CLI is :mod:`jddp.export`; the library call ``jddp.export`` is :func:`export_model`.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jddp.errors import ConfigError, JddpError, one_line

FORMATS = ("stablehlo", "onnx")
PLATFORMS = ("cpu", "cuda")  # what a StableHLO export is lowered for
# onnxruntime >= 1.20 (pyproject's ``export`` extra) runs opset 21.
ONNX_OPSET = 21
BATCH = "batch"  # the symbolic batch dimension's name (ONNX: the dim_param)
CHECK_ROWS = 3  # examples of the check run (a dynamic batch); not 1: a batch of 1 broadcasts
TRACE_ROWS = (2, 3)  # a task is traced at two batch sizes: the inputs are what scales with it

PathLike = str | Path


class ExportError(JddpError):
    """The model cannot be exported: the converter cannot express an operation, or the export
    computes something else than the model (exit 1)."""


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


@dataclass
class Exported:
    """What :func:`export_model` wrote: the file, its format and size, the program's inputs and
    outputs (``name dtype[batch, ...]``), the seconds the export took, and the largest
    difference between the exported program's outputs and the model's on random inputs."""

    path: Path
    format: str
    nbytes: int
    inputs: list[str]
    outputs: list[str]
    seconds: float
    max_abs_diff: float


# ---------------------------------------------------------------------------------------------
# What the model takes


def _key_name(key: Any) -> str:
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
        params = inspect.signature(model).parameters.values()
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
            base = _key_name(first)
        name = ".".join([base, *(_key_name(k) for k in rest)])
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
    if small_tree != large_tree:
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


# ---------------------------------------------------------------------------------------------
# The program and its formats


def _program(model: nnx.Module, signature: Signature) -> Callable:
    """The model for inference as a pure function of its inputs (the weights are constants)."""
    graphdef, state = nnx.split(model)

    def program(*arrays: Any) -> Any:
        module = nnx.merge(graphdef, state)
        for_inference(module)
        return signature.call(module, arrays)

    return program


def for_inference(module: nnx.Module) -> nnx.Module:
    """``module`` in eval mode, its convolutions plain: the built-in ResNets store each
    convolution's input on XLA:CPU to speed up training's weight gradients
    (:func:`jddp.models.resnet._conv_of_stored_input`, a division by ``1 + 0 * x``); an export
    traced on a CPU would carry it to every platform (onnxruntime ran the ResNet-18 1.66x slower
    with it: 0.212 s vs 0.128 s for 32 images on the 2-core VM). The values are the same."""
    from jddp.models.resnet import _conv_of_stored_input

    module.eval()
    for _, layer in nnx.iter_modules(module):
        if getattr(layer, "conv_general_dilated", None) is _conv_of_stored_input:
            layer.conv_general_dilated = jax.lax.conv_general_dilated
    return module


def _describe(name: str, spec: Any) -> str:
    dims = ",".join(str(d) for d in spec.shape)
    return f"{name} {np.dtype(spec.dtype).name}[{dims}]"


def _output_names(outputs: Any, single: str) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(outputs)
    if len(flat) == 1 and not flat[0][0]:
        return [single]
    return [".".join(["output", *(_key_name(k) for k in path)]) for path, _ in flat]


def to_stablehlo(program: Callable, specs: Sequence[jax.ShapeDtypeStruct]) -> bytes:
    """``program`` exported with ``jax.export`` for :data:`PLATFORMS`, serialized."""
    return jax.export.export(jax.jit(program), platforms=PLATFORMS)(*specs).serialize()


def run_stablehlo(data: bytes, arrays: Sequence[Any]) -> list[np.ndarray]:
    """The outputs (flattened) of a serialized StableHLO export on ``arrays``."""
    return [np.asarray(y) for y in jax.tree.leaves(jax.export.deserialize(data).call(*arrays))]


def to_onnx(
    program: Callable,
    specs: Sequence[jax.ShapeDtypeStruct],
    input_names: Sequence[str],
    output_names: Sequence[str],
) -> bytes:
    """``program`` as an ONNX model (opset :data:`ONNX_OPSET`), serialized. It is traced to a
    jaxpr before jax2onnx sees it, so only ``lax`` primitives are converted (see the module
    docstring)."""
    from jax2onnx import to_onnx as convert

    _import_primitive_plugins()
    closed = jax.make_jaxpr(program)(*specs)
    with _quiet("onnx_ir", "jax2onnx"):  # their warnings are about their own bookkeeping
        proto = convert(
            lambda *arrays: _evaluate(closed.jaxpr, closed.consts, arrays),
            list(specs),
            model_name="jddp_model",
            opset=ONNX_OPSET,
            input_names=list(input_names),
            output_names=list(output_names),
        )
    return proto.SerializeToString()


@contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """Only errors from ``loggers`` inside this block."""
    levels = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


# Pooling windows: jax2onnx lowers a window over all of an array's axes to one ONNX pool (or
# convolution) over as many spatial axes, 4 for NHWC images, and onnxruntime runs at most 3
# ("Unsupported pooling size": the ImageNet stem's max pool).
_WINDOWED = ("reduce_window_max", "reduce_window_sum")
_WINDOW_PARAMS = (
    "window_dimensions",
    "window_strides",
    "padding",
    "base_dilation",
    "window_dilation",
)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``jaxpr`` on ``args``, re-traced for jax2onnx: calls (``jit``, custom derivatives, which
    inference does not need) are inlined, and windows of :data:`_WINDOWED` primitives over at most
    two axes run over those axes alone (the others flattened into one: :func:`_narrow_window`)."""
    from jax.extend.core import Literal

    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr" if name in ("jit", "pjit") else "call_jaxpr")
        if name in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call") and hasattr(
            inner, "jaxpr"
        ):
            outs = _evaluate(inner.jaxpr, inner.consts, values)
        elif name in _WINDOWED:
            outs = [_narrow_window(eqn.primitive, values[0], eqn.params)]
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)  # jax 0.10: the params alone
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            outs = eqn.primitive.bind(*subfuns, *values, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _narrow_window(primitive: Any, x: Any, params: dict[str, Any]) -> Any:
    """``primitive`` (a reduce_window) on ``x`` with the axes its window spans (at most two)
    moved last and the others flattened into one leading axis, then put back: the same values,
    a window over 1 + 2 axes (NHWC max pool: [N*C, H, W])."""
    windowed = [
        i
        for i in range(x.ndim)
        if (params["window_dimensions"][i], params["window_strides"][i], params["padding"][i])
        != (1, 1, (0, 0))
        or params["base_dilation"][i] != 1
        or params["window_dilation"][i] != 1
    ]
    if x.ndim <= 3 or len(windowed) > 2:  # onnxruntime's limit is not in the way, or cannot be
        return primitive.bind(x, **params)
    others = [i for i in range(x.ndim) if i not in windowed]
    order = others + windowed
    kept = [x.shape[i] for i in others]
    flat = jax.lax.reshape(
        jax.lax.transpose(x, order), (math.prod(kept), *(x.shape[i] for i in windowed))
    )
    narrow = {
        k: (((0, 0) if k == "padding" else 1), *(params[k][i] for i in windowed))
        for k in _WINDOW_PARAMS
    }
    y = primitive.bind(flat, **narrow)
    y = jax.lax.reshape(y, (*kept, *y.shape[1:]))
    return jax.lax.transpose(y, np.argsort(order).tolist())


def _import_primitive_plugins() -> None:
    """Register only jax2onnx's plugins of JAX primitives, which are all a jaxpr holds. On first
    use jax2onnx imports every plugin module, its examples among them, which build models at
    import (5 s of compiles on the 2-core VM; these 0.5 s), and registers its NNX plugins; the
    flag that says it did is set here. (jax2onnx 0.17.1, pinned by scripts/setup.sh; where its
    internals differ, it imports everything as usual.)"""
    from jax2onnx.plugins import plugin_system

    if getattr(plugin_system, "_already_imported_plugins", True) or not hasattr(
        plugin_system, "_import_tree"
    ):
        return
    plugin_system._import_tree(Path(plugin_system.__file__).parent / "jax", "jax2onnx.plugins.jax")
    plugin_system._already_imported_plugins = True


def run_onnx(data: bytes, names: Sequence[str], arrays: Sequence[Any]) -> list[np.ndarray]:
    """The outputs of a serialized ONNX model on ``arrays`` (inputs ``names``), in
    onnxruntime on the CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # its own lines: a failure is reported below, in one
    try:
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own Fail/InvalidGraph
        raise ExportError(f"onnxruntime cannot load the converted model: {one_line(e)}") from None
    feeds = {n: np.asarray(x) for n, x in zip(names, arrays, strict=True)}
    return session.run(None, feeds)


def _convert(fmt: str, program: Callable, specs: list, names: list[str], outs: list[str]) -> bytes:
    if fmt == "stablehlo":
        return to_stablehlo(program, specs)
    return to_onnx(program, specs, names, outs)


def _sample(specs: Sequence[jax.ShapeDtypeStruct], rows: int) -> list[np.ndarray]:
    """Inputs of the check run: normal floats, zero integers (indices valid for any table)."""
    rng = np.random.default_rng(0)
    out = []
    for s in specs:
        shape = (rows, *s.shape[1:])
        if np.issubdtype(s.dtype, np.floating):
            out.append(rng.standard_normal(shape).astype(s.dtype))
        else:
            out.append(np.zeros(shape, s.dtype))
    return out


def _max_diff(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> tuple[float, float]:
    """The largest absolute difference over the floating outputs, and the largest magnitude of
    the wanted ones (integer outputs must be equal: a difference is infinite)."""
    diff, scale = 0.0, 0.0
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return float("inf"), 0.0
        if not np.issubdtype(w.dtype, np.floating):
            diff = max(diff, 0.0 if np.array_equal(g, w) else float("inf"))
            continue
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        both = np.isfinite(w64) & np.isfinite(g64)
        if not np.array_equal(np.isfinite(w64), np.isfinite(g64)):
            return float("inf"), 0.0
        if both.any():
            diff = max(diff, float(np.abs(g64 - w64)[both].max()))
            scale = max(scale, float(np.abs(w64)[both].max()))
    return diff, scale


def _tolerance(specs: Sequence[Any]) -> float:
    """Relative tolerance of the check: float32 programs 1e-3, 16-bit ones 5e-2."""
    low = any(np.dtype(s.dtype).itemsize < 4 for s in specs if np.issubdtype(s.dtype, np.floating))
    return 5e-2 if low else 1e-3


def export_signature(
    model: nnx.Module,
    signature: Signature,
    out: PathLike,
    fmt: str,
    batch_size: int | None = None,
    output_name: str = "output",
) -> Exported:
    """Export ``model`` (eval mode) called as ``signature`` says to ``out`` in format ``fmt``
    with a batch of ``batch_size`` examples (None: any). The export is run on random inputs and
    compared with the model first (:class:`ExportError` when it differs, or when the converter
    cannot express the model); ``out`` is written whole or not at all."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    start = time.perf_counter()
    out = Path(out)
    inputs = signature.inputs
    names = [x.name for x in inputs]
    (batch,) = jax.export.symbolic_shape(BATCH) if batch_size is None else (batch_size,)
    specs = [x.spec(batch) for x in inputs]
    program = _program(model, signature)
    try:
        out_specs = jax.eval_shape(program, *specs)
    except Exception as e:  # noqa: BLE001 - the model's own code
        given = ", ".join(_describe(n, s) for n, s in zip(names, specs, strict=True))
        raise ExportError(
            f"the model cannot be called on {given}: {type(e).__name__}: {one_line(e)}"
        ) from None
    outs = _output_names(out_specs, output_name)
    try:
        data = _convert(fmt, program, specs, names, outs)
    except Exception as e:  # noqa: BLE001 - jax.export and jax2onnx raise what they raise
        raise _cannot_convert(fmt, e, program, inputs, names, outs, batch_size) from None
    sample = _sample(specs, batch_size or CHECK_ROWS)
    want = [np.asarray(y) for y in jax.tree.leaves(jax.jit(program)(*sample))]
    try:
        got = run_stablehlo(data, sample) if fmt == "stablehlo" else run_onnx(data, names, sample)
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - the runtime's own error
        raise ExportError(f"the exported {fmt} model does not run: {one_line(e)}") from None
    diff, scale = _max_diff(got, want)
    if not diff <= _tolerance([*specs, *jax.tree.leaves(out_specs)]) * max(1.0, scale):
        raise ExportError(
            f"the exported {fmt} model computes something else than the model: its outputs on "
            f"{len(sample[0])} random examples differ by up to {diff:.3g} (outputs up to "
            f"{scale:.3g}); nothing was written"
        )
    _write_whole(out, data)
    return Exported(
        path=out,
        format=fmt,
        nbytes=len(data),
        inputs=[_describe(n, s) for n, s in zip(names, specs, strict=True)],
        outputs=[_describe(n, s) for n, s in zip(outs, jax.tree.leaves(out_specs), strict=True)],
        seconds=time.perf_counter() - start,
        max_abs_diff=diff,
    )


def _cannot_convert(
    fmt: str,
    error: Exception,
    program: Callable,
    inputs: list[Input],
    names: list[str],
    outs: list[str],
    batch_size: int | None,
) -> ExportError:
    """The converter's refusal as one line; with a dynamic batch, whether a fixed one works."""
    tool = "jax.export" if fmt == "stablehlo" else "jax2onnx"
    cause = one_line(error)
    if not isinstance(error, NotImplementedError):
        cause = f"{type(error).__name__}: {cause}"
    hint = ""
    if batch_size is None:
        try:
            _convert(fmt, program, [x.spec(CHECK_ROWS) for x in inputs], names, outs)
            hint = f" (with a dynamic batch; a fixed --batch-size, e.g. {CHECK_ROWS}, converts)"
        except Exception:  # noqa: BLE001 - the model itself is the problem
            pass
    return ExportError(f"--format {fmt}: {tool} cannot express the model: {cause}{hint}")


def _write_whole(out: Path, data: bytes) -> None:
    """``data`` to ``out`` through a temporary file renamed over it (no half-written export)."""
    if not out.parent.is_dir():
        raise ConfigError(f"OUT: folder {out.parent} does not exist")
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise JddpError(f"OUT: cannot write {out}: {e.strerror or one_line(e)}") from None


# ---------------------------------------------------------------------------------------------
# A run, or a module (the library call)


def run_signature(path: PathLike, run: Any, example: Any = None) -> Signature:
    """The inputs of the model of the run at ``path`` (``run``: its
    :class:`~jddp.inference.LoadedRun`): ``example``'s when given (a batch of the model's
    inputs, see :func:`signature_of_example`), else what the run's task feeds the model on a
    batch of its eval data."""
    from jddp.build import build_task, is_custom_task, load_data
    from jddp.data.pipeline import eval_batch
    from jddp.errors import DataError
    from jddp.evaluation import run_config

    if example is not None:
        signature = signature_of_example(run.model, example)
    else:
        cfg = run_config(Path(path))
        custom = is_custom_task(cfg)
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


def export_model(
    model_or_workdir: nnx.Module | PathLike,
    out: PathLike,
    format: str = "stablehlo",  # noqa: A002 - the CLI's --format
    *,
    batch_size: int | None = None,
    step: int | None = None,
    example: Any = None,
) -> Exported:
    """Write the trained model for inference to ``out``: ``format`` ``"stablehlo"``
    (``jax.export``, serialized: ``jax.export.deserialize(open(out, "rb").read()).call(*x)``)
    or ``"onnx"`` (jax2onnx; checked in onnxruntime).

    ``model_or_workdir``: a run (workdir or checkpoint folder, as :func:`jddp.load` takes it;
    ``step`` picks a checkpoint) or an NNX module. The program is the model in eval mode on the
    arrays it takes: for a run, what its task feeds the model (image classification: the
    normalised images ``[B, H, W, C]`` as ``jddp.load(W)``'s model takes them, not pixels);
    else, or when given, those of ``example``, a batch of the model's inputs (an array:
    ``model(x)``; a tuple: ``model(*x)``; a dict: ``model(**x)``; ``jax.ShapeDtypeStruct``
    leaves will do). ``batch_size``: the batch the program takes (None: any). The export is run
    on random inputs and compared with the model before it is written.
    """
    from jddp.inference import as_model

    run = as_model(model_or_workdir, step)
    if run.model is model_or_workdir:
        if example is None:
            raise TypeError("export: pass example= (a batch of the model's inputs) with a module")
        signature = signature_of_example(run.model, example)
    else:
        signature = run_signature(model_or_workdir, run, example)
    return export_signature(run.model, signature, out, format, batch_size, _single_output(run))


def _single_output(run: Any) -> str:
    return "logits" if run.task == "classification" else "output"


def export_checkpoint(
    path: PathLike,
    step: int | None,
    out: PathLike,
    fmt: str,
    batch_size: int | None = None,
    input_shape: str | None = None,
) -> tuple[Exported, Path, Any]:
    """The CLI's export (:mod:`jddp.export`): checkpoint ``step`` (default: the newest) of the
    run at ``path``; ``input_shape`` (:func:`parse_input_shape`) replaces the inputs the run's
    data would give. Returns what was written, the checkpoint and the
    :class:`~jddp.inference.LoadedRun`."""
    from jddp.checkpoint.weights import find_checkpoint
    from jddp.inference import load_run

    directory, step = find_checkpoint(path, step, "--workdir", "--step")
    example = None if input_shape is None else parse_input_shape(input_shape)
    run = load_run(path, step, key="--workdir", use=lambda s: f"--step {s}")
    signature = run_signature(path, run, example)
    exported = export_signature(run.model, signature, out, fmt, batch_size, _single_output(run))
    return exported, directory / str(step), run


def describe_inputs(exported: Exported, checkpoint: Path, run: Any) -> str:
    """The CLI's report: what was written, the program's inputs and outputs, the check; for
    image classification, how pixels become its inputs."""
    size = exported.nbytes / 2**20
    runner = "onnxruntime" if exported.format == "onnx" else "jax.export.deserialize(...).call"
    lines = [
        f"jddp: exported checkpoint {checkpoint} to {exported.path} ({exported.format}, "
        f"{size:.1f} MiB, {exported.seconds:.1f} s): {', '.join(exported.inputs)} -> "
        f"{', '.join(exported.outputs)}; on random inputs it matches the model within "
        f"{exported.max_abs_diff:.2g} ({runner})"
    ]
    norm = run.pixel_norm
    if run.task == "classification" and norm is not None:
        how = "pixels / 255"
        if norm.mean is not None:
            mean = ", ".join(f"{m:.4g}" for m in norm.mean)
            std = ", ".join(f"{s:.4g}" for s in norm.std)
            how = f"(pixels / 255 - mean) / std per channel, mean=[{mean}], std=[{std}]"
        lines.append(f"jddp: images go in normalised as in training: {how}")
    return "\n".join(lines)
