"""`spx.contrib`: the optimizers (also `spx.Optimizer`, ...), under the module name code written
for the seed library imports (`spectrax.contrib`, `spectrax.contrib.optimizer`).

`Optimizer`: optax over the selected variables of a model; `MultiOptimizer`: one optax
transformation per disjoint selection (e.g. a base model and its LoRA adapters).
"""

from .optimizer import MultiOptimizer, Optimizer, OptState

__all__ = ["MultiOptimizer", "Optimizer", "OptState"]
