"""A Hugging Face ``config.json`` ↔ the architecture fields of a Llama run's ``model`` section.

Read: ``model_type: llama`` (and ``LlamaForCausalLM`` where ``architectures`` is given), no
biases, ``hidden_act: silu``; rotary settings in either spelling — transformers 5's
``rope_parameters`` (``rope_type``, ``rope_theta``, the llama3 factors) or transformers 4's
top-level ``rope_theta`` with ``rope_scaling`` (``rope_type`` or ``type``); ``head_dim`` where
given, else ``hidden_size / num_attention_heads``; defaults as transformers' ``LlamaConfig``
has them. Anything meshpar's Llama does not compute the same way is refused in one line naming
the field. Written: the same fields in both spellings (rope_parameters for transformers 5,
rope_theta + rope_scaling for 4), over the folder's original ``config.json`` when there is one,
so fields meshpar does not model (token ids, ``initializer_range``, …) go through unchanged.

A run's model section is never filled in from a folder: its architecture fields must equal the
folder's (:func:`check_model`), so that the config alone says what the run trains (its record,
``--resume`` checks and the planner read the config, not the folder). ``python -m
meshpar.convert model-yaml HF_DIR`` prints the section that matches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from meshpar.configuration.config import ConfigError

ARCHITECTURE = "LlamaForCausalLM"
# meshpar's field → config.json's (the rope fields: keys of rope_parameters / rope_scaling).
FIELDS = {
    "d_model": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "d_head": "head_dim", "d_ff": "intermediate_size", "n_layers": "num_hidden_layers", "vocab_size": "vocab_size",
    "max_length": "max_position_embeddings", "rms_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "rope_theta": "rope_theta", "rope_scaling": "rope_type", "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_length": "original_max_position_embeddings",
}  # fmt: skip
LLAMA3 = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_length")
# transformers' LlamaConfig defaults for the fields a config.json may leave out.
DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0}
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16"}


def read_json(path: Path) -> dict:
    """A config.json's mapping; ConfigError naming the file when it is missing or not JSON."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(str(path), f"cannot be read as JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "is not a JSON object")
    return raw


def _int(raw: dict, where: str, key: str, default: int | None = None) -> int:
    value = raw.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(where, f"has no {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(where, f"{key} is {value!r}, not a positive integer")
    return value


def _number(raw: dict, where: str, key: str, default: float | None = None) -> float:
    value = raw.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(where, f"has no {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(where, f"{key} is {value!r}, not a number")
    return float(value)


def _rope(raw: dict, where: str) -> dict[str, Any]:
    """The rotary fields, from transformers 5's rope_parameters or 4's rope_theta + rope_scaling
    (rope_scaling wins where both are given, as in transformers 5)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(where, f"rope_parameters / rope_scaling is {params!r}, not a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _number(
        {"rope_theta": params.get("rope_theta", raw.get("rope_theta"))}, where, "rope_theta", DEFAULTS["rope_theta"]
    )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(where, f"partial_rotary_factor is {partial!r}; meshpar's llama rotates the whole head (1.0)")
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    if kind != "llama3":
        raise ConfigError(where, f"rope_type is {kind!r}; meshpar's llama has default and llama3 rotary positions")
    out = {"rope_theta": theta, "rope_scaling": "llama3"}
    for field in LLAMA3:
        key = FIELDS[field]
        if field == "rope_original_max_length":
            out[field] = _int(params, f"{where} (rope {key})", key)
        else:
            out[field] = _number(params, f"{where} (rope {key})", key)
    return out


def architecture(raw: dict, where: str) -> dict[str, Any]:
    """The LlamaConfig architecture fields of a config.json mapping; `where` names it in errors.
    Raises ConfigError (key `where`) naming the field that meshpar's llama cannot take."""
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise ConfigError(where, f"model_type is {model_type!r}, not 'llama' (meshpar reads Llama checkpoints only)")
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURE]:
        raise ConfigError(where, f"architectures is {archs!r}, not [{ARCHITECTURE!r}]")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(where, f"hidden_act is {act!r}; meshpar's llama is SwiGLU with silu")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False) is not False:
            raise ConfigError(where, f"{key} is {raw[key]!r}; meshpar's llama has no biases")
    tie = raw.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise ConfigError(where, f"tie_word_embeddings is {tie!r}, not true or false")
    d, heads = _int(raw, where, "hidden_size"), _int(raw, where, "num_attention_heads")
    return {
        "d_model": d,
        "n_heads": heads,
        "n_kv_heads": _int(raw, where, "num_key_value_heads", heads),
        "d_head": _int(raw, where, "head_dim", d // heads),
        "d_ff": _int(raw, where, "intermediate_size"),
        "n_layers": _int(raw, where, "num_hidden_layers"),
        "vocab_size": _int(raw, where, "vocab_size"),
        "max_length": _int(raw, where, "max_position_embeddings", DEFAULTS["max_position_embeddings"]),
        "rms_eps": _number(raw, where, "rms_norm_eps", DEFAULTS["rms_norm_eps"]),
        "tie_embeddings": tie,
        **_rope(raw, where),
    }


def read(folder: Path) -> dict[str, Any]:
    """The architecture fields of `folder`'s config.json."""
    path = Path(folder) / "config.json"
    return architecture(read_json(path), str(path))


def compared(arch: dict[str, Any]) -> list[str]:
    """The fields of `arch` that must agree: the llama3 factors only where llama3 is used."""
    return [f for f in FIELDS if f in arch and (arch["rope_scaling"] == "llama3" or f not in LLAMA3)]


def check_model(model: Any, arch: dict[str, Any], where: str) -> None:
    """`model` (a run's model config) is a llama whose architecture fields equal `arch` (read
    from `where`); ConfigError naming the first key that differs, with both values."""
    if getattr(model, "name", None) != "llama":
        raise ConfigError("model.name", f"{getattr(model, 'name', None)!r}, but {where} holds a Llama: use name: llama")
    for field in compared(arch):
        mine, theirs = getattr(model, field), arch[field]
        if mine != theirs:
            hf = FIELDS[field]
            raise ConfigError(f"model.{field}", f"{mine!r} in the config but {theirs!r} in {where} ({hf})")


def model_yaml(arch: dict[str, Any]) -> str:
    """The ``model:`` section (YAML) whose architecture fields equal `arch`."""
    lines = ["model:", "  name: llama"]
    for field in compared(arch):
        value = arch[field]
        lines.append(f"  {field}: {_yaml(value)}")
    return "\n".join(lines) + "\n"


def _yaml(value: Any) -> str:
    """`value` as YAML reads it back: a float keeps a '.' in its mantissa (YAML 1.1 reads 1e-05 as text)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        mantissa, e, exponent = repr(value).partition("e")
        return f"{mantissa}{'' if '.' in mantissa else '.0'}{e}{exponent}"
    return str(value)


def to_hf(model: Any, base: dict | None = None) -> dict:
    """config.json for a llama `model` config: `base` (the folder's original config, when known)
    with every architecture field and the dtype set from `model`, rotary in both spellings."""
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    out.update(
        architectures=[ARCHITECTURE], model_type="llama", hidden_act="silu", attention_bias=False, mlp_bias=False
    )
    for field in ("d_model", "n_heads", "n_kv_heads", "d_head", "d_ff", "n_layers", "vocab_size", "max_length", "rms_eps",
                  "tie_embeddings"):  # fmt: skip
        out[FIELDS[field]] = getattr(model, field)
    rope: dict[str, Any] = {"rope_type": "default" if model.rope_scaling == "none" else model.rope_scaling}
    if model.rope_scaling == "llama3":
        rope.update({FIELDS[f]: getattr(model, f) for f in LLAMA3})
    out["rope_parameters"] = {**rope, "rope_theta": float(model.rope_theta)}
    out["rope_theta"] = float(model.rope_theta)
    out["rope_scaling"] = rope if model.rope_scaling != "none" else None
    out["dtype"] = out["torch_dtype"] = DTYPE_NAMES[model.param_dtype]
    out.pop("partial_rotary_factor", None)
    return dict(sorted(out.items()))
