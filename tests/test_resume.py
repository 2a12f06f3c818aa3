"""What a resumed run may change (jddp/checkpoint/resume.py), in process: the config a
checkpoint was written under against the config of the run that resumes it."""

import pytest

from jddp import config as config_lib
from jddp.checkpoint.resume import changed_keys, check_resume_config
from jddp.errors import ConfigError


def resolved(*overrides: str) -> dict:
    """A resolved config as a checkpoint saves it (defaults + ``overrides``)."""
    return config_lib.to_dict(config_lib.load(None, list(overrides)))


def test_same_config_resumes():
    check_resume_config(resolved(), resolved(), 4, 10, "runs/a/checkpoints/4")
    check_resume_config(resolved("workdir=runs/a"), resolved("workdir=runs/b"), 4, 10, "ckpt")


def test_free_keys_may_change():
    """Outputs, periods and topology do not change the trajectory: no error."""
    saved = resolved()
    now = resolved(
        "log.every_steps=7",
        "checkpoint.keep=9",
        "dist.backend=mpi",
        "data.workers=2",
        "train.eval_every_steps=3",
        "train.steps=40",  # a longer run
    )
    assert changed_keys(saved, now) == []
    check_resume_config(saved, now, 4, 40, "ckpt")


def test_early_stopping_and_remat_are_no_trajectory_change():
    """Adding early stopping or changing its patience at a resume changes when the run stops,
    not what its steps compute; model.remat recomputes the same activations (the same
    losses): a resume may turn it on or off."""
    saved = resolved("train.eval_every_steps=2")
    now = resolved(
        "train.eval_every_steps=2",
        "train.early_stop_metric=eval/accuracy",
        "train.early_stop_patience=7",
        "train.early_stop_mode=max",
        "train.early_stop_min_delta=0.01",
        "model.remat=blocks",
    )
    assert changed_keys(saved, now) == []
    check_resume_config(saved, now, 4, 10, "ckpt")


def test_trajectory_keys_are_refused_naming_each_key_and_both_values():
    saved = resolved("optim.lr=0.1", "train.seed=0")
    now = resolved("optim.lr=0.2", "train.seed=3")
    assert changed_keys(saved, now) == [("optim.lr", 0.1, 0.2), ("train.seed", 0, 3)]
    with pytest.raises(ConfigError) as e:
        check_resume_config(saved, now, 4, 10, "runs/a/checkpoints/4")
    message = str(e.value)
    assert "checkpoint runs/a/checkpoints/4's" in message
    assert "optim.lr: 0.1 there, 0.2 now; train.seed: 0 there, 3 now" in message
    assert "checkpoint.allow_config_change=true" in message and "--allow-config-change" in message


def test_an_options_key_added_or_removed_is_a_change():
    """model.options/data.options are the user's own keys: one added or removed changes the
    run as a changed value does (it was accepted silently); EMA keys are free (the EMA changes
    none of the parameters)."""
    saved = resolved("model.options.depth=4")
    now = resolved("model.options.depth=4", "model.options.width=8", "train.ema_decay=0.9")
    assert changed_keys(saved, now) == [("model.options.width", "(not set)", 8)]
    gone = resolved("data.options.seq_len=64")
    assert changed_keys(gone, resolved()) == [("data.options.seq_len", 64, "(not set)")]
    with pytest.raises(ConfigError, match=r"data.options.seq_len: 64 there, '\(not set\)' now"):
        check_resume_config(gone, resolved(), 4, 10, "ckpt")


def test_allow_config_change_lets_the_run_continue():
    saved = resolved("optim.lr=0.1")
    now = resolved("optim.lr=0.2", "checkpoint.allow_config_change=true")
    check_resume_config(saved, now, 4, 10, "ckpt")


def test_a_run_may_not_end_before_its_checkpoint():
    """Even with config changes allowed: the checkpoint's step is past the new end."""
    now = resolved("checkpoint.allow_config_change=true")
    with pytest.raises(ConfigError, match=r"train.steps: the run would end at step 3 .* step 5"):
        check_resume_config(resolved(), now, 5, 3, "ckpt")
    check_resume_config(resolved(), now, 5, 5, "ckpt")  # ending at it is fine


def test_keys_an_older_checkpoint_lacks_are_not_compared():
    saved = resolved()
    del saved["train"]["label_smoothing"]
    now = resolved("train.label_smoothing=0.1")
    assert changed_keys(saved, now) == []


_MLP = ["data.global_batch_size=16", "log.progress=off"]


def _mlp_data():
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, 64)


def test_a_resume_with_another_optimizer_says_so(tmp_path):
    import optax
    import pytest
    from flax import nnx

    import jddp
    from tests.user_models import TinyMLP

    """A run saved under adam, rerun with sgd, or with adam at another learning rate: one line
    naming both optimizers (it named '.opt_state[0].count ... .skipped_steps', as if the model
    had changed; a changed learning rate resumed silently). Its config.yaml said so already
    (fit.optimizer)."""
    run = tmp_path / "run"

    def fit(tx, steps):
        jddp.fit(TinyMLP(192, 10, nnx.Rngs(0)), tx, _mlp_data(), config={"workdir": str(run)},
                 overrides=[*_MLP, f"train.steps={steps}"])  # fmt: skip

    fit(optax.adam(0.01), 2)
    with pytest.raises(jddp.ConfigError) as e:
        fit(optax.sgd(0.01), 4)
    # adam's first update of a unit gradient: -lr / (1 + eps)
    assert 'fit.optimizer: "optax ScaleByAdamState+EmptyState, a unit gradient' in str(e.value)
    assert 'update -0.00999993" there, "optax EmptyState+EmptyState, a unit' in str(e.value)
    with pytest.raises(jddp.ConfigError, match=r'-0\.00999993" there, .* -0\.0199999\d*" now'):
        fit(optax.adam(0.02), 4)


def test_a_changed_ema_decay_at_a_resume_is_said(tmp_path, capsys):
    """train.ema_decay changed at a resume goes on from the checkpoint's EMA with the new
    decay, said in one line (it was taken silently); unchanged, nothing is said."""
    from flax import nnx

    import jddp
    from tests.user_models import TinyMLP

    def fit(steps, decay):
        jddp.fit(TinyMLP(192, 10, nnx.Rngs(0)), train_data=_mlp_data(),
                 config={"workdir": str(tmp_path / "run")},
                 overrides=[*_MLP, f"train.steps={steps}", f"train.ema_decay={decay}"])  # fmt: skip
        out = capsys.readouterr().out.splitlines()
        return [line for line in out if line.startswith("jddp: train.ema_decay")]

    assert fit(2, 0.9) == []
    assert fit(4, 0.99) == [
        "jddp: train.ema_decay=0.99 now, 0.9 when the checkpoint was written: the EMA goes on "
        "from the checkpoint's with the new decay"
    ]
    assert fit(6, 0.99) == []
