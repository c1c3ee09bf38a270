"""Facade: one entry point for a model on any mesh (`run`, `runner`, `sxcall`, `gather`) and the
pipelined decoder."""
