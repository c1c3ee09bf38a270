"""Checkpoints: the orbax manager, layout-independent array names, restore targets and checksums."""
