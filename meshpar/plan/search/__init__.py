"""The layout search: every legal mesh and layout of a config's devices that fits, ranked by
predicted step time."""
