"""A user model factory for the ``model.name="pkg.module:factory"`` CLI path (used by tests)."""

from flax import nnx


class TinyMLP(nnx.Module):
    """No BatchNorm, no mutable state: flatten, one hidden layer."""

    def __init__(self, in_features: int, num_classes: int, rngs: nnx.Rngs, dtype=None):
        self.hidden = nnx.Linear(in_features, 32, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(32, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def tiny_mlp(config: dict, dtype, rngs: nnx.Rngs) -> TinyMLP:
    """Factory: receives the config's model section, the compute dtype and an nnx.Rngs."""
    return TinyMLP(8 * 8 * 3, config["num_classes"], rngs, dtype=dtype)
