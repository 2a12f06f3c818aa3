"""Export a trained model for inference: StableHLO (``jax.export``) or ONNX (jax2onnx).

What is exported is the model as :func:`jddp.load` returns it, in eval mode (BatchNorm uses its
running statistics, dropout is off), as one program of the arrays it takes
(:mod:`jddp.export_lib.inputs`), written in one of the formats of
:mod:`jddp.export_lib.formats`: the weights are constants, the batch axis is symbolic
(``batch``: any size) unless a fixed size is asked for. Each export is run once on random inputs
and compared with the model in JAX before it is written, whole or not at all.

The CLI is :mod:`jddp.export`; the library call ``jddp.export`` is :func:`export_model`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jddp.errors import ConfigError, ExportError, JddpError, one_line
from jddp.export_lib.formats import (
    FORMATS,
    run_onnx,
    run_stablehlo,
    to_onnx,
    to_stablehlo,
    with_onnx_metadata,
)
from jddp.export_lib.inputs import (
    Input,
    PathLike,
    Signature,
    key_name,
    parse_input_shape,
    run_signature,
    signature_of_example,
)

BATCH = "batch"  # the symbolic batch dimension's name (ONNX: the dim_param)
CHECK_ROWS = 3  # examples of the check run (a dynamic batch); not 1: a batch of 1 broadcasts

__all__ = ["ExportError", "Exported", "export_checkpoint", "export_model", "export_signature"]


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
    convolution's input on XLA:CPU to speed up training's weight gradients; an export traced on
    a CPU would carry that to every platform (:func:`jddp.models.resnet.plain_convolutions`,
    beside the workaround). The values are the same."""
    from jddp.models.resnet import plain_convolutions

    module.eval()
    return plain_convolutions(module)


def _describe(name: str, spec: Any) -> str:
    dims = ",".join(str(d) for d in spec.shape)
    return f"{name} {np.dtype(spec.dtype).name}[{dims}]"


def _output_names(outputs: Any, single: str) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(outputs)
    if len(flat) == 1 and not flat[0][0]:
        return [single]
    return [".".join(["output", *(key_name(k) for k in path)]) for path, _ in flat]


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
    metadata: dict[str, str] | None = None,
) -> Exported:
    """Export ``model`` (eval mode) called as ``signature`` says to ``out`` in format ``fmt``
    with a batch of ``batch_size`` examples (None: any). The export is run on random inputs and
    compared with the model first (:class:`ExportError` when it differs, or when the converter
    cannot express the model); ``out`` is written whole or not at all. ``metadata``: ONNX
    ``metadata_props`` (a run's class names, :func:`run_metadata`; StableHLO has no place for
    them)."""
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
    # onnxruntime computes on the CPU: so does the model it is compared with (a GPU's float32
    # convolutions may round their inputs to TF32, 1e-3 apart).
    where = jax.devices("cpu")[0] if fmt == "onnx" else None
    with jax.default_device(where):
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
    if fmt == "onnx" and metadata:
        data = with_onnx_metadata(data, metadata)
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


def export_model(
    model_or_workdir: nnx.Module | PathLike,
    out: PathLike,
    format: str = "stablehlo",  # noqa: A002 - the CLI's --format
    *,
    batch_size: int | None = None,
    step: int | str | None = None,
    example: Any = None,
    ema: bool = False,
    trust_code: bool = False,
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
    on random inputs and compared with the model before it is written. ``ema``: a run's
    parameters' moving average (``train.ema_decay``) in place of them. ``trust_code``: a run's
    config may name the code that builds its model, data or task (``pkg.module:factory``),
    imported only then (see :func:`jddp.load`).
    """
    from jddp.inference import as_model

    run = as_model(model_or_workdir, step, ema, trust_code)
    if run.model is model_or_workdir:
        if example is None:
            raise TypeError("export: pass example= (a batch of the model's inputs) with a module")
        signature = signature_of_example(run.model, example)
    else:
        assert not isinstance(model_or_workdir, nnx.Module)  # as_model returns a module as is
        signature = run_signature(model_or_workdir, run, example, trust_code)
    return export_signature(
        run.model, signature, out, format, batch_size, _single_output(run), run_metadata(run)
    )


def run_metadata(run: Any) -> dict[str, str]:
    """What an ONNX export of a run records beside the program: ``jddp.classes``, the class
    names of its train data as a JSON list (output ``k`` is the ``k``-th), where it named
    them."""
    classes = getattr(run, "classes", None)
    return {} if not classes else {"jddp.classes": json.dumps(classes)}


def _single_output(run: Any) -> str:
    return "logits" if run.task == "classification" else "output"


def export_checkpoint(
    path: PathLike,
    step: int | str | None,
    out: PathLike,
    fmt: str,
    batch_size: int | None = None,
    input_shape: str | None = None,
    ema: bool = False,
    trust_code: bool = False,
) -> tuple[Exported, Path, Any]:
    """The CLI's export (:mod:`jddp.export`): checkpoint ``step`` (default: the newest) of the
    run at ``path``; ``input_shape`` (:func:`parse_input_shape`) replaces the inputs the run's
    data would give; ``trust_code``: the run's config may name code to import (``--trust-code``).
    Returns what was written, the checkpoint and the :class:`~jddp.inference.LoadedRun`."""
    from jddp.checkpoint.find import find_checkpoint
    from jddp.inference import load_run

    directory, step = find_checkpoint(path, step, "--workdir", "--step")
    example = None if input_shape is None else parse_input_shape(input_shape)
    run = load_run(
        path, step, key="--workdir", use=lambda s: f"--step {s}", ema=ema, trust_code=trust_code
    )
    signature = run_signature(path, run, example, trust_code)
    exported = export_signature(
        run.model, signature, out, fmt, batch_size, _single_output(run), run_metadata(run)
    )
    return exported, directory / str(step), run


def describe_inputs(exported: Exported, checkpoint: Path, run: Any) -> str:
    """The CLI's report: what was written, the program's inputs and outputs, the check; for
    image classification, how pixels become its inputs."""
    kib = exported.nbytes / 1024
    size = f"{kib / 1024:.1f} MiB" if kib >= 1024 else f"{kib:.0f} KiB"
    runner = "onnxruntime" if exported.format == "onnx" else "jax.export.deserialize(...).call"
    lines = [
        f"jddp: exported checkpoint {checkpoint} to {exported.path} ({exported.format}, "
        f"{size}, {exported.seconds:.1f} s): {', '.join(exported.inputs)} -> "
        f"{', '.join(exported.outputs)}; on random inputs it matches the model within "
        f"{exported.max_abs_diff:.2g} ({runner})"
    ]
    norm = run.pixel_norm
    if run.task == "classification" and norm is not None:
        how = "pixels / 255"
        if norm.mean is not None:
            mean = ", ".join(f"{m:.7g}" for m in norm.mean)  # float32's digits
            std = ", ".join(f"{s:.7g}" for s in norm.std)
            how = f"(pixels / 255 - mean) / std per channel, mean=[{mean}], std=[{std}]"
        lines.append(f"jddp: images go in normalised as in training: {how}")
    if run.classes:
        kept = " (in the ONNX metadata as jddp.classes)" if exported.format == "onnx" else ""
        lines.append(f"jddp: outputs are the classes, in order: {', '.join(run.classes)}{kept}")
    return "\n".join(lines)
