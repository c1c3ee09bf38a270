"""What `with` blocks set for the code they call, kept in one record (`ambient`), and the
settings built on it: policies, lazy initialization, init placement, `spx.scope` values."""
