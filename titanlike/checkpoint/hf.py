"""Hugging Face interchange and load_model: DCP checkpoint <-> Hugging Face folder, and a
checkpoint of either kind -> an unsharded model.

Hugging Face folders are read and written here (config.json, safetensors); the DCP formats
(sidecar, index checks, checksums) live in format.py. A family is found from a config.json's model_type with
registry.spec_for_hf_model_type and speaks through its spec's Hugging Face adapter, spec.hf
(config_to_args / args_to_config, to_hf_state_dict / from_hf_state_dict, token_ids); nothing here
reads a family's fields. Everything runs in one process on full (unsharded) tensors.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Sequence

import torch

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlike.checkpoint.format import (
    HF_CONFIG,
    HF_INDEX,
    SIDECAR,
    CheckpointError,
    NoPickleLoadPlanner,
    build_args,
    check_fits,
    check_model_size,
    dcp_save,
    drop_aliases,
    is_dcp_folder,
    model_description,
    read_dcp_model,
    read_sidecar,
    resolve_checkpoint_folder,
    single_process_dcp,
    summarize,
    verify_checksums,
    write_sidecar,
)
from titanlike.models.load_hooks import merged
from titanlike.data.hf_tokenizer import stored_tokenizer
from titanlike.models import protocol
from titanlike.models.common.init import buffers_only

if TYPE_CHECKING:
    from titanlike.data.hf_tokenizer import TokenizerExport


# Hugging Face folders ---------------------------------------------------------------------


def read_hf_config(path: str) -> dict[str, Any]:
    """A Hugging Face folder's config.json (a JSON object), or one sentence naming what is wrong."""
    config_path = os.path.join(path, HF_CONFIG)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path} is not a Hugging Face model folder: {HF_CONFIG} is missing")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{config_path} is damaged: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object")
    return config


def hf_tensor_names(path: str) -> set[str]:
    """The tensor names a Hugging Face safetensors folder holds, from the files' headers (no tensor is read)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        metadata = HuggingFaceStorageReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"cannot read the safetensors files in {path}: {type(e).__name__}: {e}") from None
    return {key for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def read_hf(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict with HF names, config.json) of a Hugging Face safetensors folder."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    config = read_hf_config(path)
    problem = verify_checksums(path)  # titanlike's own exports record checksums in a sidecar
    if problem:
        raise CheckpointError(problem)
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
        with single_process_dcp():
            dcp.load(template, storage_reader=HuggingFaceStorageReader(path), planner=NoPickleLoadPlanner(),
                     no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading Hugging Face checkpoint {path} failed: {summarize(e)}") from None
    return template, config


def _unlist(out: str, names: set[str], file_name: str) -> None:
    """Move the file holding `names` (written alone) to file_name and drop them from the index."""
    index_path = os.path.join(out, HF_INDEX)
    with open(index_path) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    (written,) = {weight_map.pop(name) for name in names}
    os.replace(os.path.join(out, written), os.path.join(out, file_name))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


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
    pad_id: int | None = None,
    tokenizer_path: str | None = None,
    tokenizer_fingerprint: str | None = None,
    chat_template: str | None = None,
    end_of_turn_ids: Sequence[int] | None = None,
) -> TokenizerExport:
    """Write our full state dict as a Hugging Face folder loadable by transformers.

    context_len becomes config.json's max_position_embeddings (default: the args' own). bos_id, eos_id
    and pad_id become the config.json token ids the family's adapter writes (spec.hf.token_ids).
    tokenizer_path: the job's tokenizer, written as tokenizer.json + tokenizer_config.json (or
    copied with a note when it cannot be converted; see titanlike.data.hf_tokenizer), checked
    against tokenizer_fingerprint when given. Returns that step's TokenizerExport, whose message
    the caller logs: a folder without a usable tokenizer is still a valid export.
    chat_template, end_of_turn_ids: the Jinja template the job rendered conversations with and the
    tokens that end its turns (the checkpoint's tokenizer record, data/hf_tokenizer.py
    tokenizer_record): written as tokenizer_config.json's chat_template, and generation_config.json
    stops at EOS and at those (eos_token_id a list, EOS first), so that transformers' apply_chat_template
    renders what training rendered and its generate ends with the turn.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from titanlike.data.hf_tokenizer import write_hf_tokenizer

    if spec.hf is None:
        raise CheckpointError(f"model {spec.name} has no Hugging Face adapter")
    hf_sd = spec.hf.to_hf_state_dict(state_dict, args)
    config = spec.hf.args_to_config(args, max_position_embeddings=context_len)
    stops = [i for i in end_of_turn_ids or () if i != eos_id]
    pad_token = None
    if args.has_score_head:  # a reward model: transformers finds each sequence's score by the pad id
        try:
            hf_sd, config = spec.hf.score_model(hf_sd, config)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        pad, pad_token = _score_pad(pad_id, bos_id, eos_id, stops, tokenizer_path, chat_template)
        if pad is not None:
            config["pad_token_id"] = pad
    # Contiguous: converted tensors may be views (permuted rows), and safetensors stores raw storage.
    hf_sd = {k: v.to(dtype).contiguous() for k, v in hf_sd.items()}
    os.makedirs(out, exist_ok=True)
    unlisted_file, unlisted = spec.hf.unlisted_tensors(list(hf_sd), args)
    plan = _shard_plan({k: v for k, v in hf_sd.items() if k not in unlisted}, max_shard_bytes)
    if unlisted:  # one more file, renamed and left out of the index below
        plan.update({k: max(plan.values(), default=0) + 1 for k in unlisted})
    writer = HuggingFaceStorageWriter(out, fqn_to_index_mapping=plan)
    try:
        with single_process_dcp():
            dcp.save(hf_sd, storage_writer=writer, no_dist=True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing Hugging Face checkpoint {out} failed: {summarize(e)}") from None
    if unlisted:
        _unlist(out, unlisted, unlisted_file)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    generation = {"_from_model_config": True}
    for name, value in spec.hf.token_ids(bos=bos_id, eos=eos_id, pad=pad_id).items():
        config[name] = generation[name] = value
    if stops and generation.get("eos_token_id") is not None:
        # transformers' generate stops at any id of the list (Meta's Llama 3 Instruct folders: EOS, then eot).
        generation["eos_token_id"] = [generation["eos_token_id"], *stops]
    for name, content in ((HF_CONFIG, config), ("generation_config.json", generation)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2)
    export = write_hf_tokenizer(out, tokenizer_path, fingerprint=tokenizer_fingerprint, vocab_size=args.vocab_size,
                                model_max_length=context_len or args.context_len,
                                template=spec.hf.tokenizer_template, roles=spec.hf.tokenizer_roles)
    files = dict(spec.hf.extra_files(args, _special_tokens(tokenizer_path) if export.converted else {}))
    if spec.images is not None:  # a vision-language model: its image processor, as transformers configures it
        from titanlike.data.images import ImageProcessor

        inputs = spec.images(args)
        image = ImageProcessor.of_tower(inputs.processor, inputs.image_size).hf_config(inputs.processor)
        files["preprocessor_config.json"] = {**image, **files.get("preprocessor_config.json", {})}
    for name, content in files.items():
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2)
    entries = {"chat_template": chat_template, "pad_token": pad_token}
    config_path = os.path.join(out, "tokenizer_config.json")
    if export.converted and os.path.isfile(config_path) and any(v is not None for v in entries.values()):
        with open(config_path, encoding="utf-8") as f:
            tokenizer_config = json.load(f)
        tokenizer_config.update({k: v for k, v in entries.items() if v is not None})
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return export


def _score_pad(pad_id: int | None, bos_id: int | None, eos_id: int | None, stops: Sequence[int],
               tokenizer_path: str | None, chat_template: str | None) -> tuple[int | None, str | None]:
    """(pad_token_id, its token or None) of a reward model's export. transformers' ...ForSequenceClassification
    scores a sequence at its last token that is not the pad id, and ours scores it at its last token:
    the pad must be a token no scored sequence ends with, so not EOS, an end-of-turn token or one the
    chat template writes. The tokenizer's pad token when it is none of those, else the highest special
    token of the tokenizer that is none of them (named as tokenizer_config.json's pad_token too), else
    what training padded with (objectives/sft.py pad_id: the pad token, or EOS)."""
    taken = {i for i in (bos_id, eos_id, *stops) if i is not None}
    if pad_id is not None and pad_id not in taken:
        return pad_id, None
    specials = _special_tokens(tokenizer_path)
    free = [(i, token) for token, i in specials.items()
            if i not in taken and not (chat_template and token in chat_template)]
    if free:
        return max(free)
    return (pad_id if pad_id is not None else eos_id), None


def _special_tokens(tokenizer_path: str | None) -> dict[str, int]:
    """The special tokens (string -> id) of the tokenizer at tokenizer_path; {} when it cannot be read."""
    from titanlike.data.tokenizer import Tokenizer, build_tokenizer

    if not tokenizer_path:
        return {}
    try:
        tokenizer = build_tokenizer(tokenizer_path)
    except (ImportError, OSError, ValueError):
        return {}
    if isinstance(tokenizer, Tokenizer):  # tiktoken: Llama 3's 256 slots
        return dict(tokenizer.special_tokens)
    added = tokenizer.model.get_added_tokens_decoder()
    return {token.content: i for i, token in added.items() if token.special}


def hf_model_from_config(config: dict[str, Any], *, where: str = HF_CONFIG):
    """(ModelSpec, args) for a Hugging Face config.json; `where` names it in errors."""
    from titanlike.models.registry import spec_for_hf_model_type

    try:
        spec = spec_for_hf_model_type(config.get("model_type"))
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0] if e.args else e}") from None
    try:
        args = spec.hf.read_config(config)  # every value it reads checked first
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return spec, args


def hf_folder_args(folder: str, spec=None):
    """The model a Hugging Face folder holds, of any size: (ModelSpec, args) from its config.json,
    read by the family's adapter (every value it reads checked, HFAdapter.read_config) and fitted to
    the tensors the folder holds (HFAdapter.args_for_weights: a DeepSeek-V3 folder saved by
    transformers, without its multi-token-prediction layer, is the model without it). `spec`: the
    family the caller trains (model.name); a folder of another family is refused by name.
    CheckpointError, one sentence naming the file, for anything else. Nothing is allocated: the
    caller checks the size (check_model_size) before building the model."""
    where = os.path.join(folder, HF_CONFIG)
    config = read_hf_config(folder)
    if spec is not None and spec.hf is None:
        raise CheckpointError(f"model {spec.name} has no Hugging Face adapter, so it cannot read {folder}")
    if spec is not None and config.get("model_type") not in spec.hf.model_types:
        raise CheckpointError(
            f"{where} has model_type={json.dumps(config.get('model_type'))[:40]} but model {spec.name} reads "
            f"{' or '.join(spec.hf.model_types)}; set model.name to the folder's family")
    spec, args = hf_model_from_config(config, where=where)
    try:
        args = spec.hf.args_for_weights(args, hf_tensor_names(folder))
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    return spec, args


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
    sidecar names. Returns the tokenizer step's TokenizerExport (see write_hf).
    """
    info = read_sidecar(src) or {}
    description = description or info.get("model")
    if description is None:
        raise CheckpointError(
            f"{src} has no {SIDECAR} naming the model; pass the model family and flavor explicitly"
        )
    spec, args = build_args(description, where=os.path.join(src, SIDECAR))
    check_model_size(args, os.path.join(src, SIDECAR))
    state_dict = merged(read_dcp_model(src))
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
                      tokenizer_fingerprint=fingerprint if isinstance(fingerprint, str) else None,
                      **_chat_record(tokenizer, args.vocab_size, src))
    if why_not and not tokenizer_path:
        export = export._replace(message=f"no tokenizer files written: {why_not}")
    return export


def _chat_record(record: dict, vocab_size: int, src: str) -> dict[str, Any]:
    """write_hf's chat_template and end_of_turn_ids from the sidecar's tokenizer entry (tokenizer_record),
    each checked: a string, and token ids of the vocabulary."""
    template, stops = record.get("chat_template"), record.get("end_of_turn_ids")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{os.path.join(src, SIDECAR)}: tokenizer chat_template is not a string")
    if stops is not None and not (isinstance(stops, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in stops)):
        raise CheckpointError(f"{os.path.join(src, SIDECAR)}: tokenizer end_of_turn_ids is {json.dumps(stops)[:50]}, "
                              f"not a list of token ids below the model's vocabulary size {vocab_size}")
    return {"chat_template": template, "end_of_turn_ids": stops}


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
    """The adapter's conversion of a Hugging Face state dict (a sequence-classification model's: a reward
    model, args with a score head); one sentence when it does not fit."""
    if args.has_score_head:
        hf_sd = spec.hf.unscore_model(hf_sd)
    try:
        return spec.hf.from_hf_state_dict(hf_sd, args)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"Hugging Face checkpoint {src} does not match its {HF_CONFIG}: {e}") from None
    except Exception as e:  # a tensor of the wrong rank or size for the conversion's reshapes
        raise CheckpointError(f"Hugging Face checkpoint {src} does not match its {HF_CONFIG} "
                              f"({type(e).__name__}: {e})") from None


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
    """The full tensors of checkpoint_model's folder in our names (merged by the registered load hooks:
    a LoRA checkpoint's adapters folded in), checked
    against the model (check_fits)."""
    if is_dcp_folder(folder):
        state_dict = merged(read_dcp_model(folder))
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
        state_dict = merged(read_dcp_model(folder, dtype=dtype))
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


__all__ = ["check_fits", "checkpoint_model", "checkpoint_state_dict", "export_dcp_to_hf", "hf_folder_args",
           "hf_model_from_config", "hf_tensor_names", "import_hf_to_dcp", "load_model", "read_hf", "read_hf_config",
           "write_dcp_model", "write_hf"]
