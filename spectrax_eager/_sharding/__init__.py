"""Logical sharding of arrays: the rules in force (one stack, on the ambient record) and how
annotations resolve, meshes and their axes, `NamedSharding`s fitted to a mesh and a shape, and
constraints and placements by logical axes. Modules are placed by the public `spx.sharding`."""
