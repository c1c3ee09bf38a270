"""Pipelined generation: per-stage programs, their placement, and the wavefront that issues them."""
