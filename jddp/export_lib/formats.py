"""The export formats: StableHLO (``jax.export``) and ONNX (jax2onnx), each written from a
pure function of arrays and run back for the check.

StableHLO: lowered for :data:`PLATFORMS`, serialized; ``jax.export.deserialize(b).call(*x)``
runs it. ONNX: the function is traced to a jaxpr first and jax2onnx converts that jaxpr's
primitives: given a Flax NNX module, its own Conv and BatchNorm plugins mix NHWC and NCHW on a
ResNet and onnxruntime refuses the graph ("Node (node_Add_35) Op (Add) [ShapeInferenceError]
Incompatible dimensions"); pooling windows and selections of booleans are rewritten into
what onnxruntime runs (:func:`_evaluate`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jddp.errors import ExportError, one_line

FORMATS = ("stablehlo", "onnx")
PLATFORMS = ("cpu", "cuda")  # what a StableHLO export is lowered for
# onnxruntime >= 1.20 (pyproject's ``export`` extra) runs opset 21.
ONNX_OPSET = 21


def to_stablehlo(program: Callable, specs: Sequence[jax.ShapeDtypeStruct]) -> bytes:
    """``program`` exported with ``jax.export`` for :data:`PLATFORMS`, serialized (as bytes:
    jax gives a bytearray)."""
    return bytes(jax.export.export(jax.jit(program), platforms=PLATFORMS)(*specs).serialize())


def run_stablehlo(data: bytes, arrays: Sequence[Any]) -> list[np.ndarray]:
    """The outputs (flattened) of a serialized StableHLO export on ``arrays``."""
    # jax annotates a bytearray; it reads bytes as well (a file's, as the README's call does)
    exported = jax.export.deserialize(data)  # type: ignore[arg-type]
    return [np.asarray(y) for y in jax.tree.leaves(exported.call(*arrays))]


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


def with_onnx_metadata(data: bytes, metadata: dict[str, str]) -> bytes:
    """The serialized ONNX model ``data`` with ``metadata`` added to its ``metadata_props``
    (what onnxruntime's ``get_modelmeta().custom_metadata_map`` returns)."""
    import onnx

    proto = onnx.load_from_string(data)
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)
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
    inference does not need) are inlined, windows of :data:`_WINDOWED` primitives over at most
    two axes run over those axes alone (the others flattened into one: :func:`_narrow_window`),
    and booleans are selected as bytes."""
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
        elif name == "select_n" and values[1].dtype == np.bool_:
            # onnxruntime has no Where of booleans (a causal mask's jnp.where): select bytes.
            cases = [jax.lax.convert_element_type(c, np.uint8) for c in values[1:]]
            outs = [jax.lax.select_n(values[0], *cases).astype(np.bool_)]
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
