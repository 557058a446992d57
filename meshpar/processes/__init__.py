"""Processes of a multi-process run: starting together on ``jax.distributed``, stopping together,
and naming a lost peer in one line."""
