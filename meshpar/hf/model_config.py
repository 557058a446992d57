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

Mixtral (``model_type: mixtral``, ``MixtralForCausalLM``) is a Llama whose every layer's MLP
is a mixture of experts: the same fields (defaults as transformers' ``MixtralConfig``: rope
theta 1e6, 8 key/value heads), and ``num_local_experts`` → ``moe_experts``,
``num_experts_per_tok`` → ``moe_top_k``, with ``moe_every`` 1. Refused: a ``sliding_window``
shorter than ``max_position_embeddings`` (meshpar attends to every earlier position; a window
that long changes nothing) and a non-zero ``router_jitter_noise`` (meshpar's router does not
jitter). ``router_aux_loss_coef`` and ``output_router_logits`` are how transformers trains, not
the architecture: they are not read (a run's ``moe_aux_coef`` is its own; transformers'
balance loss is ``moe_top_k`` times meshpar's) and go through an export as the original had them.

A run's model section is never filled in from a folder: its architecture fields must equal the
folder's (:func:`check_model`), so that the config alone says what the run trains (its record,
``--resume`` checks and the planner read the config, not the folder). ``python -m
meshpar.convert model-yaml HF_DIR`` prints the section that matches (:func:`model_section`: for a
Mixtral also ``moe_dispatch: dropless``, as Mixtral drops no token).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from meshpar.configuration.schema import ConfigError, is_number

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}  # model_type → its class
# meshpar's field → config.json's (the rope fields: keys of rope_parameters / rope_scaling).
FIELDS = {
    "d_model": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "d_head": "head_dim", "d_ff": "intermediate_size", "n_layers": "num_hidden_layers", "vocab_size": "vocab_size",
    "max_length": "max_position_embeddings", "rms_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "rope_theta": "rope_theta", "rope_scaling": "rope_type", "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_length": "original_max_position_embeddings",
    "moe_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok",
}  # fmt: skip
# The expert fields: moe_experts always compared (0 for a Llama); top-k and spacing (moe_every,
# which config.json has no key for: a Mixtral's is 1) where there are experts.
MOE = ("moe_experts", "moe_top_k", "moe_every")
LLAMA3 = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_length")
# transformers' LlamaConfig and MixtralConfig defaults for the fields a config.json may leave out
# (None: as many key/value heads as query heads).
DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "rope_theta": 10000.0, "num_key_value_heads": None},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                "rope_theta": 1e6, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
}  # fmt: skip
# The config.json keys of a Mixtral that a Llama has not (dropped when a Llama is written).
MIXTRAL_KEYS = ("num_local_experts", "num_experts_per_tok", "sliding_window", "router_jitter_noise",
                "router_aux_loss_coef", "output_router_logits")  # fmt: skip
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
    if not is_number(value, integer=True) or value < 1:
        raise ConfigError(where, f"{key} is {value!r}, not a positive integer")
    return value


def _number(raw: dict, where: str, key: str, default: float | None = None) -> float:
    value = raw.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(where, f"has no {key}")
    if not is_number(value) or not math.isfinite(value):
        raise ConfigError(where, f"{key} is {value!r}, not a number")
    return float(value)


def _rope(raw: dict, where: str, default_theta: float) -> dict[str, Any]:
    """The rotary fields, from transformers 5's rope_parameters or 4's rope_theta + rope_scaling
    (rope_scaling wins where both are given, as in transformers 5)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(where, f"rope_parameters / rope_scaling is {params!r}, not a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _number({"rope_theta": params.get("rope_theta", raw.get("rope_theta"))}, where, "rope_theta", default_theta)
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
    """The LlamaConfig architecture fields of a config.json mapping (a Mixtral's with its
    experts'); `where` names it in errors. Raises ConfigError (key `where`) naming the field that
    meshpar's llama cannot take."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            where,
            f"model_type is {model_type!r}, not 'llama' or 'mixtral' (meshpar reads Llama and Mixtral checkpoints)",
        )
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[model_type]]:
        raise ConfigError(where, f"architectures is {archs!r}, not [{ARCHITECTURES[model_type]!r}]")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(where, f"hidden_act is {act!r}; meshpar's llama is SwiGLU with silu")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False) is not False:
            raise ConfigError(where, f"{key} is {raw[key]!r}; meshpar's llama has no biases")
    defaults = DEFAULTS[model_type]
    tie = raw.get("tie_word_embeddings", defaults["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise ConfigError(where, f"tie_word_embeddings is {tie!r}, not true or false")
    d, heads = _int(raw, where, "hidden_size"), _int(raw, where, "num_attention_heads")
    max_length = _int(raw, where, "max_position_embeddings", defaults["max_position_embeddings"])
    return {
        "d_model": d,
        "n_heads": heads,
        "n_kv_heads": _int(raw, where, "num_key_value_heads", defaults["num_key_value_heads"] or heads),
        "d_head": _int(raw, where, "head_dim", d // heads),
        "d_ff": _int(raw, where, "intermediate_size"),
        "n_layers": _int(raw, where, "num_hidden_layers"),
        "vocab_size": _int(raw, where, "vocab_size"),
        "max_length": max_length,
        "rms_eps": _number(raw, where, "rms_norm_eps", defaults["rms_norm_eps"]),
        "tie_embeddings": tie,
        **_rope(raw, where, defaults["rope_theta"]),
        **(_experts(raw, where, max_length) if model_type == "mixtral" else {"moe_experts": 0}),
    }


def _experts(raw: dict, where: str, max_length: int) -> dict[str, Any]:
    """A Mixtral's expert fields; ConfigError for what meshpar's mixture of experts does not compute."""
    window = raw.get("sliding_window")
    if window is not None and (not is_number(window, integer=True) or window < max_length):
        raise ConfigError(
            where,
            f"sliding_window is {window!r}, shorter than max_position_embeddings {max_length}; meshpar attends to "
            f"every earlier position (no sliding window): null, or at least max_position_embeddings",
        )
    jitter = _number({"router_jitter_noise": raw.get("router_jitter_noise")}, where, "router_jitter_noise", 0.0)
    if jitter != 0.0:
        raise ConfigError(where, f"router_jitter_noise is {jitter!r}; meshpar's router does not jitter (0.0)")
    defaults = DEFAULTS["mixtral"]
    experts = _int(raw, where, "num_local_experts", defaults["num_local_experts"])
    top_k = _int(raw, where, "num_experts_per_tok", defaults["num_experts_per_tok"])
    if top_k > experts:
        raise ConfigError(where, f"num_experts_per_tok {top_k} is more than num_local_experts {experts}")
    return {"moe_experts": experts, "moe_top_k": top_k, "moe_every": 1}


def read(folder: Path) -> dict[str, Any]:
    """The architecture fields of `folder`'s config.json."""
    path = Path(folder) / "config.json"
    return architecture(read_json(path), str(path))


def compared(arch: dict[str, Any]) -> list[str]:
    """The fields of `arch` that must agree: the llama3 factors only where llama3 is used; the
    expert count always (0 for a Llama), top-k and spacing where there are experts."""
    llama3 = arch["rope_scaling"] == "llama3"
    fields = [f for f in FIELDS if f in arch and f not in MOE and (llama3 or f not in LLAMA3)]
    return [*fields, *(f for f in MOE if f in arch)]


def model_section(arch: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section (a mapping) of the run that a folder of architecture `arch` is:
    ``name: llama``, the compared fields, and for a Mixtral ``moe_dispatch: dropless`` (Mixtral
    drops no token; capacity dispatch computes the same only where nothing is dropped; a Llama's
    section leaves ``moe_experts`` at its default, 0)."""
    section = {"name": "llama", **{field: arch[field] for field in compared(arch)}}
    if arch.get("moe_experts"):
        section["moe_dispatch"] = "dropless"
    else:
        del section["moe_experts"]  # a Llama's: the default, 0
    return section


def _what(arch: dict[str, Any], field: str) -> str:
    """config.json's side of `field`, as an error names it."""
    if field == "moe_every":
        return "every layer of a Mixtral is a mixture of experts"
    if field == "moe_experts" and not arch[field]:
        return "model_type llama: no experts"
    return FIELDS[field]


def check_model(model: Any, arch: dict[str, Any], where: str) -> None:
    """`model` (a run's model config) is a llama whose architecture fields equal `arch` (read
    from `where`); ConfigError naming the first key that differs, with both values."""
    if getattr(model, "name", None) != "llama":
        kind = "Mixtral" if arch.get("moe_experts") else "Llama"
        raise ConfigError(
            "model.name", f"{getattr(model, 'name', None)!r}, but {where} holds a {kind}: use name: llama"
        )
    for field in compared(arch):
        mine, theirs = getattr(model, field), arch[field]
        if mine != theirs:
            raise ConfigError(
                f"model.{field}", f"{mine!r} in the config but {theirs!r} in {where} ({_what(arch, field)})"
            )


def model_yaml(arch: dict[str, Any]) -> str:
    """The ``model:`` section (YAML) whose architecture fields equal `arch` (:func:`model_section`)."""
    lines = ["model:"]
    for field, value in model_section(arch).items():
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
    """config.json for a llama `model` config (a Mixtral where it has experts, every layer's):
    `base` (the folder's original config, when known) with every architecture field and the
    dtype set from `model`, rotary in both spellings."""
    mixtral = bool(model.moe_experts)
    drop = ("rope_parameters", "rope_scaling", "rope_theta", *(() if mixtral else MIXTRAL_KEYS))
    out = {k: v for k, v in (base or {}).items() if k not in drop}
    model_type = "mixtral" if mixtral else "llama"
    out.update(architectures=[ARCHITECTURES[model_type]], model_type=model_type, hidden_act="silu")
    if mixtral:  # MixtralConfig has no bias switches: the keys are left out, as transformers writes it
        for key in ("attention_bias", "mlp_bias"):
            out.pop(key, None)
        out.update(num_local_experts=model.moe_experts, num_experts_per_tok=model.moe_top_k, router_jitter_noise=0.0)
        out.setdefault("sliding_window", None)  # the original's, which the import accepted, or none
    else:
        out.update(attention_bias=False, mlp_bias=False)
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
