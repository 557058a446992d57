"""Host input pipeline: sources → host batches (per process) → feeders that place them.

Never imports meshpar: it is handed a ``NamedSharding`` per batch field and hands back global
``jax.Array``s, so it works under any mesh and layout.
"""
