"""Processes of a multi-process run: joining on ``jax.distributed`` (:mod:`.joining`), agreeing
on the pre-flight's figures (:mod:`.agreement`), stopping together and naming a lost peer in one
line (:mod:`.together`, :mod:`.liveness`), stopping at a step on a signal (:mod:`.stop`)."""
