"""Checkpoint formats on disk: what the manager (manager.py) and the converters (hf.py) share.

Three kinds of checkpoint folder exist:

* a full DCP checkpoint written by CheckpointManager: keys ``model.<fqn>``,
  ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*``, ``rng.*``, ``train_state.*``;
* a model-only DCP checkpoint (seed checkpoints, ``last_save_model_only`` exports,
  ``convert_hf_to_dcp``): the model's FQNs at the top level, as torchtitan writes them;
* a Hugging Face folder: ``config.json``, ``model-0000i-of-0000n.safetensors``,
  ``model.safetensors.index.json``, ``generation_config.json``.

The DCP kinds carry a ``titanlike.json`` sidecar naming the model family and its args
(``args.to_dict()``), so a checkpoint can be turned into a model without the job's config.
A checkpoint folder holds published ``step-N`` folders; ``step-N.tmp`` (a save in flight)
and ``step-N.purge`` (being deleted) are never read.

Everything here runs in one process on full (unsharded) tensors, and talks to a model family
only through its ModelSpec and the BaseModelArgs contract. manager.py and hf.py import this
module and never each other.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

SIDECAR = "titanlike.json"
DCP_METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
FORMAT_VERSION = 1
MODEL_PREFIX = "model."
# A full checkpoint always has this key; a model-only one never does.
FULL_MARKER = "train_state.step"
# Published step folders; a save in flight and a folder being deleted carry these suffixes.
STEP_RE = re.compile(r"step-(\d+)")
TMP_SUFFIX, PURGE_SUFFIX = ".tmp", ".purge"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or key."""


def step_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def published_steps(folder: str) -> list[int]:
    """Steps of the published checkpoints in folder, ascending (in-flight .tmp ones excluded)."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(folder)
                  if (m := STEP_RE.fullmatch(name)) and os.path.isdir(os.path.join(folder, name)))


# Sidecar ----------------------------------------------------------------------------------


def model_description(name: str, args: Any, *, context_len: int | None = None) -> dict[str, Any]:
    """What load_model needs to rebuild the model: family name and its args (``args.to_dict()``).

    context_len replaces the args' context length: a job's args carry training.seq_len, which
    only sizes position tables (the weights do not depend on it); the sidecar records the
    flavor's real context instead.
    """
    if context_len is not None:
        args = args.with_context_len(context_len)
    return {"name": name, "args": args.to_dict()}


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


def build_args(description: dict[str, Any], *, where: str = SIDECAR):
    """(ModelSpec, args) from a sidecar's "model" entry; `where` names it in errors."""
    from titanlike.models.registry import get_model_spec

    try:
        name, fields = description["name"], description["args"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: the model entry needs a name and args") from None
    try:
        spec = get_model_spec(name)
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0] if e.args else e}") from None
    try:
        args = spec.args_cls.from_dict(fields)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{where}: the args do not fit model {spec.name}: {e}") from None
    return spec, args


# Recognizing folders ----------------------------------------------------------------------


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, HF_CONFIG)) and (
        os.path.isfile(os.path.join(path, HF_INDEX))
        or any(n.endswith(".safetensors") for n in os.listdir(path))
    )


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_METADATA))


def resolve_checkpoint_folder(path: str) -> str:
    """A checkpoint folder itself, or the latest step-N inside a checkpoint.folder."""
    if is_dcp_folder(path) or is_hf_folder(path):
        return path
    if os.path.isdir(path):
        steps = published_steps(path)
        if steps:
            return step_folder(path, steps[-1])
    raise CheckpointError(
        f"{path} is neither a DCP checkpoint (no {DCP_METADATA}), a Hugging Face folder "
        f"({HF_CONFIG} + *.safetensors) nor a folder of step-N checkpoints"
    )


# DCP reading ------------------------------------------------------------------------------


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
    try:
        dcp.load(template, checkpoint_id=path, no_dist=True)
    except BaseException as e:  # CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading checkpoint {path} failed: {summarize(e)}") from None
    return {fqn: (template[key] if dtype is None else template[key].to(dtype)) for fqn, key in names.items()}


def summarize(e: BaseException) -> str:
    """One line from a DCP CheckpointException (which carries every failing rank's traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (exc, _trace) = next(iter(sorted(failures.items())))
        more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
        return f"rank {rank}: {type(exc).__name__}: {exc}{more}"
    return f"{type(e).__name__}: {e}"


# Tied weights -----------------------------------------------------------------------------


def drop_aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first key of every tensor object (tied weights are one tensor under two names)."""
    seen: set[int] = set()
    out = {}
    for key, value in state_dict.items():
        if id(value) not in seen:
            seen.add(id(value))
            out[key] = value
    return out


def tied_aliases(module: nn.Module) -> set[str]:
    """Names of parameters that are another name's Parameter (tied embeddings' output.weight).

    Decided from the module structure (Parameter identity, so it holds for any family and for a
    pipeline stage that lacks one end), so every rank drops the same keys whatever its shards.
    """
    from titanlike.models.common.init import canonical_fqn

    first: dict[int, str] = {}
    aliases = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        name = canonical_fqn(name)
        if first.setdefault(id(param), name) != name:
            aliases.add(name)
    return aliases


# Hugging Face folders ---------------------------------------------------------------------


def read_hf(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict with HF names, config.json) of a Hugging Face safetensors folder."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    config_path = os.path.join(path, HF_CONFIG)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path} is not a Hugging Face model folder: {HF_CONFIG} is missing")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path} is damaged: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object")
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
    """Write our full state dict as a Hugging Face folder loadable by transformers.

    context_len becomes config.json's max_position_embeddings (default: the args' own).
    """
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if spec.hf_adapter is None:
        raise CheckpointError(f"model {spec.name} has no Hugging Face adapter")
    hf_sd = spec.hf_adapter.to_hf_state_dict(state_dict, args)
    # Contiguous: converted tensors may be views (permuted rows), and safetensors stores raw storage.
    hf_sd = {k: v.to(dtype).contiguous() for k, v in hf_sd.items()}
    os.makedirs(out, exist_ok=True)
    writer = HuggingFaceStorageWriter(out, fqn_to_index_mapping=_shard_plan(hf_sd, max_shard_bytes))
    try:
        dcp.save(hf_sd, storage_writer=writer, no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing Hugging Face checkpoint {out} failed: {summarize(e)}") from None
    config = args.to_hf_config(max_position_embeddings=context_len)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    generation = {"_from_model_config": True}
    for name, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if value is not None:
            config[name] = generation[name] = int(value)
    for name, content in ((HF_CONFIG, config), ("generation_config.json", generation)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2)
