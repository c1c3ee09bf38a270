"""Pipelining an eager model: `spx.run` (its cache key, stream counters and optimizer step),
where a model's stages begin and end, `sxcall` and the entry points, checkpoints, and making
meshes. The only part of the facade that imports `spectrax_mpmd`, always inside a function
(`mpmd.mpmd()` for the rest of the facade)."""
