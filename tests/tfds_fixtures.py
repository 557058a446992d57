"""Builds tiny TFDS datasets offline, in array_record format, for tests.

How this works without TensorFlow (tfds 4.9.10):
  * A real `tfds.core.GeneratorBasedBuilder` runs `download_and_prepare` with
    `file_format="array_record"`. Writing, shuffling and serializing examples
    (tfds's own proto serializer) are pure Python + array_record; nothing
    there imports TF, and GCS access is off by default, so no network either.
  * The one TF dependency on the write path is `tfds.features.Image` encoding
    a *numpy* image (it calls `tf.image.encode_png`). We therefore yield
    `PIL.Image` objects, which tfds encodes with PIL's PNG writer instead.
    Reading back needs PIL (or OpenCV) anyway: that is how tfds decodes images
    in `tfds.data_source`.
  * `_info` builds `tfds.core.DatasetInfo(builder=self, ...)` directly:
    `dataset_info_from_configs` would look for metadata files next to the
    module defining the class, which these dynamic classes do not have.
  * `disable_shuffling=True` keeps records in key order (0..n-1), so row `i`
    of a split equals row `i` of `digits_rows` / `text_rows` below.

Registration: tfds registers every builder subclass by name at class creation
and raises "already registered" on a second class of the same name (e.g. this
module imported twice, or two tests building `tiny_digits` in two dirs). The
classes are created per call with `skip_registration=True`, so nothing enters
the registry and nothing can clash. It also means `tfds.data_source` reads them
back through the file-based path (dataset_info.json + features.json), exactly
as production does for a data_dir prepared elsewhere.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

IMAGE_SHAPE = (8, 8, 1)
NUM_CLASSES = 10
_SEEDS = {"train": 0, "test": 1}

_WORDS = ["the", "cat", "sat", "on", "a", "mat", "héllo", "wörld", "日本", "x"]


def digits_rows(split: str, num: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact (images uint8 [num,8,8,1], labels int64 [num]) of a split."""
    rng = np.random.default_rng(_SEEDS[split])
    images = rng.integers(0, 256, size=(num, *IMAGE_SHAPE), dtype=np.uint8)
    labels = rng.integers(0, NUM_CLASSES, size=(num,), dtype=np.int64)
    return images, labels


def text_rows(split: str, num: int) -> tuple[list[str], np.ndarray]:
    """The exact (texts, labels int64 [num]) of a text split (incl. non-ASCII)."""
    rng = np.random.default_rng(100 + _SEEDS[split])
    texts = [" ".join(rng.choice(_WORDS, size=int(rng.integers(1, 6)))) for _ in range(num)]
    labels = rng.integers(0, 2, size=(num,), dtype=np.int64)
    return texts, labels


def _make_builder(dataset_name, features_fn, examples_fn, split_sizes):
    class _TinyBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = dataset_name
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=features_fn(), disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {s: self._generate_examples(s, n) for s, n in split_sizes.items()}

        def _generate_examples(self, split, num):
            yield from enumerate(examples_fn(split, num))

    return _TinyBuilder


def _prepare(builder_cls, data_dir: str) -> None:
    tfds.disable_progress_bar()  # test logs stay readable; harmless elsewhere
    builder = builder_cls(data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig())


def build_tiny_dataset(data_dir: str, name: str = "tiny_digits", num_train: int = 64, num_test: int = 32) -> None:
    """image (8x8x1 uint8 PNG) + label (ClassLabel, 10) in data_dir/name/1.0.0."""
    from PIL import Image  # tfds encodes PIL images without TF (see top)

    def features():
        return tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=IMAGE_SHAPE),
                "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
            }
        )

    def examples(split, num):
        images, labels = digits_rows(split, num)
        for img, label in zip(images, labels):
            yield {"image": Image.fromarray(img[:, :, 0], mode="L"), "label": int(label)}

    sizes = {"train": num_train, "test": num_test}
    _prepare(_make_builder(name, features, examples, sizes), data_dir)


def build_tiny_text_dataset(data_dir: str, name: str = "tiny_text", num_train: int = 48, num_test: int = 16) -> None:
    """text (tfds Text, UTF-8) + label (ClassLabel, 2) in data_dir/name/1.0.0."""

    def features():
        return tfds.features.FeaturesDict(
            {
                "text": tfds.features.Text(),
                "label": tfds.features.ClassLabel(num_classes=2),
            }
        )

    def examples(split, num):
        texts, labels = text_rows(split, num)
        for text, label in zip(texts, labels):
            yield {"text": text, "label": int(label)}

    sizes = {"train": num_train, "test": num_test}
    _prepare(_make_builder(name, features, examples, sizes), data_dir)
