"""A PEFT LoRA adapter folder read as data: adapter_config.json checked value by value, its tensors
read from safetensors only and checked before anything uses them.

An adapter folder comes from anywhere (the Hub, a colleague), so it is read as a Hugging Face
config.json is (checkpoint/hf.py): every field of adapter_config.json that changes what the adapter
computes is either honoured by models/lora.py (r, lora_alpha, use_rslora, use_dora, rank_pattern,
alpha_pattern, modules_to_save) or refused in one sentence (bias, lora_bias, layer_replication, ...);
`adapter_model.bin`, a pickle, is refused and never opened; every tensor must be floating point and
finite. rank_pattern and alpha_pattern keys are regular expressions, matched as peft matches them
(`(.*\\.)?(KEY)$` against the module's name in the transformers model); a key is length-limited and
may not nest quantifiers (the patterns that backtrack exponentially), and where the `regex` package
is installed (transformers requires it) each match also runs under a time limit.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"

MAX_RANK = 65536
MAX_PATTERN_LENGTH = 256
MAX_PATTERNS = 4096
MAX_CONFIG_BYTES = 16 * 2**20
MATCH_SECONDS = 1.0

# Fields that change what the adapter computes, refused unless they hold the value that changes
# nothing (absent, None, false, empty): what each would need that models/lora.py does not do.
_REFUSED = {
    "bias": ("none", "the adapter also trains the base model's biases (peft's bias 'all' or 'lora_only')"),
    "lora_bias": (False, "its B matrices have biases (lora_bias)"),
    "layer_replication": (None, "it duplicates layers of the base model (layer_replication)"),
    "megatron_config": (None, "its layers are Megatron's parallel linears (megatron_config)"),
    "trainable_token_indices": (None, "it trains token embeddings (trainable_token_indices)"),
    "target_parameters": (None, "it adapts parameters rather than modules (target_parameters)"),
    "use_qalora": (False, "it is a QA-LoRA adapter (use_qalora)"),
    "alora_invocation_tokens": (None, "it is an activated LoRA, on only after its invocation tokens"),
    "use_bdlora": (None, "it is a block-diagonal LoRA (use_bdlora)"),
    "velora_config": (None, "it is a VeLoRA adapter (velora_config)"),
    "monteclora_config": (None, "it is a MonteCLoRA adapter (monteclora_config)"),
}
# Initializations that change the base model's weights as well (the adapter then only fits that
# changed base): PiSSA, OLoRA, CorDA, LoftQ.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "eva", "lora-ga")


def read_adapter_config(folder: str, *, option: str = "the adapter") -> dict:
    """A PEFT folder's adapter_config.json, checked value by value (check_adapter_config), with its
    weights in safetensors beside it; ValueError (one sentence) otherwise."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise ValueError(f"it is larger than {MAX_CONFIG_BYTES // 2**20} MiB")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        detail = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ValueError(f"{option} {folder} is not a PEFT adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}): "
                         f"{detail}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ValueError(f"{option}: {path} is not a LoRA adapter (peft_type {config.get('peft_type')!r})"
                         if isinstance(config, dict) else f"{option}: {path} is not a JSON object")
    if not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        if os.path.exists(os.path.join(folder, PICKLED_WEIGHTS)):
            raise ValueError(f"{option} {folder} holds its weights as {PICKLED_WEIGHTS}, a pickle, which titanlike "
                             f"never opens (it can run code); save the adapter as {ADAPTER_WEIGHTS} "
                             "(peft's save_pretrained(..., safe_serialization=True))")
        raise ValueError(f"{option} {folder} has no {ADAPTER_WEIGHTS}")
    check_adapter_config(config, path)
    return config


def check_adapter_config(config: dict, path: str) -> None:
    """Every value of adapter_config.json that changes what the adapter computes is one models/lora.py
    honours, and in range; ValueError (one sentence naming the file and the field) otherwise."""
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not _is_int(rank) or not 1 <= rank <= MAX_RANK:
        raise ValueError(f"{path}: r is {_show(rank)}, but it must be an integer from 1 to {MAX_RANK}")
    if not _is_positive(alpha):
        raise ValueError(f"{path}: lora_alpha is {_show(alpha)}, but it must be a finite number above 0")
    dropout = config.get("lora_dropout", 0.0)
    if not (_is_number(dropout) and 0 <= dropout < 1):
        raise ValueError(f"{path}: lora_dropout is {_show(dropout)}, but it must be a number in [0, 1)")
    for name in ("use_rslora", "use_dora", "fan_in_fan_out", "inference_mode"):
        if config.get(name) not in (None, True, False):
            raise ValueError(f"{path}: {name} is {_show(config[name])}, but it must be true or false")
    for name, (neutral, what) in _REFUSED.items():
        value = config.get(name, neutral)
        if value not in (neutral, None, False, [], {}, ""):
            raise ValueError(f"{path}: {name} is {_show(value)}: {what}, which titanlike's LoRA does not compute; "
                             "use an adapter without it")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(f"{path}: init_lora_weights is {_show(init)}, an initialization that also changes the base "
                         "model's weights, so the adapter fits only that changed base; convert it to a plain LoRA "
                         "adapter first (peft's path_initial_model_for_weight_conversion)")
    for name in ("target_modules", "exclude_modules", "modules_to_save", "layers_pattern"):
        _check_names(config.get(name), path, name)
    for name, valid, kind in (("rank_pattern", lambda v: _is_int(v) and 1 <= v <= MAX_RANK,
                               f"an integer rank from 1 to {MAX_RANK}"),
                              ("alpha_pattern", _is_positive, "a finite alpha above 0")):
        patterns = config.get(name) or {}
        if not isinstance(patterns, dict):
            raise ValueError(f"{path}: {name} is {_show(patterns)}, not an object of pattern: value")
        if len(patterns) > MAX_PATTERNS:
            raise ValueError(f"{path}: {name} has {len(patterns)} entries, more than {MAX_PATTERNS}")
        for key, value in patterns.items():
            check_pattern(key, path, name)
            if not valid(value):
                raise ValueError(f"{path}: {name} gives {key!r} the value {_show(value)}, but it must be {kind}")


def check_pattern(key: str, path: str, field: str) -> None:
    """A rank_pattern / alpha_pattern key: a regular expression short enough, that compiles, and with
    no quantified group holding a quantifier ((a+)+: exponential backtracking)."""
    if len(key) > MAX_PATTERN_LENGTH:
        raise ValueError(f"{path}: a key of {field} is {len(key)} characters long, more than {MAX_PATTERN_LENGTH}")
    try:
        re.compile(key)
    except re.error as e:
        raise ValueError(f"{path}: the {field} key {key!r} is not a regular expression ({e})") from None
    if re.search(r"\([^()]*[*+}][^()]*\)\s*[*+{]", key):
        raise ValueError(f"{path}: the {field} key {key!r} repeats a group that repeats (exponential backtracking); "
                         "write it without nested quantifiers")


def pattern_value(patterns: dict, name: str, default, *, path: str = ADAPTER_CONFIG, field: str = "rank_pattern"):
    """peft's rule (peft.utils.other.get_pattern_key): the value of the first key that matches the end
    of module `name` as whole dot-separated parts; `default` when none does."""
    for key, value in (patterns or {}).items():
        if _matches(rf"(.*\.)?({key})$", name, path, field):
            return value
    return default


def _matches(pattern: str, name: str, path: str, field: str) -> bool:
    try:
        import regex
    except ImportError:  # check_pattern refused the keys that backtrack exponentially
        return re.match(pattern, name) is not None
    try:
        return regex.match(pattern, name, timeout=MATCH_SECONDS) is not None
    except TimeoutError:
        raise ValueError(f"{path}: matching a {field} key against {name} took over {MATCH_SECONDS:g} s; "
                         "simplify the pattern") from None


def read_adapter_tensors(folder: str) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors' tensors, each floating point and finite; ValueError (one sentence
    naming the tensor) otherwise."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(os.path.join(folder, ADAPTER_WEIGHTS))
    except Exception as e:  # safetensors' own errors: a truncated or foreign file
        raise ValueError(f"{folder}/{ADAPTER_WEIGHTS} cannot be read: {e}") from None
    for name, value in tensors.items():
        check_tensor(folder, name, value)
    return tensors


def check_tensor(folder: str, name: str, value: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    """One adapter tensor: floating point, finite in float32 and (if given) of `shape`; ValueError naming it."""
    if not value.is_floating_point():
        raise ValueError(f"{folder}/{ADAPTER_WEIGHTS}: {name} has dtype {str(value.dtype).removeprefix('torch.')}, "
                         "but adapter weights are floating point")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{folder}/{ADAPTER_WEIGHTS}: {name} has shape {tuple(value.shape)} but this job's model "
                         f"needs {tuple(shape)} (another base model, rank or rank_pattern?)")
    # The job holds adapters in float32 at most: a float64 value beyond its range would become infinite.
    if value.numel() and not bool(torch.isfinite(value.float()).all()):
        raise ValueError(f"{folder}/{ADAPTER_WEIGHTS}: {name} holds non-finite values (NaN or infinity"
                         + (", or beyond float32's range)" if value.dtype == torch.float64 else ")"))


def _check_names(value, path: str, field: str) -> None:
    if value is None:
        return
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}: {field} is {_show(value)}, not a name or a list of names")
    if len(names) > MAX_PATTERNS or any(len(n) > MAX_PATTERN_LENGTH for n in names):
        raise ValueError(f"{path}: {field} has more than {MAX_PATTERNS} names or one longer than "
                         f"{MAX_PATTERN_LENGTH} characters")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_positive(value) -> bool:
    return _is_number(value) and value > 0


def _show(value) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, list, dict, type(None))) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PICKLED_WEIGHTS", "check_adapter_config", "check_pattern",
           "check_tensor", "pattern_value", "read_adapter_config", "read_adapter_tensors"]
