"""JAX transforms over functions that take modules: lifting (split the modules out, rebuild
them inside the transform, check and write back what the function changed), `jit`,
autodiff, loops, branches, `vmap`, `remat` and `eval_shape`."""
