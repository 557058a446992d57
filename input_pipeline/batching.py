"""Host batching: a deterministic sequence of global batches, read per process.

Batch ``step`` is a pure function of ``(seed, step)``: epoch ``e`` visits the source in the
order of a permutation seeded by ``(seed, e)``, and each batch is the next ``batch_size``
rows of it (the tail that does not fill a batch is dropped). Resuming at step ``s`` therefore
needs nothing but ``s``. Each process reads only ``rows`` of every global batch: the rows its
own devices hold, so a multi-host run never reads a row twice.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from input_pipeline.errors import DataError


class HostLoader:
    def __init__(self, source, batch_size: int, seed: int, rows: slice | None = None, shuffle: bool = True):
        if len(source) < batch_size:
            raise DataError(f"split has {len(source)} examples, fewer than one batch of {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.rows = rows if rows is not None else slice(0, batch_size)
        self.shuffle = shuffle
        self.batches_per_epoch = len(source) // batch_size
        self._epoch, self._order = -1, np.arange(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            n = len(self.source)
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(n) if self.shuffle else np.arange(n)
        return self._order

    def indices(self, step: int) -> np.ndarray:
        """Source indices of this process's rows of global batch `step`."""
        epoch, i = divmod(step, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        return order[i * self.batch_size : (i + 1) * self.batch_size][self.rows]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`: ``{field: [rows, ...]}``."""
        return self.source.read(self.indices(step))

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        step = start
        while stop is None or step < stop:
            yield self.batch(step)
            step += 1
