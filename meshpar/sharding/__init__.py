"""Sharding: the device mesh, layout rules in logical dim names, the stage axis, host memory
(offload, unified memory), and the one context a model is traced in."""
