"""`spx.contrib`: the optimizers, under the module name code written for the seed library imports."""

from ._optimizer import MultiOptimizer, Optimizer

__all__ = ["MultiOptimizer", "Optimizer"]
