"""`spx.lazy_init()`: build a model whose lazy parts wait for an explicit `model.init(...)`.

Outside it, a lazy layer (`nn.Linear(None, d)`, `nn.DenseGeneral(features)`, a
`DeferredParameter` its module materializes) creates its arrays on its first
call. Built inside it, that first call is an error until the model is
materialized with example inputs (`model.init(rngs, x)` / `model.sequential_init(x)`),
so the arrays are made at a point the program chooses (e.g. under a mesh),
never by an ordinary forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import ambient


@contextlib.contextmanager
def lazy_init() -> Iterator[None]:
    """Lazy layers built in the block materialize only through `Module.init` / `sequential_init`."""
    with ambient.setting("lazy_init", True):
        yield


def building_lazily() -> bool:
    """Whether a layer built now is under `lazy_init()`."""
    return ambient.current().lazy_init


@contextlib.contextmanager
def materializing() -> Iterator[None]:
    """While `Module.sequential_init` / `materialize` run: lazy parts may create their arrays."""
    with ambient.setting("materializing", True):
        yield


def check_may_materialize(explicit: bool, where: str) -> None:
    """Refuse to create `where`'s arrays when it was built under `lazy_init()` and no
    `Module.init` / `sequential_init` / `materialize` is running."""
    if explicit and not ambient.current().materializing:
        raise RuntimeError(
            f"{where} was built under spx.lazy_init(), so its arrays are made only explicitly: call "
            "model.init(rngs, *example_inputs) or model.sequential_init(*example_inputs) first."
        )
