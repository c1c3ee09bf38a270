"""`SpxMesh`: the mesh `spx.create_mesh` makes, a `spectrax_mpmd.MpmdMesh` whose `with mesh:`
leaves a pipeline mesh out of JAX's context.

Without a pipeline axis `with mesh:` is `jax.set_mesh(mesh.jax_mesh)`. With one,
the arrays a program handles between pipelined calls (a forward's outputs, the
loss, gradients, the parameters an optimizer step wrote back) live on one
rank's devices, which JAX refuses to combine with a context mesh spanning every
rank. So `with mesh:` of a pipeline mesh clears JAX's context mesh and names the
mesh to the facade alone: `current_mesh()`, the logical rules and the placement
of variables built in the block see it, while JAX code runs on each array where
it lies. Pipelined calls run each stage on its rank's submesh either way.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax

import spectrax_mpmd

from .._scope import ambient


class SpxMesh(spectrax_mpmd.MpmdMesh):
    """A `spectrax_mpmd.MpmdMesh` (`jax_mesh`, `mpmd_axis`, `submesh(rank)`, ...) entered as the
    module docstring says."""

    def __init__(self, jax_mesh: jax.sharding.Mesh, mpmd_axis: str | None = None, _submeshes=()):
        super().__init__(jax_mesh, mpmd_axis, _submeshes)
        self._blocks: list[contextlib.ExitStack] = []  # open `with mesh:` blocks of a pipeline mesh

    @classmethod
    def of(cls, mesh: spectrax_mpmd.MpmdMesh) -> SpxMesh:
        """The `SpxMesh` of a rectangular `spectrax_mpmd` mesh (the same devices and axes)."""
        return cls(mesh.jax_mesh, mesh.mpmd_axis)

    def __enter__(self) -> SpxMesh:
        if not self.is_mpmd:
            return super().__enter__()
        block = contextlib.ExitStack()
        block.enter_context(jax.set_mesh(None))
        block.enter_context(ambient.setting("mesh", self))
        self._blocks.append(block)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.is_mpmd:
            return super().__exit__(*exc)
        self._blocks.pop().__exit__(*exc)
        return None


class MpMdMesh(spectrax_mpmd.MpmdMesh):
    """`spectrax_mpmd.MpmdMesh` built as `spectrax-lib` builds its mesh, `MpMdMesh(jax_mesh,
    mpmd_axis_name)`: a jax mesh and the name of its pipeline axis (`mpmd_axis` here)."""

    def __init__(self, jax_mesh: jax.sharding.Mesh, mpmd_axis_name: str):
        if not isinstance(jax_mesh, jax.sharding.Mesh):
            raise spectrax_mpmd.MeshError(
                f"MpMdMesh: expected a jax.sharding.Mesh, got {type(jax_mesh).__name__}."
            )
        super().__init__(jax_mesh, mpmd_axis_name)
