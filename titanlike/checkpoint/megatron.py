"""Megatron-LM checkpoints -> a model-only titanlike DCP checkpoint (`titanlike-convert from-megatron`).

A Megatron-LM `--save` folder holds `latest_checkpointed_iteration.txt` (an iteration or `release`) and
`iter_0000100/` (or `release/`), in one of two formats:

* torch_dist (`--ckpt-format torch_dist`, the default): a torch.distributed.checkpoint folder (plus
  megatron-core's `common.pt`, the non-tensor state with Megatron-LM's args, and `metadata.json`) whose keys
  are megatron-core's sharded keys, the layers stacked on a first dimension
  (`decoder.layers.mlp.linear_fc2.weight`: layers x hidden x ffn), optimizer state under `optimizer.`. Its
  index is read by format.py's allow-list unpickler, its tensors by DCP; pickled entries (RNG states) are
  never read.
* torch (`--ckpt-format torch`): `mp_rank_TT/model_optim_rng.pt`, or `mp_rank_TT_PPP/` under pipeline
  parallelism, one torch.save pickle per tensor- and pipeline-parallel rank whose `model` entry is that
  rank's state dict, layers numbered from 0 on every stage. The ranks are merged as megatron-core
  partitions them (models/common/megatron.py).

A pickle (model_optim_rng.pt, common.pt) is read by torch's weights-only unpickler. Of what Megatron-LM
pickles beside the tensors, its `args` (an argparse.Namespace) are read; the megatron-core enums among them
and NumPy's RNG state become inert placeholders that run nothing (`_PLACEHOLDERS`); any other global refuses
the file before unpickling it. The args' settings that no shape shows (RMSNorm epsilon, RoPE base, the
family's own such as RoPE scaling) must agree with the flavor's (`check_settings`).

The family's MegatronAdapter (spec.megatron) renames the full tensors; the flavor gives the dimensions and
the checkpoint the vocabulary (Megatron pads it to a multiple of 128 x TP; `true_vocab_size` keeps the
tokenizer's ids only, as Megatron-LM's own converter does). Everything runs in one process and holds the
whole model in host memory.

What does not convert, refused by name: legacy files of expert-parallel runs (`mp_rank_TT_PPP_EEE`) and of
virtual pipeline stages (`model0`, `model1`, ...), and megatron-core's multi-token-prediction layers (`mtp.*`):
megatron-core's TransformerBlock applies its final norm before them (has_final_layernorm_in_this_stage), so their
hnorm reads normalized states where DeepSeek-V3's (models/common/mtp.py) reads the residual stream. Into a flavor
without multi-token prediction they are left out: the trunk's logits do not depend on them.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import zipfile
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanlike.checkpoint.format import (
    CheckpointError,
    check_dcp_files,
    check_fits,
    check_model_size,
    load_into,
    model_description,
    read_dcp_metadata,
)
from titanlike.checkpoint.hf import write_dcp_model
from titanlike.models.common.megatron import (
    LAYERS,
    canonical_name,
    is_extra_state,
    merge_tp,
    split_layer,
    stack_experts,
    ungroup_experts,
)

TRACKER = "latest_checkpointed_iteration.txt"
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
MTP = "mtp."  # megatron-core GPTModel's multi-token-prediction block
COMMON = "common.pt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


# Finding the iteration ------------------------------------------------------------------------


def iteration_folder(src: str) -> str:
    """The folder of the iteration a Megatron-LM --save folder's tracker file names (or `src` itself when it is
    an iteration folder); CheckpointError naming the file otherwise."""
    if not os.path.isdir(src):
        raise CheckpointError(f"Megatron checkpoint folder {src} does not exist")
    if _format(src) is not None:
        return src
    tracker = os.path.join(src, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{src} is not a Megatron-LM checkpoint folder: it has no {TRACKER} and no "
                              "model_optim_rng.pt or torch_dist files")
    with open(tracker, "rb") as f:
        text = f.read(64).decode("utf-8", "replace").strip()
    if text == "release":
        folder = os.path.join(src, "release")
    elif text.isdigit() and len(text) <= 12:
        folder = os.path.join(src, f"iter_{int(text):07d}")
    else:
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{tracker} names iteration {text}, but {folder} does not exist")
    if _format(folder) is None:
        raise CheckpointError(f"{folder} holds neither a torch_dist checkpoint (.metadata) nor "
                              f"mp_rank_*/{LEGACY_FILE} files")
    return folder


def _format(folder: str) -> str | None:
    if os.path.isfile(os.path.join(folder, ".metadata")):
        return "torch_dist"
    if any(_RANK_DIR.fullmatch(n) for n in os.listdir(folder)):
        return "torch"
    return None


# torch_dist -----------------------------------------------------------------------------------


def torch_dist_index(folder: str) -> dict[str, TensorStorageMetadata]:
    """The model's tensors a torch_dist folder's index lists (its optimizer state and pickled entries left
    out), its data files checked to exist and be long enough; nothing is read yet."""
    metadata = read_dcp_metadata(folder)
    check_dcp_files(folder, metadata)
    index = {key: md for key, md in metadata.state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata) and not key.startswith("optimizer.") and not is_extra_state(key)}
    if not index:
        raise CheckpointError(f"torch_dist checkpoint {folder} holds no model tensors")
    return index


def read_torch_dist(folder: str, index: Mapping[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """The tensors of torch_dist_index's `index`, per layer, in canonical megatron-core names."""
    template = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in index.items()}
    load_into(template, folder, f"torch_dist checkpoint {folder}")
    out: dict[str, torch.Tensor] = {}
    for key, value in template.items():
        inner = key[len(LAYERS):] if key.startswith(LAYERS) else None
        if inner is not None and not inner.split(".", 1)[0].isdigit():
            # megatron-core stacks the layers' tensors under one key, the layer first.
            if value.dim() == 0:
                raise CheckpointError(f"torch_dist checkpoint {folder}: {key} holds no layer dimension")
            for i, layer in enumerate(value.unbind(0)):
                out[canonical_name(f"{LAYERS}{i}.{inner}")] = layer.contiguous()
        else:
            out[canonical_name(key)] = value
    return out


# torch (legacy) ------------------------------------------------------------------------------


class _Placeholder:
    """What a non-tensor global of a Megatron-LM pickle becomes: built from anything, holding nothing."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __setstate__(self, state: Any) -> None:
        pass


# Globals besides torch's own weights-only set that a Megatron-LM pickle (model_optim_rng.pt, torch_dist's
# common.pt) names: its args (an argparse.Namespace, a plain attribute bag, read: `check_settings`), the
# megatron-core enums among them and NumPy's RNG state, which become placeholders. (Transformer Engine's extra
# state is a uint8 tensor, skipped; an older release's pickled BytesIO is refused by name.)
_READ = {"argparse.Namespace": argparse.Namespace}
_PLACEHOLDERS = frozenset({
    "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
})
_PLACEHOLDER_MODULES = ("megatron.core.enums", "megatron.core.transformer.enums")


def _allowed(name: str) -> bool:
    return name in _READ or name in _PLACEHOLDERS or name.rsplit(".", 1)[0] in _PLACEHOLDER_MODULES


def safe_load(path: str) -> Any:
    """A torch.save file of Megatron-LM's, unpickled by torch's weights-only loader with `_allowed`'s globals
    only (checked before unpickling); CheckpointError naming the file otherwise."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a torch.save zip file (truncated or damaged?)")
    _check_entries(path)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    refused = sorted(name for name in unsafe if not _allowed(name))
    if refused:
        raise CheckpointError(f"{path} pickles {refused[0]}, which a Megatron-LM checkpoint does not hold; "
                              "refusing to unpickle it")
    allowed = [(_READ[name], name) if name in _READ else (_Placeholder, name) for name in unsafe]
    try:
        # mmap: the optimizer state beside the weights is mapped, never read.
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a damaged archive or a pickle the weights-only loader refuses
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {detail[:300]})") from None


def _check_entries(path: str) -> None:
    """Every entry of the zip lies inside the file: the tensors are memory-mapped, and reading a mapped page
    past the end of a file is a crash (SIGBUS), not an exception."""
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    for entry in entries:
        # A local header is 30 bytes, the name and the extra field; the data follows it.
        end = entry.header_offset + 30 + len(entry.filename.encode()) + len(entry.extra) + entry.compress_size
        if end > size:
            raise CheckpointError(f"{path} is truncated: its entry {entry.filename[:100]!r} ends at byte {end:,}, "
                                  f"past the file's {size:,}")


def megatron_args(state: Any) -> dict[str, Any]:
    """The settings Megatron-LM recorded in a checkpoint dict (its `args`), or {} when it holds none."""
    args = state.get("args") if isinstance(state, dict) else None
    return dict(vars(args)) if isinstance(args, argparse.Namespace) else {}


def load_legacy_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The `model` state dict of one model_optim_rng.pt (canonical names), and Megatron-LM's args in it."""
    state = safe_load(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not Megatron-LM's checkpoint dict")
    if "model" not in state:
        chunks = sorted(k for k in state if isinstance(k, str) and re.fullmatch(r"model\d+", k))
        if chunks:
            raise CheckpointError(f"{path} holds {len(chunks)} virtual pipeline chunks ({', '.join(chunks)}); "
                                  "only checkpoints saved without --num-layers-per-virtual-pipeline-stage convert")
        raise CheckpointError(f"{path} has no 'model' entry")
    model = state["model"]
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: its 'model' entry is a {type(model).__name__}, not a state dict")
    out = {}
    for key, value in model.items():
        if not isinstance(key, str) or is_extra_state(key):
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: model entry {key!r} is a {type(value).__name__}, not a tensor")
        out[canonical_name(key)] = value
    try:
        return ungroup_experts(out), megatron_args(state)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def read_legacy(folder: str, *, gated: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's full tensors from mp_rank_TT[_PPP]/model_optim_rng.pt: pipeline stages renumbered in order,
    tensor-parallel shards merged (gated: linear_fc1 holds [gate; up] on each rank); and the first rank's
    Megatron-LM args."""
    ranks: dict[tuple[int, int], str] = {}
    for name in os.listdir(folder):
        m = _RANK_DIR.fullmatch(name)
        if m and m.group(3) is not None:
            raise CheckpointError(f"{os.path.join(folder, name)} is an expert-parallel rank's folder; legacy "
                                  "checkpoints saved with --expert-model-parallel-size above 1 do not convert yet")
        if m:
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(folder, name, LEGACY_FILE)
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in ranks:
                want = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                raise CheckpointError(f"{folder} lacks {want}/{LEGACY_FILE} (it holds {tp} tensor- and {pp} "
                                      "pipeline-parallel ranks)")
    out: dict[str, torch.Tensor] = {}
    settings: dict[str, Any] = {}
    offset = 0
    for p in range(pp):
        stage = []
        for t in range(tp):
            model, args = load_legacy_file(ranks[(t, p)])
            stage.append(model)
            settings = settings or args
        for t in range(1, tp):
            if stage[t].keys() != stage[0].keys():
                diff = sorted(stage[0].keys() ^ stage[t].keys())[0]
                raise CheckpointError(f"{ranks[(t, p)]} and {ranks[(0, p)]} hold different parameters ({diff})")
        layers = {split_layer(k)[0] for k in stage[0] if split_layer(k)}
        for key in stage[0]:
            shards = [s[key] for s in stage]
            try:
                value = merge_tp(key, shards, gated=gated)
            except RuntimeError as e:
                raise CheckpointError(f"{ranks[(0, p)]}: the tensor-parallel shards of {key} do not join "
                                      f"({e})") from None
            parts = split_layer(key)
            name = f"{LAYERS}{offset + parts[0]}.{parts[1]}" if parts else key
            out.setdefault(name, value)
        offset += len(layers)
    try:
        return stack_experts(out), settings
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from None


# The conversion ---------------------------------------------------------------------------------


def import_megatron_to_dcp(src: str, out: str, model_name: str, flavor: str, *,
                           overrides: Mapping[str, Any] | None = None, true_vocab_size: int | None = None,
                           dtype: torch.dtype | None = None) -> str:
    """from-megatron: a Megatron-LM checkpoint -> model-only DCP checkpoint with sidecar, for `model_name`'s
    `flavor` changed by `overrides` ([model.args]: the family's field names or Megatron's, as train.py takes
    them) with the checkpoint's vocabulary, or its first `true_vocab_size` rows (Megatron pads the tokenizer's
    vocabulary; Megatron-LM's own converter calls the unpadded size --true-vocab-size). Returns the iteration
    folder read."""
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(model_name)
    if spec.megatron is None:
        raise ValueError(f"model {spec.name} has no Megatron-LM mapping; families with one: "
                         f"{', '.join(_families())}")
    if flavor not in spec.flavors:
        raise ValueError(f"model {spec.name} has no flavor {flavor!r}; flavors: {', '.join(spec.flavors)}")
    # A bad setting is refused (one sentence naming it) before any file is read.
    base = spec.flavors[flavor].with_overrides(overrides) if overrides else spec.flavors[flavor]
    folder = iteration_folder(src)
    if _format(folder) == "torch_dist":
        # The index declares the tensors' sizes: they are checked against the model before any is allocated.
        index = torch_dist_index(folder)
        args = _model_args(base, index.get(EMBEDDING) and tuple(index[EMBEDDING].size), folder, true_vocab_size)
        stored = sum(math.prod(md.size) for md in index.values())
        if stored > 2 * args.num_params():
            raise CheckpointError(f"{folder}: its index declares {stored:,} model values, more than twice the "
                                  f"{args.num_params():,} parameters of model {spec.name} flavor {flavor}; "
                                  "refusing to allocate them")
        megatron_sd = read_torch_dist(folder, index)
        common = os.path.join(folder, COMMON)  # megatron-core's non-tensor state, Megatron-LM's args among it
        settings = megatron_args(safe_load(common)) if os.path.exists(common) else {}
    else:
        megatron_sd, settings = read_legacy(folder, gated=spec.megatron.gated)
        embedding = megatron_sd.get(EMBEDDING)
        args = _model_args(base, None if embedding is None else tuple(embedding.shape), folder, true_vocab_size)
    mtp = sorted(k for k in megatron_sd if k.startswith(MTP))
    if mtp and args.lookahead_tokens:
        raise CheckpointError(f"{folder} holds multi-token-prediction layers ({mtp[0]}, ...), which do not convert: "
                              "megatron-core's read the trunk's output after its final norm, ours before it "
                              "(--model.args mtp_num_layers=0 converts the trunk alone)")
    for key in mtp:  # a flavor without multi-token prediction: the trunk computes the same logits without them
        del megatron_sd[key]
    problem = check_settings(settings, args, spec.megatron)
    if problem:
        raise CheckpointError(f"{folder} does not fit model {spec.name} flavor {flavor}: {problem}")
    if true_vocab_size is not None:  # the padding rows go: no token id reaches them
        megatron_sd.update({k: megatron_sd[k][:true_vocab_size] for k in (EMBEDDING, OUTPUT) if k in megatron_sd})
    try:
        state_dict = spec.megatron.to_ours(megatron_sd, args,
                                           rotary_interleaved=settings.get("rotary_interleaved") is True)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{folder} does not fit model {spec.name} flavor {flavor}: "
                              f"{e.args[0] if e.args else e}") from None
    except RuntimeError as e:  # a tensor whose size no reshape of the conversion takes
        raise CheckpointError(f"{folder} does not fit model {spec.name} flavor {flavor} ({e})") from None
    check_fits(state_dict, spec, args, f"{folder} (as {spec.name} flavor {flavor})")
    cast: dict[int, torch.Tensor] = {}  # by tensor: a tied weight stays one tensor under two names
    state_dict = {k: cast.setdefault(id(v), (v if dtype is None else v.to(dtype)).contiguous())
                  for k, v in state_dict.items()}
    info = {
        "contents": "model_only",
        "step": 0,
        # Sizes changed by [model.args] make args no flavor has: the sidecar records the args alone.
        "model": model_description(spec.name, args, flavor=None if overrides else flavor),
        "source": os.path.abspath(folder),
    }
    write_dcp_model(state_dict, out, info)
    return folder


# Megatron-LM's settings that change what the weights compute without changing their shapes, under the names
# [model.args] also takes (DecoderArgs.ARG_ALIASES); a family whose args have no such field skips it.
SETTINGS = ("norm_epsilon", "rotary_base")


def check_settings(settings: Mapping[str, Any], args, adapter) -> str | None:
    """What the checkpoint's Megatron-LM args say differently from `args` (with the [model.args] setting that
    fixes it), or None: the shared SETTINGS, then the family's own (adapter.check_settings)."""
    known = type(args).known_arg_names()
    for name in SETTINGS:
        theirs = settings.get(name)
        if name not in known or isinstance(theirs, bool) or not isinstance(theirs, (int, float)):
            continue
        ours = getattr(args, known[name])
        if not isinstance(ours, (int, float)) or not math.isclose(theirs, ours, rel_tol=1e-6):
            return (f"Megatron-LM trained it with {name} {theirs}, the flavor has {known[name]} {ours} "
                    f"(--model.args {name}={theirs})")
    return adapter.check_settings(settings, args) if adapter.check_settings is not None else None


def _model_args(base, embedding_shape: tuple[int, ...] | None, folder: str, true_vocab_size: int | None):
    """The flavor's args with the checkpoint's (padded) vocabulary or the first true_vocab_size ids of it, no
    larger than host memory holds."""
    if embedding_shape is None or len(embedding_shape) != 2:
        raise CheckpointError(f"{folder} holds no {EMBEDDING} (a 2-D table); is it a megatron-core GPTModel "
                              "checkpoint?")
    if true_vocab_size is not None and not 0 < true_vocab_size <= embedding_shape[0]:
        raise CheckpointError(f"--true-vocab-size {true_vocab_size} is not between 1 and the {embedding_shape[0]} "
                              f"rows of {folder}'s {EMBEDDING}")
    args = base.update_from_config(vocab_size=true_vocab_size or embedding_shape[0], seq_len=base.context_len)
    check_model_size(args, folder)
    return args


def _families() -> list[str]:
    from titanlike.models.registry import get_model_spec, model_names

    return [name for name in model_names() if get_model_spec(name).megatron is not None]


__all__ = ["check_settings", "import_megatron_to_dcp", "iteration_folder", "load_legacy_file", "megatron_args",
           "read_legacy", "read_torch_dist", "safe_load", "torch_dist_index"]
