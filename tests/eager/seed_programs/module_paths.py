"""The seed library's deeper module paths, imported as its programs import them: the schedules
and DualPipeV's fused tasks from `runtime.schedules`, an abstract per-rank array from
`runtime.types.array`, the regions of a jaxpr from `runtime.mpmd.markers`, and a model built,
exported, jitted and optimized through `nn.linear`, `core.graph`, `transforms.jit`, `rng.rngs`,
`contrib.optimizer`, `functional.activation` and `init.xavier`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from spectrax.contrib.optimizer import Optimizer
from spectrax.core.graph import export
from spectrax.core.module import Module
from spectrax.functional.activation import gelu
from spectrax.init.xavier import xavier_uniform
from spectrax.nn.linear import Linear
from spectrax.rng.rngs import Rngs
from spectrax.runtime.mpmd.markers import stage_region_specs, sxstage_region
from spectrax.runtime.schedules import DualPipeV, FusedTask, GPipe, dualpipev_tasks
from spectrax.runtime.types.array import abstract_stages_array
from spectrax.transforms.grad import value_and_grad
from spectrax.transforms.jit import jit


class Net(Module):
    def __init__(self, rngs):
        super().__init__()
        self.fc = Linear(4, 3, w_init=xavier_uniform(), rngs=rngs)

    def forward(self, x):
        return gelu(self.fc(x))


tasks = dualpipev_tasks(2, 0, 4)
zeros = abstract_stages_array((2, 3), jnp.float32, [2, 0])


def tower(x):
    return jnp.tanh(x) * 2


def loss(x):
    return jnp.sum(sxstage_region("tower", schedule=GPipe(2))(tower)(x))


regions = stage_region_specs(jax.make_jaxpr(loss)(jnp.ones(3)).jaxpr)
net = Net(Rngs(0))
x = jnp.asarray(np.linspace(-1.0, 1.0, 8).reshape(2, 4), jnp.float32)
opt = Optimizer.create(net, optax.sgd(0.1), wrt="parameters")
step_loss = jit(lambda m, x: value_and_grad(lambda m: jnp.sum(m(x) ** 2))(m))
value, grads = step_loss(net, x)
print(
    json.dumps(
        {
            "schedule": type(DualPipeV(4)).__name__,
            "tasks": len(tasks),
            "fused": sum(isinstance(t, FusedTask) for t in tasks),
            "zeros": [sorted(zeros.mpmd_idxs), list(zeros.shape)],
            "regions": sorted({spec.name for spec in regions}),
            "state_entries": len(list(export(net)[1].items())),
            "output_shape": list(net(x).shape),
            "grad_leaves": len(jax.tree.leaves(grads)),
            "optimizer": type(opt).__name__,
            "loss_finite": bool(jnp.isfinite(value)),
        }
    )
)
