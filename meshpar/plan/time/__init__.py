"""The planner's time model: a compiled step's time on a topology, from its FLOPs, bytes, kernels
and collectives; the feed's time routed vs direct."""
