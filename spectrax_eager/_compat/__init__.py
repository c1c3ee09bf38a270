"""The spellings and shapes of `spectrax-lib` that this facade also takes: the schedule classes'
arguments, `PartitionAxis` role fields, `Static` / `Opaque` attribute markers. Each is a thin
layer over the core and holds no state; the rest of the facade imports them, never the reverse."""
