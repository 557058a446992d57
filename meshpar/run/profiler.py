"""A ``jax.profiler`` trace of a stretch of train steps (``train.profile``).

The trace covers steps ``start .. start + steps - 1`` (numbered as in metrics.jsonl) and
nothing else of training: the loop waits for step ``start - 1`` before the trace starts and
for the last traced step before it stops (the only extra waits profiling adds), so no other
step runs inside it. Written under ``<workdir>/profile`` (``profile/process_<i>`` per process
of a multi-process run): ``plugins/profile/<time>/<host>.xplane.pb``, which TensorBoard's
profile plugin reads (``tensorboard --logdir <workdir>/profile``), and
``perfetto_trace.json.gz`` beside it, for https://ui.perfetto.dev.
"""

from __future__ import annotations

import pathlib

import jax

from meshpar.configuration.errors import OutputError


class StepTrace:
    def __init__(self, cfg, workdir: str | pathlib.Path):
        """`cfg`: a ``ProfileConfig`` (``steps`` 0 = no trace)."""
        self.first, self.last = cfg.start, cfg.start + cfg.steps - 1
        self.enabled = cfg.steps > 0
        folder = pathlib.Path(workdir) / "profile"
        self.dir = folder if jax.process_count() == 1 else folder / f"process_{jax.process_index()}"
        self.active = False

    def syncs(self, step: int) -> bool:
        """Whether the loop must wait for `step` before going on: the step before the trace
        and the trace's last step."""
        return self.enabled and step in (self.first - 1, self.last)

    def before(self, step: int, state) -> None:
        """Called before `step` is dispatched with the `state` it will take: starts the trace
        at its first step (or at the first step of a run resumed inside the stretch), once the
        step before has finished on every device (its loss may be ready before the rest)."""
        if self.enabled and not self.active and self.first <= step <= self.last:
            jax.block_until_ready(state)
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise OutputError(f"cannot write {self.dir}: {e.strerror or e}") from None
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, state) -> None:
        """Called once `step`'s results are on the host, with the state it returned (None if
        already donated): stops the trace after its last step, once that step has finished."""
        if self.active and step >= self.last:
            if state is not None:
                jax.block_until_ready(state)
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()  # a run that ends inside the stretch (an error, a stop signal) still writes it
