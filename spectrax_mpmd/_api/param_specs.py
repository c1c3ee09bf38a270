"""A step's differentiated leaves' PartitionSpecs on each rank, under its sharding rules."""

from __future__ import annotations

import jax

from spectrax_core import sharding as core_sharding

from .._trace.args import Signature


def param_specs(rules, mesh, dynamic, sig: Signature, argnums, ranges) -> dict:
    """`(flat leaf index, rank) -> PartitionSpec` of each differentiated argument's leaves under
    `rules`, resolved on each rank's own submesh (ranks may differ in axes and sizes); empty
    without rules (replicated)."""
    if rules is None:
        return {}
    specs = {}
    for k in argnums:
        arg = dynamic[sig.positions.index(k)]
        structure, resolved = jax.tree.structure(arg), {}
        for r in range(mesh.mpmd_dim):
            sub = mesh.submesh(r)
            shape = (sub.axis_names, sub.devices.shape)
            if shape not in resolved:
                resolved[shape] = structure.flatten_up_to(core_sharding.param_specs(arg, rules, mesh=sub))
            specs.update(((a, r), spec) for a, spec in zip(ranges[k], resolved[shape]))
    return specs


def specs_of(step, sig: Signature, kinds) -> dict:
    """`step`'s differentiated leaves' PartitionSpecs per rank under its rules (`param_specs`)."""
    ranges = dict(zip(sig.positions, sig.ranges()))
    dynamic = sig.in_tree.unflatten(sig.leaves)
    return param_specs(step.settings.rules, step.mesh, dynamic, sig, kinds.argnums, ranges)
