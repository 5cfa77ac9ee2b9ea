"""Checkpoint formats on disk, and the Hugging Face interchange.

Three kinds of checkpoint folder exist:

* a full DCP checkpoint written by CheckpointManager: keys ``model.<fqn>``,
  ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*``, ``rng.*``, ``train_state.*``;
* a model-only DCP checkpoint (seed checkpoints, ``last_save_model_only`` exports,
  ``convert_hf_to_dcp``): the model's FQNs at the top level, as torchtitan writes them;
* a Hugging Face folder: ``config.json``, ``model-0000i-of-0000n.safetensors``,
  ``model.safetensors.index.json``, ``generation_config.json``.

The DCP kinds carry a ``titanlike.json`` sidecar naming the model family and its
arguments, so a checkpoint can be turned into a model without the job's config.
Everything here runs in one process on full (unsharded) tensors; the manager calls
it on rank 0 only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

SIDECAR = "titanlike.json"
DCP_METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
FORMAT_VERSION = 1
MODEL_PREFIX = "model."
# A full checkpoint always has this key; a model-only one never does.
FULL_MARKER = "train_state.step"

# Hugging Face `model_type` -> our model family.
_HF_MODEL_TYPES = {"llama": "llama3"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or key."""


# Sidecar ----------------------------------------------------------------------------------


def model_description(name: str, args: Any, *, context_len: int | None = None) -> dict[str, Any]:
    """What load_model needs to rebuild the model: family name and its args.

    context_len replaces args.max_seq_len (the trainer sets it to training.seq_len, which
    only sizes the RoPE table; the weights do not depend on it).
    """
    fields = dataclasses.asdict(args)
    if context_len is not None and "max_seq_len" in fields:
        fields["max_seq_len"] = context_len
    return {"name": name, "args": fields}


def write_sidecar(folder: str, info: dict[str, Any]) -> None:
    with open(os.path.join(folder, SIDECAR), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **info}, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def read_sidecar(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, SIDECAR)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is damaged: {e}") from None


def build_args(description: dict[str, Any]):
    """(ModelSpec, args) from a sidecar's "model" entry."""
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(description["name"])
    args_cls = type(next(iter(spec.flavors.values())))
    return spec, args_cls(**description["args"])


# DCP reading ------------------------------------------------------------------------------


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and (
        os.path.isfile(os.path.join(path, HF_INDEX))
        or any(n.endswith(".safetensors") for n in os.listdir(path))
    )


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_METADATA))


def read_dcp_metadata(path: str) -> Metadata:
    """The checkpoint's index, or a CheckpointError naming what is wrong with it."""
    meta_path = os.path.join(path, DCP_METADATA)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not os.path.isfile(meta_path):
        raise CheckpointError(
            f"checkpoint {path} has no {DCP_METADATA} file: it is incomplete or not a DCP checkpoint"
        )
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # unpickling garbage raises anything from EOFError to UnpicklingError
        raise CheckpointError(f"checkpoint index {meta_path} is damaged ({type(e).__name__}: {e})") from None


def check_dcp_files(path: str, metadata: Metadata) -> None:
    """Every data file the index points into exists and is long enough.

    DCP would otherwise fail deep inside a read (or on another rank) with an error that
    names neither the file nor the checkpoint.
    """
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint file {file} is missing (named in {DCP_METADATA})")
        size = os.path.getsize(file)
        if size < end:
            raise CheckpointError(
                f"checkpoint file {file} is truncated: {size} bytes, but {DCP_METADATA} needs {end}"
            )


def dcp_model_keys(metadata: Metadata) -> tuple[dict[str, str], bool]:
    """Map our FQN -> key in the checkpoint, and whether it is a full (resumable) checkpoint."""
    keys = metadata.state_dict_metadata
    full = FULL_MARKER in keys
    out = {}
    for key, md in keys.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        if full:
            if key.startswith(MODEL_PREFIX):
                out[key[len(MODEL_PREFIX):]] = key
        else:
            out[key] = key
    return out, full


def read_dcp_model(path: str, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's full tensors from a full or model-only DCP checkpoint, in one process."""
    metadata = read_dcp_metadata(path)
    check_dcp_files(path, metadata)
    names, _ = dcp_model_keys(metadata)
    if not names:
        raise CheckpointError(f"checkpoint {path} holds no model tensors")
    template = {}
    for fqn, key in names.items():
        md = metadata.state_dict_metadata[key]
        template[key] = torch.empty(md.size, dtype=md.properties.dtype)
    _dcp_load(template, path, no_dist=True)
    return {fqn: (template[key] if dtype is None else template[key].to(dtype)) for fqn, key in names.items()}


def _dcp_load(state_dict: dict, path: str, **kwargs) -> None:
    try:
        dcp.load(state_dict, checkpoint_id=path, **kwargs)
    except BaseException as e:  # CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading checkpoint {path} failed: {summarize(e)}") from None


def summarize(e: BaseException) -> str:
    """One line from a DCP CheckpointException (which carries every failing rank's traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (exc, _trace) = next(iter(sorted(failures.items())))
        more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
        return f"rank {rank}: {type(exc).__name__}: {exc}{more}"
    return f"{type(e).__name__}: {e}"


def drop_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first key of every tensor object (tied weights are one tensor under two names)."""
    seen: set[int] = set()
    out = {}
    for key, value in state_dict.items():
        if id(value) not in seen:
            seen.add(id(value))
            out[key] = value
    return out


def write_dcp_model(state_dict: dict[str, torch.Tensor], out: str, info: dict[str, Any]) -> None:
    """A model-only DCP checkpoint (plus sidecar) from full tensors, in one process."""
    os.makedirs(out, exist_ok=True)
    try:
        dcp.save(drop_aliases(state_dict), checkpoint_id=out, no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing checkpoint {out} failed: {summarize(e)}") from None
    write_sidecar(out, info)


# Hugging Face -----------------------------------------------------------------------------


def read_hf(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict with HF names, config.json) of a Hugging Face safetensors folder."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path} is not a Hugging Face model folder: config.json is missing")
    with open(config_path) as f:
        config = json.load(f)
    reader = HuggingFaceStorageReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"cannot read the safetensors files in {path}: {type(e).__name__}: {e}") from None
    template = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    if not template:
        raise CheckpointError(f"{path} holds no safetensors tensors")
    try:
        dcp.load(template, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading Hugging Face checkpoint {path} failed: {summarize(e)}") from None
    return template, config


def hf_model_from_config(config: dict[str, Any]):
    """(ModelSpec, args) for a Hugging Face config.json."""
    from titanlike.models.registry import get_model_spec

    family = _HF_MODEL_TYPES.get(config.get("model_type"))
    if family is None:
        raise CheckpointError(
            f"Hugging Face model_type {config.get('model_type')!r} is not supported; "
            f"supported: {', '.join(_HF_MODEL_TYPES)}"
        )
    spec = get_model_spec(family)
    return spec, spec.hf_adapter.args_from_hf_config(config)


def _shard_plan(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, int]:
    """Key -> 1-based file index, filling files in key order up to max_shard_bytes."""
    plan, index, used = {}, 1, 0
    for key, t in state_dict.items():
        size = t.numel() * t.element_size()
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        plan[key] = index
        used += size
    return plan


def write_hf(
    state_dict: dict[str, torch.Tensor],
    spec,
    args,
    out: str,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 1024**3,
    context_len: int | None = None,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> None:
    """Write our full state dict as a Hugging Face folder loadable by transformers."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if spec.hf_adapter is None:
        raise CheckpointError(f"model {spec.name} has no Hugging Face adapter")
    hf_sd = spec.hf_adapter.to_hf_state_dict(state_dict, args)
    # Contiguous: the permuted q/k projections are views, and safetensors stores raw storage.
    hf_sd = {k: v.to(dtype).contiguous() for k, v in hf_sd.items()}
    os.makedirs(out, exist_ok=True)
    writer = HuggingFaceStorageWriter(out, fqn_to_index_mapping=_shard_plan(hf_sd, max_shard_bytes))
    try:
        dcp.save(hf_sd, storage_writer=writer, no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing Hugging Face checkpoint {out} failed: {summarize(e)}") from None
    config = spec.hf_adapter.args_to_hf_config(args, max_position_embeddings=context_len)
    dtype_name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = dtype_name
    generation = {"_from_model_config": True}
    for name, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if value is not None:
            config[name] = generation[name] = int(value)
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2)


def export_dcp_to_hf(src: str, out: str, *, dtype: torch.dtype = torch.float32,
                     max_shard_bytes: int = 5 * 1024**3, description: dict | None = None) -> None:
    """convert_dcp_to_hf: a titanlike DCP checkpoint (full or model-only) -> Hugging Face folder."""
    info = read_sidecar(src) or {}
    description = description or info.get("model")
    if description is None:
        raise CheckpointError(
            f"{src} has no {SIDECAR} naming the model; pass the model family and flavor explicitly"
        )
    spec, args = build_args(description)
    state_dict = read_dcp_model(src)
    tokenizer = info.get("tokenizer", {})
    write_hf(state_dict, spec, args, out, dtype=dtype, max_shard_bytes=max_shard_bytes,
             context_len=args.max_seq_len, bos_id=tokenizer.get("bos_id"), eos_id=tokenizer.get("eos_id"))


def import_hf_to_dcp(src: str, out: str, *, dtype: torch.dtype | None = None) -> None:
    """convert_hf_to_dcp: a Hugging Face folder -> model-only DCP checkpoint with sidecar."""
    hf_sd, config = read_hf(src)
    spec, args = hf_model_from_config(config)
    state_dict = spec.hf_adapter.from_hf_state_dict(hf_sd, args)
    # Same keys as the trainer saves: a tied weight once, under its first name.
    state_dict = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in state_dict.items()}
    info = {
        "contents": "model_only",
        "step": 0,
        "model": model_description(spec.name, args),
        "tokenizer": {k: config[h] for k, h in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"))
                      if isinstance(config.get(h), int)},
        "source": os.path.abspath(src),
    }
    write_dcp_model(state_dict, out, info)


# load_model -------------------------------------------------------------------------------


def resolve_checkpoint_folder(path: str) -> str:
    """A checkpoint folder itself, or the latest step-N inside a checkpoint.folder."""
    if is_dcp_folder(path) or is_hf_folder(path):
        return path
    if os.path.isdir(path):
        from titanlike.checkpoint.manager import published_steps

        steps = published_steps(path)
        if steps:
            return os.path.join(path, f"step-{steps[-1]}")
    raise CheckpointError(
        f"{path} is neither a DCP checkpoint (no {DCP_METADATA}), a Hugging Face folder "
        "(config.json + *.safetensors) nor a folder of step-N checkpoints"
    )


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
    if is_dcp_folder(folder):
        info = read_sidecar(folder)
        if info is None or "model" not in info:
            raise CheckpointError(f"{folder} has no {SIDECAR} naming the model it holds")
        spec, args = build_args(info["model"])
        state_dict = read_dcp_model(folder, dtype=dtype)
    else:
        hf_sd, config = read_hf(folder)
        spec, args = hf_model_from_config(config)
        state_dict = spec.hf_adapter.from_hf_state_dict(hf_sd, args)
        if dtype is not None:
            state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    # init_weights also rebuilds the non-persistent buffers (the RoPE table, in float32);
    # the random weights it draws are all overwritten below, and the key check proves it.
    model.init_weights(seed=0)
    from titanlike.checkpoint.manager import tied_aliases

    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if k not in tied_aliases(model)]
    if missing or unexpected:
        raise CheckpointError(
            f"{folder} does not match model {spec.name}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.eval()
