"""What a checkpoint records about its run, and what ``--resume`` may change.

Every checkpoint carries a *run record*: the config values that make the run what it is (seed,
batch size, model, optimizer with its schedule's horizon, data), and a fingerprint of the
training data (examples, fields). A resumed run must keep them; a change is refused in one
line naming the key, the saved value and the new one, unless ``checkpoint.allow_changes``
names the key (or its section). Everything else — ``train.steps``, logging, eval, feeding,
mesh, layout, host offload, checkpoint cadence, hardware — may change (the state is read
straight into this run's shardings, device or pinned host memory alike): extending a run with
``--resume train.steps=<more>`` is the common case, and the learning-rate schedule keeps the
horizon it was saved with (``optimizer.decay_steps``, by default the first run's
``train.steps``), so extending never reshapes it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from meshpar.checkpoints.checkpoint import Checkpointer, CheckpointError
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config, ConfigError
from meshpar.step import parts, trainer

# Keys a resumed run must keep; a name without a dot is a whole section.
KEPT = ("train.seed", "train.batch_size", "model", "optimizer", "data")
# Where the data lives and how it is read, not what it is: may change between runs (batches
# are the same for any number of data.workers).
MOVABLE = ("data.data_dir", "data.corpus_dir", "data.path", "data.workers", "data.verify")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, f"{key}.") if isinstance(v, dict) and v else {key: v})
    return out


def _kept(key: str) -> bool:
    return key not in MOVABLE and any(key == k or key.startswith(f"{k}.") for k in KEPT)


def record(cfg: Config, inputs) -> dict:
    """This run's record, as its checkpoints will hold it (plain JSON values)."""
    values = {k: v for k, v in _flat(config_lib.to_dict(cfg)).items() if _kept(k)}
    values["optimizer.decay_steps"] = parts.horizon(cfg)
    spec = {k: [list(shape), str(dtype)] for k, (shape, dtype) in inputs.element_spec.items()}
    values["data.train_examples"] = len(inputs.train.source)
    if inputs.tokenizer_sha256:  # the file's content, not its path (meshpar.step.inputs.tokenizer_sha256)
        values["data.tokenizer_sha256"] = inputs.tokenizer_sha256
    values["data.element_spec"] = spec
    return json.loads(json.dumps({"config": values, "decay_steps": parts.horizon(cfg)}))  # tuples → lists, as saved


def _allowed(key: str, allow: tuple[str, ...]) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in allow)


def continued(cfg: Config, new: dict, saved: dict, step: int) -> dict:
    """The record the resumed run goes on with: `new`, with the saved horizon unless the config
    sets one. Raises ConfigError on the first kept value that changed and is not allowed to."""
    new = json.loads(json.dumps(new))
    if not cfg.optimizer.decay_steps:  # 0 = keep the run's own horizon
        new["decay_steps"] = new["config"]["optimizer.decay_steps"] = saved["decay_steps"]
    allow = cfg.checkpoint.allow_changes
    old_values, new_values = saved["config"], new["config"]
    for key in [*new_values, *(k for k in old_values if k not in new_values)]:  # config order
        old, now = old_values.get(key, "(absent)"), new_values.get(key, "(absent)")
        if key not in old_values and now == _default(key):
            continue  # a setting added after the run was saved, at its default: what that run did
        if old != now and not _allowed(key, allow):
            raise ConfigError(
                key,
                f"{_show(now)} but the checkpoint at step {step} was saved with {_show(old)}; a resumed run keeps "
                f"its settings (to change it anyway: checkpoint.allow_changes=[{key}])",
            )
    return new


def _default(key: str) -> Any:
    """A ``section.name`` key's default value as a record holds it (absent for others)."""
    section, _, name = key.partition(".")
    defaults = getattr(config_lib.Config(), section, None)
    if not dataclasses.is_dataclass(defaults) or not hasattr(defaults, name):
        return "(absent)"
    return json.loads(json.dumps(dataclasses.asdict(defaults)[name]))


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


@dataclasses.dataclass
class Resumed:
    state: trainer.TrainState
    record: dict
    step: int


def restore(cfg: Config, checkpointer: Checkpointer, plan: trainer.StatePlan, new_record: dict) -> Resumed | None:
    """The newest usable checkpoint, checked against this config before any array is read;
    None when the run starts fresh (no --resume, or nothing saved yet)."""
    if cfg.checkpoint.resume != "auto" or not checkpointer.steps():
        return None
    went_on: dict = {}

    def accept(saved: dict, step: int) -> None:
        went_on["record"] = continued(cfg, new_record, saved, step)

    restored = checkpointer.restore(plan.abstract, plan.shardings, accept=accept)
    if restored.position.get("next_batch") != restored.step:
        raise CheckpointError(
            f"checkpoint at step {restored.step} records input position {restored.position.get('next_batch')}"
        )
    return Resumed(restored.state, went_on["record"], restored.step)


def position(next_batch: int) -> dict:
    """The input pipeline's position: batch `next_batch` comes next (batches are a pure function
    of seed and index, and the seed is in the run record)."""
    return {"next_batch": next_batch}
