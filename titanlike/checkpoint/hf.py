"""Hugging Face interchange and load_model: DCP checkpoint <-> Hugging Face folder, and a
checkpoint of either kind -> an unsharded model.

The on-disk formats (sidecar, DCP index checks, safetensors reading and writing) live in
format.py, shared with the manager. A family is found from a config.json's model_type with
registry.spec_for_hf_model_type and speaks through its spec's Hugging Face adapter, spec.hf
(config_to_args / args_to_config, to_hf_state_dict / from_hf_state_dict, token_ids); nothing here
reads a family's fields. Everything runs in one process on full (unsharded) tensors.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from titanlike.checkpoint.format import (
    HF_CONFIG,
    SIDECAR,
    CheckpointError,
    build_args,
    check_fits,
    check_model_size,
    dcp_save,
    hf_folder_args,
    hf_model_from_config,
    drop_aliases,
    is_dcp_folder,
    model_description,
    read_dcp_model,
    read_hf,
    read_sidecar,
    resolve_checkpoint_folder,
    summarize,
    write_hf,
    write_sidecar,
)

from titanlike.data.hf_tokenizer import stored_tokenizer
from titanlike.models import protocol
from titanlike.models.common.init import buffers_only

if TYPE_CHECKING:
    from titanlike.data.hf_tokenizer import TokenizerExport


def write_dcp_model(state_dict: dict[str, torch.Tensor], out: str, info: dict[str, Any]) -> None:
    """A model-only DCP checkpoint (plus sidecar) from full tensors, in one process."""
    os.makedirs(out, exist_ok=True)
    try:
        dcp_save(drop_aliases(state_dict), out, no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing checkpoint {out} failed: {summarize(e)}") from None
    write_sidecar(out, info)


def export_dcp_to_hf(src: str, out: str, *, dtype: torch.dtype = torch.float32,
                     max_shard_bytes: int = 5 * 1024**3, description: dict | None = None,
                     tokenizer_path: str | None = None) -> TokenizerExport:
    """convert_dcp_to_hf: a titanlike DCP checkpoint (full or model-only) -> Hugging Face folder.

    The tokenizer files come from tokenizer_path, else from the tokenizer the checkpoint's
    sidecar names. Returns the tokenizer step's TokenizerExport (see format.write_hf).
    """
    info = read_sidecar(src) or {}
    description = description or info.get("model")
    if description is None:
        raise CheckpointError(
            f"{src} has no {SIDECAR} naming the model; pass the model family and flavor explicitly"
        )
    spec, args = build_args(description, where=os.path.join(src, SIDECAR))
    check_model_size(args, os.path.join(src, SIDECAR))
    state_dict = _merged(read_dcp_model(src))
    check_fits(state_dict, spec, args, src)
    tokenizer = info.get("tokenizer")
    tokenizer = tokenizer if isinstance(tokenizer, dict) else {}
    # Only the tokenizer stored inside the checkpoint (verified with its other files) or the one
    # passed: a path the sidecar records is never followed.
    stored, why_not = stored_tokenizer(src, tokenizer)
    ids = {name: _token_id(tokenizer, name, args.vocab_size, src) for name in ("bos_id", "eos_id", "pad_id")}
    fingerprint = tokenizer.get("fingerprint")
    export = write_hf(state_dict, spec, args, out, dtype=dtype, max_shard_bytes=max_shard_bytes,
                      context_len=args.context_len, **ids, tokenizer_path=tokenizer_path or stored,
                      tokenizer_fingerprint=fingerprint if isinstance(fingerprint, str) else None)
    if why_not and not tokenizer_path:
        export = export._replace(message=f"no tokenizer files written: {why_not}")
    return export


def _token_id(record: dict, name: str, vocab_size: int, src: str) -> int | None:
    """A special token id of the sidecar's tokenizer entry: None, or an id of the vocabulary."""
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise CheckpointError(f"{os.path.join(src, SIDECAR)}: tokenizer {name} is {json.dumps(value)[:50]}, not a "
                              f"token id below the model's vocabulary size {vocab_size}")
    return value


def import_hf_to_dcp(src: str, out: str, *, dtype: torch.dtype | None = None) -> None:
    """convert_hf_to_dcp: a Hugging Face folder -> model-only DCP checkpoint with sidecar."""
    spec, args = hf_folder_args(src)
    check_model_size(args, os.path.join(src, HF_CONFIG))
    hf_sd, config = read_hf(src)
    state_dict = _from_hf(spec, hf_sd, args, src)
    check_fits(state_dict, spec, args, src)
    # Same keys as the trainer saves: a tied weight once, under its first name (write_dcp_model).
    state_dict = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in state_dict.items()}
    info = {
        "contents": "model_only",
        "step": 0,
        "model": model_description(spec.name, args),
        "tokenizer": {k: config[h] for k, h in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"),
                                                ("pad_id", "pad_token_id"))
                      if isinstance(config.get(h), int)},
        "source": os.path.abspath(src),
    }
    write_dcp_model(state_dict, out, info)


def _from_hf(spec, hf_sd: dict[str, torch.Tensor], args, src: str) -> dict[str, torch.Tensor]:
    """The adapter's conversion of a Hugging Face state dict; one sentence when it does not fit."""
    try:
        return spec.hf.from_hf_state_dict(hf_sd, args)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"Hugging Face checkpoint {src} does not match its {HF_CONFIG}: {e}") from None
    except Exception as e:  # a tensor of the wrong rank or size for the conversion's reshapes
        raise CheckpointError(f"Hugging Face checkpoint {src} does not match its {HF_CONFIG} "
                              f"({type(e).__name__}: {e})") from None


def _merged(state_dict: dict) -> dict:
    """A LoRA job's checkpoint (model.converters lora) with its adapters folded into the weights; any
    other state dict as it is."""
    from titanlike.models.lora import has_adapters, merged_state_dict

    return merged_state_dict(state_dict) if has_adapters(state_dict) else state_dict


def checkpoint_model(path: str | os.PathLike):
    """(folder, spec, args) of the model a checkpoint holds (a DCP checkpoint with its sidecar, a
    Hugging Face folder, or a folder of step-N checkpoints: the latest), reading no tensor;
    CheckpointError (one sentence) otherwise."""
    folder = resolve_checkpoint_folder(os.fspath(path))
    if is_dcp_folder(folder):
        info = read_sidecar(folder)
        if info is None or not isinstance(info.get("model"), dict):
            raise CheckpointError(f"{folder} has no {SIDECAR} naming the model it holds")
        spec, args = build_args(info["model"], where=os.path.join(folder, SIDECAR))
    else:
        spec, args = hf_folder_args(folder)
    return folder, spec, args


def checkpoint_state_dict(folder: str, spec, args) -> dict[str, torch.Tensor]:
    """The full tensors of checkpoint_model's folder in our names (a LoRA checkpoint merged), checked
    against the model (check_fits)."""
    if is_dcp_folder(folder):
        state_dict = _merged(read_dcp_model(folder))
    else:
        state_dict = _from_hf(spec, read_hf(folder)[0], args, folder)
    check_fits(state_dict, spec, args, folder)
    return state_dict


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", *,
               dtype: torch.dtype | None = None) -> torch.nn.Module:
    """An unsharded model from a titanlike DCP checkpoint or a Hugging Face folder.

    ``path``: a DCP checkpoint (full or model-only, e.g. ``outputs/checkpoint/step-100``),
    a Hugging Face safetensors folder, or a checkpoint folder holding ``step-N`` subfolders
    (the latest is taken). Returns the model in eval mode on ``device``; ``model(tokens)``
    maps int64 tokens (batch, seq) to logits (batch, seq, vocab). ``dtype`` casts the
    weights (default: as stored).
    """
    folder = resolve_checkpoint_folder(os.fspath(path))
    bytes_per_param = torch.empty(0, dtype=dtype or torch.float32).element_size()
    if is_dcp_folder(folder):
        info = read_sidecar(folder)
        if info is None or not isinstance(info.get("model"), dict):
            raise CheckpointError(f"{folder} has no {SIDECAR} naming the model it holds")
        spec, args = build_args(info["model"], where=os.path.join(folder, SIDECAR))
        check_model_size(args, os.path.join(folder, SIDECAR), device=device, bytes_per_param=bytes_per_param)
        state_dict = _merged(read_dcp_model(folder, dtype=dtype))
    else:
        spec, args = hf_folder_args(folder)
        check_model_size(args, os.path.join(folder, HF_CONFIG), device=device, bytes_per_param=bytes_per_param)
        hf_sd, _ = read_hf(folder)
        state_dict = _from_hf(spec, hf_sd, args, folder)
        if dtype is not None:
            state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    try:
        with torch.device("meta"):
            model = spec.model_cls(args)
    except Exception:
        model = None  # check_fits says why, in one sentence
    check_fits(state_dict, spec, args, folder, model=model)
    # The parameters stay on meta until the checkpoint's tensors take their place (check_fits proved
    # it holds every one): only the buffers are materialized, and init_weights rebuilds them (RoPE
    # tables in float32, zeroed statistics) without drawing weights that would be overwritten.
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            cast = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
            setattr(module, name, torch.empty_like(buffer, device=device, dtype=cast))
    with buffers_only():
        model.init_weights(seed=0)
    targets = model.state_dict()
    loaded = {}
    for key, value in state_dict.items():
        # As the model would hold it: dtype when given, else the model's own (fp32) for weights.
        cast = dtype if dtype is not None and value.is_floating_point() else targets[key].dtype
        loaded[key] = value.to(device=device, dtype=cast)
    # strict=False only for a tied alias, which takes its owner's Parameter (retie_weights).
    model.load_state_dict(loaded, strict=False, assign=True)
    protocol.retie_weights(model)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"{folder} does not hold the model's {left[0]}")
    return model.eval()


__all__ = ["check_fits", "checkpoint_model", "checkpoint_state_dict", "export_dcp_to_hf", "hf_folder_args", "hf_model_from_config", "import_hf_to_dcp",
           "load_model", "write_dcp_model"]
