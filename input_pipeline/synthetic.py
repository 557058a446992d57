"""A seeded classification task a model can actually learn.

Inputs are Gaussian; labels come from a fixed random teacher network
(``argmax(tanh(x @ W1) @ W2)``), so the task is deterministic, has structure to learn, and is
not linearly trivial. All rows are generated up front (a few tens of MB), which keeps reads
random-access like every other source.
"""

from __future__ import annotations

import numpy as np

TEACHER_WIDTH = 64


class SyntheticSource:
    def __init__(self, num_examples: int, num_features: int, num_classes: int, seed: int, split: str = "train"):
        # The teacher depends on the seed only, so train and eval splits share it; the inputs
        # use a per-split stream so the splits never overlap.
        teacher = np.random.default_rng([seed, 0])
        w1 = teacher.standard_normal((num_features, TEACHER_WIDTH), np.float32) / np.sqrt(num_features)
        w2 = teacher.standard_normal((TEACHER_WIDTH, num_classes), np.float32) / np.sqrt(TEACHER_WIDTH)
        stream = {"train": 1, "eval": 2}[split]
        rows = np.random.default_rng([seed, stream])
        self.inputs = rows.standard_normal((num_examples, num_features), np.float32)
        self.targets = np.argmax(np.tanh(self.inputs @ w1) @ w2, axis=-1).astype(np.int32)
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"inputs": (self.inputs.shape[1:], self.inputs.dtype), "targets": ((), self.targets.dtype)}

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"inputs": self.inputs[indices], "targets": self.targets[indices]}

    def read_into(self, indices: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """`read` into preallocated arrays (the loader's reused host buffers)."""
        np.take(self.inputs, indices, axis=0, out=out["inputs"])
        np.take(self.targets, indices, axis=0, out=out["targets"])
