"""How pipeline ranks talk: copies inside a process, transports between processes, the
key-value exchange and joining a `jax.distributed` job."""
