"""TfdsSource against tiny array_record datasets built offline (no TF)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from input_pipeline.tfds_source import DataError, TfdsSource

try:  # works whether or not tests/ is a package on sys.path
    from tests import tfds_fixtures as fx
except ImportError:  # pragma: no cover
    import tfds_fixtures as fx

NUM_TRAIN, NUM_TEST = 64, 32
NUM_TEXT_TRAIN = 48
DIGITS = {"inputs": "image", "targets": "label"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tfds"))
    fx.build_tiny_dataset(d, num_train=NUM_TRAIN, num_test=NUM_TEST)
    fx.build_tiny_text_dataset(d, num_train=NUM_TEXT_TRAIN)
    os.makedirs(os.path.join(d, "ghost"))  # a dir that is not a tfds dataset
    return d


@pytest.fixture(scope="module")
def train(data_dir) -> TfdsSource:
    return TfdsSource("tiny_digits", "train", data_dir, DIGITS)


def _expected(split: str, num: int, idx):
    images, labels = fx.digits_rows(split, num)
    flat = images.reshape(num, -1).astype(np.float32) / np.float32(255.0)
    return flat[idx], labels[idx].astype(np.int32)


def test_len_and_element_spec(data_dir, train):
    assert len(train) == NUM_TRAIN
    assert len(TfdsSource("tiny_digits", "test", data_dir, DIGITS)) == NUM_TEST
    assert train.element_spec == {
        "inputs": ((64,), np.dtype(np.float32)),
        "targets": ((), np.dtype(np.int32)),
    }


def test_read_arbitrary_order_with_duplicates(train):
    idx = np.array([5, 0, 63, 5, 17, 1])
    batch = train.read(idx)
    assert set(batch) == {"inputs", "targets"}
    want_x, want_y = _expected("train", NUM_TRAIN, idx)
    assert batch["inputs"].dtype == np.float32 and batch["inputs"].shape == (6, 64)
    assert batch["targets"].dtype == np.int32 and batch["targets"].shape == (6,)
    np.testing.assert_array_equal(batch["inputs"], want_x)
    np.testing.assert_array_equal(batch["targets"], want_y)


@pytest.mark.parametrize("split,num", [("train", NUM_TRAIN), ("test", NUM_TEST)])
def test_every_row_matches_generated_data(data_dir, split, num):
    src = TfdsSource("tiny_digits", split, data_dir, DIGITS)
    idx = np.random.default_rng(7).permutation(num)
    batch = src.read(idx)
    want_x, want_y = _expected(split, num, idx)
    np.testing.assert_array_equal(batch["inputs"], want_x)
    np.testing.assert_array_equal(batch["targets"], want_y)


def test_image_scaling_is_exact_uint8_over_255(train):
    x = train.read(np.arange(NUM_TRAIN))["inputs"]
    assert 0.0 <= x.min() and x.max() <= 1.0
    raw, _ = fx.digits_rows("train", NUM_TRAIN)
    np.testing.assert_array_equal(np.rint(x * 255).astype(np.uint8), raw.reshape(NUM_TRAIN, -1))


def test_split_slice_and_extra_field_name(data_dir):
    src = TfdsSource("tiny_digits", "train[10:20]", data_dir, {"y": "label", "pixels": "image"})
    assert len(src) == 10
    batch = src.read(np.array([0, 9]))
    want_x, want_y = _expected("train", NUM_TRAIN, [10, 19])
    np.testing.assert_array_equal(batch["pixels"], want_x)
    np.testing.assert_array_equal(batch["y"], want_y)


def test_empty_and_bad_indices(train):
    empty = train.read(np.array([], dtype=np.int64))
    assert empty["inputs"].shape == (0, 64) and empty["inputs"].dtype == np.float32
    assert empty["targets"].shape == (0,) and empty["targets"].dtype == np.int32
    with pytest.raises(IndexError):
        train.read(np.array([0, NUM_TRAIN]))
    with pytest.raises(IndexError):
        train.read(np.array([-1]))


def test_text_field_is_bytes_object_array(data_dir):
    src = TfdsSource("tiny_text", "train", data_dir, {"text": "text", "label": "label"})
    assert len(src) == NUM_TEXT_TRAIN
    assert src.element_spec == {
        "text": ((), np.dtype(object)),
        "label": ((), np.dtype(np.int32)),
    }
    idx = np.array([3, 0, 47, 3])
    batch = src.read(idx)
    texts, labels = fx.text_rows("train", NUM_TEXT_TRAIN)
    assert batch["text"].dtype == object and batch["text"].shape == (4,)
    assert all(isinstance(t, bytes) for t in batch["text"])
    assert list(batch["text"]) == [texts[i].encode("utf-8") for i in idx]
    assert any(ord(c) > 127 for t in texts for c in t)  # UTF-8 really exercised
    np.testing.assert_array_equal(batch["label"], labels[idx].astype(np.int32))


def test_rebuilding_same_name_elsewhere_does_not_clash(tmp_path):
    # Builder classes are never put in tfds's registry, so a second build of
    # the same dataset name in the same process must not raise.
    fx.build_tiny_dataset(str(tmp_path), num_train=4, num_test=2)
    src = TfdsSource("tiny_digits", "test", str(tmp_path), DIGITS)
    assert len(src) == 2


def _err(data_dir, name="tiny_digits", split="train", fields=DIGITS) -> str:
    with pytest.raises(DataError) as info:
        TfdsSource(name, split, data_dir, fields)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in msg, msg
    assert info.value.__traceback__ is not None
    return msg


def test_error_missing_data_dir(tmp_path):
    missing = str(tmp_path / "nope")
    msg = _err(missing)
    assert missing in msg and "data_dir" in msg


def test_error_dataset_not_in_data_dir(data_dir):
    msg = _err(data_dir, name="no_such_set")
    assert "no_such_set" in msg and data_dir in msg
    assert "tiny_digits" in msg  # lists what is there


def test_error_dataset_name_known_to_tfds_but_absent(data_dir):
    # "mnist" has code in tfds; it must still fail as not found, offline.
    msg = _err(data_dir, name="mnist")
    assert "mnist" in msg and data_dir in msg


def test_error_dir_that_is_not_a_dataset(data_dir):
    msg = _err(data_dir, name="ghost")
    assert "ghost" in msg and data_dir in msg


def test_error_version_not_present(data_dir):
    msg = _err(data_dir, name="tiny_digits:9.9.9")
    assert "tiny_digits:9.9.9" in msg and "1.0.0" in msg  # says what is there


def test_error_prepared_in_non_random_access_format(tmp_path):
    # Same files, but dataset_info.json claims tfrecord: no random access.
    fx.build_tiny_dataset(str(tmp_path), num_train=4, num_test=2)
    info = tmp_path / "tiny_digits" / "1.0.0" / "dataset_info.json"
    meta = json.loads(info.read_text())
    meta["fileFormat"] = "tfrecord"
    info.write_text(json.dumps(meta))
    msg = _err(str(tmp_path))
    assert "array_record" in msg and "tiny_digits" in msg


def test_error_missing_split(data_dir):
    msg = _err(data_dir, split="validation")
    assert "validation" in msg and "train" in msg and "test" in msg


@pytest.mark.parametrize("split", ["train[:0]", "test[32:]"])
def test_error_empty_split(data_dir, split):
    msg = _err(data_dir, split=split)
    assert split in msg and "empty" in msg


def test_error_missing_feature_key(data_dir):
    msg = _err(data_dir, fields={"inputs": "pixels", "targets": "label"})
    assert "pixels" in msg and "image" in msg and "label" in msg


# ----------------------------------------------------------------------------------------------
# Error lines say what was looked up and where, and show folders inside data_dir only.

NOT_A_NAME = "is not a tfds dataset name: expected NAME[/CONFIG][:VERSION], e.g. mnist or mnist:3.0.1"
A_PATH = "; a dataset name is not a path: the folder that holds the datasets is data.data_dir"


@pytest.fixture(scope="module")
def beside(data_dir) -> str:
    """A folder next to data_dir (in this session's temporary folder) that no error line may show."""
    os.makedirs(os.path.join(os.path.dirname(data_dir), "outside_data_dir_marker"), exist_ok=True)
    return "outside_data_dir_marker"


@pytest.mark.parametrize(
    "name",
    [
        "../../etc",
        "..",
        "../tfds0",
        "/etc",
        "tiny_digits/..",
        "tiny_digits/../..",
        "~",
        "tiny_digits\\..",
        "tiny_digits/data_dir=/etc",
        "tiny_digits:1.0.0/data_dir=..",
    ],
)
def test_a_name_that_is_a_path_is_refused_without_looking_outside_data_dir(data_dir, beside, name):
    msg = _err(data_dir, name=name)
    assert msg == f"{name!r} {NOT_A_NAME}{A_PATH}"
    assert beside not in msg


@pytest.mark.parametrize("name", ["huggingface:mnist", "1mnist", "mnist:1.0", "mnist@1.0.0", ""])
def test_a_name_outside_tfds_offline_grammar_is_refused(data_dir, name):
    assert _err(data_dir, name=name) == f"{name!r} {NOT_A_NAME}"


def test_a_name_that_does_not_resolve_says_which_folder_was_looked_for(data_dir, beside):
    assert _err(data_dir, name="nosuch") == (
        f"dataset 'nosuch' not found: no folder nosuch in data_dir {data_dir} (datasets there: ghost, tiny_digits, tiny_text)"
    )
    assert _err(data_dir, name="tiny_digits:9.9.9") == (
        f"dataset 'tiny_digits:9.9.9' not found: no folder tiny_digits/9.9.9 in data_dir {data_dir} (tiny_digits/ holds: 1.0.0)"
    )
    assert _err(data_dir, name="tiny_digits/cfg:1.0.0") == (
        f"dataset 'tiny_digits/cfg:1.0.0' not found: no folder tiny_digits/cfg in data_dir {data_dir} (tiny_digits/ holds: 1.0.0)"
    )
    msg = _err(data_dir, name="ghost")  # a folder, but no dataset in it: tfds's own first line
    assert msg.startswith(f"cannot load dataset 'ghost' from data_dir {data_dir}: ") and msg.endswith(
        " (ghost/ holds: no folders)"
    )


def test_a_path_as_data_name_is_a_config_error_before_any_source_is_made(data_dir):
    from meshpar.configuration import config
    from meshpar.step import inputs

    data = config.DataConfig(source="tfds", name="../../etc", data_dir=data_dir)
    for source in ("tfds", "tfds_text"):
        with pytest.raises(config.ConfigError) as e:
            inputs.make_source(dataclasses.replace(data, source=source), "train", 0)
        assert str(e.value) == f"data.name: '../../etc' {NOT_A_NAME}{A_PATH}"
