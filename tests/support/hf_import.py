"""A Hugging Face import in a Python process of its own, for the tests of its host memory: the
high-water resident memory ``meshpar.hf.load`` reports is the process's, so nothing else may
have run in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
from meshpar.configuration import config
from meshpar.hf import load
from meshpar.step import parts
import numpy as np
cfg = config.from_dict(json.loads(sys.argv[2]))
step = parts.abstract_step(cfg, element_spec={"tokens": ((17,), np.dtype(np.int32))})
_, report = load.open(sys.argv[1], cfg.model).load(step.plan.abstract.params, step.plan.shardings.params)
print(json.dumps(report.__dict__))
"""


def import_report(folder: Path, raw: dict, env: dict) -> dict:
    """The checkpoint in `folder` imported into the sharded parameters of the run config `raw`
    (a config as a dict; 8 CPU devices) by a new Python process with environment `env`: its
    ``meshpar.hf.load.Report`` as a dict (``placed_bytes``, ``largest_tensor_bytes``,
    ``baseline_rss``, ``peak_rss``, …). The process must exit 0."""
    result = subprocess.run([sys.executable, "-c", _SCRIPT, str(folder), json.dumps(raw)],
                            capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
