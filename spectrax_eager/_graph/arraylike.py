"""Array behaviour of a Variable: it reads as its value in arithmetic, NumPy and JAX calls.

`int(opt.step)`, `np.asarray(var)`, `var + 1`, `x @ layer.weight` and `var[0]` work on
the held value and return plain arrays (or Python numbers), never a Variable; equality and
hashing stay the cell's identity, so Variables remain usable as dictionary keys.
"""

from __future__ import annotations

import operator
from typing import Any

import jax.numpy as jnp
import numpy as np


def _binary(op: Any, reflected: bool = False) -> Any:
    if reflected:
        return lambda self, other: op(other, self.value)
    return lambda self, other: op(self.value, other)


class ArrayLike:
    """Mixin: arithmetic, conversions and indexing act on `self.value`."""

    __slots__ = ()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.value, dtype=dtype)

    def __jax_array__(self) -> Any:
        return jnp.asarray(self.value)

    def __int__(self) -> int:
        return int(self.value)

    def __float__(self) -> float:
        return float(self.value)

    def __index__(self) -> int:
        return operator.index(self.value)

    def __getitem__(self, idx: Any) -> Any:
        return self.value[idx]

    def __neg__(self) -> Any:
        return -self.value

    def __pos__(self) -> Any:
        return +self.value

    def __abs__(self) -> Any:
        return abs(self.value)

    __add__, __radd__ = _binary(operator.add), _binary(operator.add, True)
    __sub__, __rsub__ = _binary(operator.sub), _binary(operator.sub, True)
    __mul__, __rmul__ = _binary(operator.mul), _binary(operator.mul, True)
    __truediv__, __rtruediv__ = _binary(operator.truediv), _binary(operator.truediv, True)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv), _binary(operator.floordiv, True)
    __mod__, __rmod__ = _binary(operator.mod), _binary(operator.mod, True)
    __pow__, __rpow__ = _binary(operator.pow), _binary(operator.pow, True)
    __matmul__, __rmatmul__ = _binary(operator.matmul), _binary(operator.matmul, True)
    __lt__, __le__ = _binary(operator.lt), _binary(operator.le)
    __gt__, __ge__ = _binary(operator.gt), _binary(operator.ge)
