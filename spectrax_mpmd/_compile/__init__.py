"""Compile: cell specs, program identity and compile-once, relocation onto other devices,
and where a first call's time goes."""
