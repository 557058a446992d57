"""The plan's and the search's JSON are a contract: every field they have keeps its name (fields
may be added, never renamed or dropped)."""

import json

import yaml

from meshpar.configuration import config as config_lib
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import topology
from meshpar.plan.search import layouts as search_lib

# Every field path of `python -m meshpar.plan --topology NAME --json` ("[]": each list item).
PLAN_FIELDS = """
analytic analytic.categories analytic.categories.activations analytic.categories.grads analytic.categories.inputs
analytic.categories.optimizer analytic.categories.params analytic.categories.queued_inputs
analytic.categories.workspace analytic.exact analytic.host analytic.host_total_bytes analytic.total_bytes
analytic_missing capacity capacity.bytes capacity.headroom_bytes capacity.source capacity.usable_bytes devices fits
mesh missing needed_bytes needed_from offload offload.host_bandwidth offload.options offload.options[].compute_s
offload.options[].device_bytes offload.options[].device_s offload.options[].exposed_s offload.options[].host_bytes
offload.options[].host_s offload.options[].option offload.options[].option.frees offload.options[].option.label
offload.options[].option.overrides offload.options[].predicted_s offload.options[].step_s offload.options[].update_s
offload.overlap offload.sweep offload.usable_bytes programs programs[].peak_bytes programs[].program
programs[].resident programs[].xla programs[].xla.alias_bytes programs[].xla.argument_bytes
programs[].xla.generated_code_bytes programs[].xla.host_alias_bytes programs[].xla.host_argument_bytes
programs[].xla.host_from programs[].xla.host_output_bytes programs[].xla.host_temp_bytes
programs[].xla.host_total_bytes programs[].xla.output_bytes programs[].xla.temp_bytes programs[].xla.total_bytes time
time.feed_s time.step time.step.bytes time.step.collective_s time.step.collectives time.step.collectives[].axis
time.step.collectives[].bytes time.step.collectives[].kind time.step.collectives[].seconds time.step.compute_s
time.step.exposed_feed_s time.step.feed_s time.step.flops time.step.flops_s time.step.memory_s time.step.total_s
time.topology verdict xla xla.alias_bytes xla.argument_bytes xla.generated_code_bytes xla.host_alias_bytes
xla.host_argument_bytes xla.host_from xla.host_output_bytes xla.host_temp_bytes xla.host_total_bytes xla.output_bytes
xla.temp_bytes xla.total_bytes
""".split()

# Every field path of `python -m meshpar.plan --search --json`.
SEARCH_FIELDS = """
capacity_source compiled duplicates enumerated fitting illegal legal missing num_devices rows rows[].compile_s
rows[].estimate rows[].estimate.activation_s rows[].estimate.compute_s rows[].estimate.exposed_feed_s
rows[].estimate.feed_s rows[].estimate.flops rows[].estimate.gradient_s rows[].estimate.memory_s
rows[].estimate.total_s rows[].fits rows[].layout rows[].memory_bytes rows[].mesh rows[].own rows[].param_layout
rows[].predicted rows[].predicted.bytes rows[].predicted.collective_s rows[].predicted.collectives
rows[].predicted.collectives[].axis rows[].predicted.collectives[].bytes rows[].predicted.collectives[].kind
rows[].predicted.collectives[].seconds rows[].predicted.compute_s rows[].predicted.exposed_feed_s
rows[].predicted.feed_s rows[].predicted.flops rows[].predicted.flops_s rows[].predicted.memory_s
rows[].predicted.total_s rows[].step_s rows[].xla_bytes seconds topology usable_bytes
""".split()

TINY = {
    "mesh": "data:2,model:2",
    "layout": "batch:data; hidden:model",
    "model": {"name": "mlp", "hidden": [1024]},
    "data": {"num_examples": 64, "num_eval_examples": 16, "num_features": 16, "num_classes": 10},
    "train": {"steps": 2, "batch_size": 8, "progress": False, "eval_every": 1},
}


def field_paths(value, prefix: str = "") -> set[str]:
    """Every field path of a JSON document (list items as ``[]``)."""
    out = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            path = f"{prefix}.{key}" if prefix else key
            out |= {path} | field_paths(inner, path)
    elif isinstance(value, list):
        for inner in value:
            out |= field_paths(inner, prefix + "[]")
    return out


def test_field_paths():
    assert field_paths({"a": {"b": [{"c": 1}, {"d": None}]}, "e": []}) == {"a", "a.b", "a.b[].c", "a.b[].d", "e"}


def test_the_plan_json_keeps_every_field(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "plan.json"
    # A machine whose collectives are timed: the time section has its collectives.
    assert plan_cli.main(["--config", str(path), "--topology", "rtx4090-x4", "--json", str(out)]) == 0
    capsys.readouterr()
    missing = sorted(set(PLAN_FIELDS) - field_paths(json.loads(out.read_text())))
    assert missing == []


def test_the_search_json_keeps_every_field():
    # A batch the devices would rather split: the best layouts communicate, so their rows have collectives.
    cfg = config_lib.from_dict({**TINY, "train": {**TINY["train"], "batch_size": 2048}})
    result = search_lib.search(cfg, topology.load("rtx4090-x4"), 4, top=2)
    missing = sorted(set(SEARCH_FIELDS) - field_paths(search_lib.to_json(result)))
    assert missing == []
