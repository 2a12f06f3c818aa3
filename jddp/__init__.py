"""jddp: a JAX data-parallel trainer for Flax NNX models.

The few public names: :func:`fit` and :func:`initialize` to train your own model, loss and data;
:func:`load`, :func:`predict`, :func:`class_names` and :func:`evaluate` to use a trained model,
:func:`export` to write it for inference (StableHLO or ONNX);
:func:`load_pretrained` for torchvision/timm ResNet weights;
the building blocks :func:`make_mesh`, :func:`create_train_state`, :func:`make_train_step`,
:func:`make_eval_step`; :class:`Metric` (a metric that is a sum, max or min); the models in
:mod:`jddp.models`; :class:`Config` and :func:`load_config`. Imports are lazy so
``python -m jddp.train --help`` stays fast;
``_EXPORTS`` maps a name to ``"module"`` (the same name there) or ``"module:attribute"``.
This module imports nothing that takes time (not even ``typing``): ``python -m jddp.evaluate``
runs it before the command's own first statement, which installs the Ctrl-C handler.
"""

from __future__ import annotations

import importlib  # already loaded by Python's start-up: nothing here may take time (see below)

__version__ = "0.1.0"

_EXPORTS = {
    "fit": "jddp.api",
    "initialize": "jddp.api",
    "load_config": "jddp.api",
    "as_source": "jddp.api",
    "load": "jddp.inference",
    "evaluate": "jddp.eval_lib:evaluate_model",
    "predict": "jddp.inference",
    "class_names": "jddp.inference",
    "export": "jddp.export_lib:export_model",
    "load_pretrained": "jddp.checkpoint.pretrained",
    "RunResult": "jddp.run.trainer",
    "Callback": "jddp.run.callbacks",
    "EarlyStopping": "jddp.run.callbacks",
    "Metric": "jddp.weighted",
    "Config": "jddp.config",
    "ConfigError": "jddp.config",
    "make_mesh": "jddp.mesh",
    "create_train_state": "jddp.state",
    "TrainState": "jddp.state",
    "make_train_step": "jddp.step",
    "make_eval_step": "jddp.step",
    "cross_entropy_loss": "jddp.tasks.classification",
    "Comm": "jddp.comm",
    "XlaComm": "jddp.comm",
    "MpiComm": "jddp.comm",
    "build_steps": "jddp.build",
    "models": "jddp.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # no "-> Any": that would import typing
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jddp' has no attribute {name!r}")
    module_name, _, attribute = _EXPORTS[name].partition(":")
    module = importlib.import_module(module_name)
    if name == "models":
        return module
    # ``jddp.evaluate`` and ``jddp.export`` are the library calls; ``python -m jddp.evaluate``
    # and ``python -m jddp.export`` run the CLI modules of those names (runpy does not bind them).
    return getattr(module, attribute or name)
