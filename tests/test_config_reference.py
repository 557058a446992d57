"""The config reference (meshpar.config_reference): every config field has a comment, by the
convention the module states, and the rendered page lists every key with its type, default,
allowed values and comment. Plus the README's links into docs/, which `mkdocs build --strict`
(CI) does not see."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
import typing
from typing import Literal

from meshpar import config_reference as ref
from meshpar.configuration.config import Config, TrainConfig
from meshpar.configuration.schema import at_least, between
from meshpar.models import MODELS

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Commented:
    # A block above a field: its own comment.
    alone: int = 1
    trailing: int = 2  # a trailing comment: its own too
    # A block that opens a group: this field and the two after it.
    first: int = 3
    second: str = ""
    third: bool = False

    after_blank: int = 4  # a blank line ends a group; this one has its own comment
    # Block and trailing comment together.
    both: float = dataclasses.field(default=0.5, metadata=between(0.0, 1.0))  # (and more)
    # A group whose head also has a trailing comment.
    head: int = dataclasses.field(default=1, metadata=at_least(1))  # the head's own
    member: Literal["a", "b"] = "a"


@dataclasses.dataclass(frozen=True)
class Uncommented:
    # Documented.
    documented: int = 0
    commented: int = 1  # documented too

    after_blank: int = 2
    trailing: int = 3  # a field with a comment of its own ends the group before it
    after_trailing: int = 4


def docs(cls, source=None):
    return {d.name: d for d in ref.field_docs(cls, source)}


def test_convention_on_a_synthetic_dataclass():
    d = docs(Commented)
    assert d["alone"].own == "A block above a field: its own comment." and not d["alone"].group
    assert d["trailing"].own == "a trailing comment: its own too"
    assert d["first"].own == "A block that opens a group: this field and the two after it."
    for name in ("second", "third"):
        assert (d[name].own, d[name].group, d[name].head) == ("", d["first"].own, "first")
    assert d["after_blank"].own == "a blank line ends a group; this one has its own comment"
    assert d["both"].own == "Block and trailing comment together. (and more)"
    assert d["member"].group == "A group whose head also has a trailing comment. the head's own"
    assert ref.missing([("", Commented)]) == []


def test_a_field_without_a_comment_is_reported():
    # after_blank: a blank line ends the group above it; after_trailing: a field with a comment
    # of its own (not a block) opens no group.
    assert ref.missing([("sec", Uncommented)]) == ["sec.after_blank (Uncommented)", "sec.after_trailing (Uncommented)"]


def test_every_config_field_has_a_comment():
    assert ref.missing() == [], "add a comment to each (see meshpar/config_reference.py for the convention)"


def test_removing_a_comment_is_noticed():
    # The same check on TrainConfig's own source with train.steps' comment taken out: steps is
    # the class's first field, so no group can cover it.
    source = inspect.getsource(TrainConfig)
    lines = source.splitlines()
    steps = next(i for i, line in enumerate(lines) if line.strip().startswith("steps:"))
    assert lines[steps - 1].strip().startswith("#"), "train.steps is expected to have a comment block"
    edited = "\n".join(lines[: steps - 1] + lines[steps:])
    assert not docs(TrainConfig, edited)["steps"].own
    assert docs(TrainConfig, edited)["steps"].group == ""
    # …and a trailing comment removed (Config.data's) leaves that key uncovered as well.
    source = inspect.getsource(Config)
    edited = re.sub(r"(\n    data: DataConfig = DataConfig\(\))  #[^\n]*", r"\1", source)
    assert edited != source
    assert not docs(Config, edited)["data"].own and not docs(Config, edited)["data"].group


def test_sections_cover_every_dataclass():
    covered = {cls for _, cls in ref.sections()}
    assert {family.config for family in MODELS.values()} <= covered
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            assert hints[f.name] in covered, f.name


def keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from keys(hints[f.name], key)
        elif key != "model":
            yield key


def test_the_page_lists_every_key_with_its_type_default_and_bounds():
    page = ref.render()
    for key in [*keys(Config), *(k for fam in MODELS.values() for k in keys(fam.config, "model"))]:
        assert re.search(rf"^`{re.escape(key)}` · ", page, re.M), key
    assert "`train.steps` · int · default `100` · 1 to 2147483647" in page
    assert "`feed.mode` · str · default `direct` · one of `direct`, `routed`" in page
    assert "`data.eval_fraction` · float · default `0.05` · 0.0 to 1.0" in page
    assert "`model.hidden` · list of int · default `[512]` · each ≥ 1" in page
    assert "`mesh` · mesh string or mapping · default `data:-1`" in page
    assert "`data.fields` · mapping of str to str · default `{inputs: image, targets: label}`" in page
    for name in MODELS:
        assert f"### `model.name: {name}`" in page
        assert f"`model.name` · str · default `{name}` · one of `{name}`" in page
    # A group: the keys share one definition, the group's comment.
    group = re.search(
        r"^`data.num_examples` .*\n`data.num_eval_examples` .*\n`data.num_features` .*\n"
        r"`data.num_classes` .*\n:   synthetic: ",
        page,
        re.M,
    )
    assert group, "the synthetic group is one entry"
    assert "(no comment)" not in page


def test_comment_text_is_escaped_for_markdown():
    text = "<workdir>/tb, d_model**-0.5 and `a<b>_c`"
    assert ref.escape(text) == r"&lt;workdir&gt;/tb, d\_model\*\*-0.5 and `a<b>_c`"


def test_readme_links_resolve_and_it_stays_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    for link in local:
        assert (ROOT / link).exists(), link
