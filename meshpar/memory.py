"""Per-device memory figures, always labelled with their source.

- ``live_buffers``: every backend. The feeder counts each device array it creates (placed
  batch shards, the routed relay's staging copy, the routed path's temporary slices) when it
  is created and uncounts it when it is released, per buffer, and keeps the running
  per-device peak (:class:`input_pipeline.feeding.LiveBytes`; ``Feeder.memory_report()``).
  These are the inputs held on each device: the batch in use, prefetched ones, the relay's
  staging copy. On CPU a "device" buffer may alias host memory (see input_pipeline.feeding),
  so these are the arrays' sizes, not the process's resident memory.
- ``memory_stats``: where the backend reports it (GPU): ``peak_bytes_in_use`` per device,
  which covers everything the device held (state, activations, inputs), since process start.

The reader lives with the feeder (the input pipeline never imports meshpar); it is named
here too because it is meshpar's figure as much as the pipeline's.
"""

from __future__ import annotations

from input_pipeline.feeding import memory_stats_peak

__all__ = ["memory_stats_peak"]
