"""Trace: markers and regions, argument kinds, jaxpr utilities, the split of a traced function
into a stage graph, and each stage's cell functions."""
