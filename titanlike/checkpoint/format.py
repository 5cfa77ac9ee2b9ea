"""Checkpoint formats on disk: what saving, loading and the Hugging Face interchange (hf.py) share.

Three kinds of checkpoint folder exist:

* a full DCP checkpoint written by CheckpointManager: keys ``model.<fqn>``,
  ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*``, ``rng.*``, ``train_state.*``;
* a model-only DCP checkpoint (seed checkpoints, ``last_save_model_only`` exports,
  ``convert_hf_to_dcp``): the model's FQNs at the top level, as torchtitan writes them;
* a Hugging Face folder: ``config.json``, ``model-0000i-of-0000n.safetensors``,
  ``model.safetensors.index.json``, ``generation_config.json``.

The DCP kinds carry a ``titanlike.json`` sidecar naming the model family and its args
(``args.to_dict()``), so a checkpoint can be turned into a model without the job's config,
and the CRC-32 of every other file in the folder (``checksums``), verified before a load.
A checkpoint folder holds published ``step-N`` folders; ``step-N.tmp`` (a save in flight)
and ``step-N.purge`` (being deleted) are never read.

Opening a checkpoint runs no code from it. DCP's index (``.metadata``) is a pickle: it is read
by an allow-list unpickler (``_IndexUnpickler``: DCP's metadata classes, torch.Size, dtypes)
in every read, ours and DCP's own inside ``dcp.load`` (``SafeFileSystemReader``). Every entry
is a tensor, read by torch's weights-only loader: non-tensor state (LR schedule, loader
position, RNG, optimizer hyper-parameters) is stored as UTF-8 JSON in a uint8 tensor
(``Json``, ``encode_json`` / ``decode_json``), and ``NoPickleLoadPlanner`` refuses the
pickled entries DCP would otherwise ``torch.load(weights_only=False)``.

Everything here runs in one process on full (unsharded) tensors, and talks to a model family
only through its ModelSpec and the BaseModelArgs contract. Reading and writing Hugging Face
folders is hf.py's.
"""

from __future__ import annotations

import base64
import errno
import io
import json
import os
import pickle
import re
import warnings
import zlib
from contextlib import contextmanager
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from titanlike.config.compat import hub_id_hint

SIDECAR = "titanlike.json"
DCP_METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
# 2: non-tensor state as JSON tensors (1 pickled it), per-file CRC-32 checksums in the sidecar.
FORMAT_VERSION = 2
MODEL_PREFIX = "model."
# A full checkpoint always has this key; a model-only one never does.
FULL_MARKER = "train_state.step"
# Published step folders; a save in flight and a folder being deleted carry these suffixes.
STEP_RE = re.compile(r"step-(\d+)")
TMP_SUFFIX, PURGE_SUFFIX = ".tmp", ".purge"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or key."""


def raise_rank0_verdict(error: str | None, *, distributed: bool, group=None) -> None:
    """Raise CheckpointError(error) on every rank when rank 0 has one: its verdict is broadcast first
    (under several ranks), so that no rank waits in a later broadcast that never comes."""
    if distributed:
        import torch.distributed as dist

        verdict = [error]
        dist.broadcast_object_list(verdict, src=0, group=group)
        error = verdict[0]
    if error:
        raise CheckpointError(error)


def refuse_non_finite(tensors: Mapping[str, torch.Tensor], where: str, *, distributed: bool, group=None) -> None:
    """CheckpointError "WHERE: NAME holds non-finite values" on every rank when a floating-point tensor
    this rank loaded (its local shard) holds a NaN or an infinity: a model loaded from a DCP checkpoint
    the job did not write (an initial load, a teacher, a reference) is checked as check_fits checks a
    Hugging Face folder's tensors. One isfinite().all() per tensor and one device sync; under several
    ranks every rank learns the first name any rank found."""
    from torch.distributed.tensor import DTensor

    names, flags = [], []
    for name, t in tensors.items():
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
            names.append(name)
            flags.append(torch.isfinite(local).all())
    bad = (~torch.stack(flags)).nonzero().flatten().tolist() if flags else []
    first = names[bad[0]] if bad else None
    if distributed:
        import torch.distributed as dist

        found: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, first, group=group)
        first = next((n for n in found if n is not None), None)
    if first is not None:
        raise CheckpointError(f"{where}: {first} holds non-finite values (NaN or infinity)")


def step_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def published_steps(folder: str) -> list[int]:
    """Steps of the published checkpoints in folder, ascending (in-flight .tmp ones excluded)."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(folder)
                  if (m := STEP_RE.fullmatch(name)) and os.path.isdir(os.path.join(folder, name)))


# Sidecar ----------------------------------------------------------------------------------


def model_description(name: str, args: Any, *, context_len: int | None = None,
                      flavor: str | None = None) -> dict[str, Any]:
    """What load_model needs to rebuild the model: family name and its args (``args.to_dict()``),
    and the flavor a job trained (a resume compares family and flavor with its own).

    context_len replaces the args' context length: a job's args carry training.seq_len, which
    only sizes position tables (the weights do not depend on it); the sidecar records the
    flavor's real context instead.
    """
    if context_len is not None:
        args = args.with_context_len(context_len)
    return {"name": name, **({"flavor": flavor} if flavor is not None else {}), "args": args.to_dict()}


def write_sidecar(folder: str, info: dict[str, Any]) -> None:
    """The sidecar, written last: it records the checksums of every other file in the folder. A
    tokenizer the info names by its path is copied into the folder first and recorded by its file
    names (data/hf_tokenizer.py store_tokenizer): nothing a checkpoint records points outside it."""
    from titanlike.data.hf_tokenizer import store_tokenizer

    if isinstance(info.get("tokenizer"), dict):
        info = {**info, "tokenizer": store_tokenizer(folder, info["tokenizer"])}
    checksums = collect_checksums(folder)
    with open(os.path.join(folder, SIDECAR), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **info, "checksums": checksums}, f, indent=2, default=str)
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
    """(ModelSpec, args) from a sidecar's "model" entry; `where` names it in errors. Every field is
    checked like a config value before the args are built (models/args.py check_fields): a crafted
    sidecar is one sentence, never a traceback or a huge table (check_model_size bounds the rest)."""
    from titanlike.models.args import check_fields
    from titanlike.models.registry import get_model_spec

    try:
        name, fields = description["name"], description["args"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: the model entry needs a name and args") from None
    if not isinstance(name, str) or not isinstance(fields, dict):
        raise CheckpointError(f"{where}: the model entry needs a name (a string) and args (an object)")
    try:
        spec = get_model_spec(name)
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0] if e.args else e}") from None
    try:
        check_fields(spec.args_cls, fields, what="the model args")
        args = spec.args_cls.from_dict(fields)
    except Exception as e:  # a combination the field checks let through: whatever the class raises
        detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{where}: the args do not fit model {spec.name}: {detail}") from None
    return spec, args


# What planning accepts (nothing is allocated then, and the job's ranks will hold the model sharded):
# 1 PiB of fp32 weights, ~280 T parameters, beyond any cluster; a larger config.json is hostile.
PLANNING_LIMIT = (2**50, "a job may plan for")


def check_model_size(args, where: str, *, device: Any = "cpu", bytes_per_param: int = 4,
                     limit: tuple[int, str] | None = None) -> None:
    """Refuse, before anything is allocated, a model larger than `device` can hold: its weights at
    bytes_per_param and its position tables (models/args.py model_bytes, arithmetic on the args)
    against the device's memory (observe/memory.py device_memory), or against `limit` (bytes, what
    they are) where given. One sentence naming `where`."""
    from titanlike.models.args import model_bytes
    from titanlike.observe.memory import device_memory

    try:
        need = model_bytes(args, bytes_per_param)
    except Exception as e:
        raise CheckpointError(f"{where}: the model's size cannot be computed ({type(e).__name__}: {e})") from None
    have, what = limit if limit is not None else device_memory(device)
    if need > have:
        gib = 2**30
        raise CheckpointError(
            f"{where}: the model it describes ({args.num_params():,} parameters, {args.context_len:,} positions) "
            f"needs {need / gib:,.1f} GiB, more than the {have / gib:,.1f} GiB {what}; refusing before allocating it")


def check_fits(state_dict: dict[str, torch.Tensor], spec, args, where: str, *,
               partial: bool = False, model: torch.nn.Module | None = None) -> tuple[list[str], list[str]]:
    """The state dict holds exactly the model's tensors (tied aliases optional), with its shapes,
    as floating-point tensors of finite values (an imported file is input from anywhere).

    Built on the meta device, so it costs no memory; a checkpoint of another flavor or
    vocabulary fails here with its first differences named. partial: tensors missing from the
    state dict, or not in the model, are returned (missing, unexpected) rather than refused; the
    tensors both hold are checked the same. model: the meta model of (spec, args) when the caller has
    built it already.
    """
    try:
        if model is None:
            with torch.device("meta"):
                model = spec.model_cls(args)
    except Exception as e:  # args that passed the field checks but no model can be built from
        raise CheckpointError(f"{where}: no {spec.name} model can be built from its configuration "
                              f"({type(e).__name__}: {e})") from None
    expected = dict(model.state_dict())
    aliases = tied_aliases(model)
    missing = sorted(k for k in expected if k not in state_dict and k not in aliases)
    unexpected = sorted(k for k in state_dict if k not in expected)
    if (missing or unexpected) and not partial:
        raise CheckpointError(f"{where} does not match model {spec.name}: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for key, want in expected.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(f"{where}: {key} has shape {tuple(value.shape)} but model "
                                  f"{spec.name} needs {tuple(want.shape)} (another flavor or vocabulary?)")
        if want.is_floating_point() and not value.is_floating_point():
            raise CheckpointError(f"{where}: {key} is a {str(value.dtype).removeprefix('torch.')} tensor, but the "
                                  "model's weights are floating point")
        # A meta tensor stands for a checkpoint index's entry: its values are not read yet. A finite
        # sum proves every value finite (a NaN or infinity would carry into it); only a sum that is
        # not (overflow, or a bad value) needs the element-wise check.
        if (value.is_floating_point() and value.numel() and not value.is_meta
                and not bool(torch.isfinite(value.sum()))
                and not bool(torch.isfinite(value).all())):
            raise CheckpointError(f"{where}: {key} holds non-finite values (NaN or infinity)")
    return missing, unexpected


# Recognizing folders ----------------------------------------------------------------------


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, HF_CONFIG)) and (
        os.path.isfile(os.path.join(path, HF_INDEX))
        or any(n.endswith(".safetensors") for n in os.listdir(path))
    )


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_METADATA))


def model_fingerprint(path: str) -> str:
    """A short digest that tells the model of checkpoint `path` (a DCP checkpoint or a Hugging Face
    folder) from another, without reading all its weights: a DCP checkpoint's recorded checksums (its
    index where it records none); a Hugging Face folder's config.json and, per safetensors file, its
    size, header and 16 samples of 64 KiB spread over its data (a fine-tune changes nearly every weight,
    so the samples differ). What a precomputed reference records of the model it was computed with."""
    import hashlib

    folder = resolve_checkpoint_folder(path)
    digest = hashlib.sha256()
    if is_dcp_folder(folder):
        crcs = checksummed_files(folder)
        if crcs is not None:
            digest.update(json.dumps(crcs, sort_keys=True).encode())
        else:
            with open(os.path.join(folder, DCP_METADATA), "rb") as f:
                digest.update(f.read())
        return digest.hexdigest()[:16]
    with open(os.path.join(folder, HF_CONFIG), "rb") as f:
        digest.update(f.read())
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        file = os.path.join(folder, name)
        size = os.path.getsize(file)
        digest.update(f"{name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(min(size, 8 + 2**20)))  # the header: names, dtypes, shapes, offsets
            for i in range(16):
                f.seek(size * i // 16)
                digest.update(f.read(2**16))
    return digest.hexdigest()[:16]


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
        f"({HF_CONFIG} + *.safetensors) nor a folder of step-N checkpoints" + hub_id_hint(path)
    )


# Reading without running code -------------------------------------------------------------

# What DCP's index pickles (found by unpickling the indexes of full, model-only, async,
# FSDP, TP, seed, bfloat16-export and Hugging Face-import checkpoints). Anything else in an
# index is refused before it is looked up, so a crafted index cannot call anything.
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # megatron-core's torch_dist index also records every rank's save plan (Metadata.all_local_plans),
    # read by checkpoint/megatron.py: DCP's own plain dataclasses and one enum.
    "torch.distributed.checkpoint.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by name (torch.strided)
    "torch": frozenset({"Size"}),  # and the dtypes, checked by type below
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "PureWindowsPath"}),  # StorageMeta.checkpoint_id
}


class ForbiddenInIndex(pickle.UnpicklingError):
    def __init__(self, name: str):
        super().__init__(f"{name} is not allowed in a checkpoint index")
        self.name = name


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index: only the classes in _INDEX_CLASSES and torch dtypes resolve."""

    def find_class(self, module: str, name: str):
        if name in _INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        # vars(), not getattr(): torch's module __getattr__ would import submodules by name.
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise ForbiddenInIndex(f"{module}.{name}")

    def persistent_load(self, pid):
        raise ForbiddenInIndex("a persistent id")


def load_index(stream) -> Metadata:
    metadata = _IndexUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's FileSystemReader with the index read by _IndexUnpickler (DCP's uses pickle.load).

    Every dcp.load of a checkpoint folder goes through it, so DCP's own read of the index
    (on every rank, inside dcp.load) is restricted as well as ours.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
            metadata = load_index(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class NoPickleLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a pickled (non-tensor) entry is an error, not a
    torch.load(weights_only=False). Callers check the index first; this is the backstop.

    It also counts the tensors read on a progress bar named `desc` (titanlike/observe/progress.py:
    rank 0 at a terminal only), whichever storage reader reads them: a large checkpoint takes minutes."""

    def __init__(self, *args: Any, desc: str = "loading checkpoint", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.desc, self.bar = desc, None

    def create_local_plan(self):
        from titanlike.observe.progress import progress

        plan = super().create_local_plan()
        self.bar = progress(desc=self.desc, total=len(plan.items), unit=" tensors") if plan.items else None
        return plan

    def commit_tensor(self, read_item, tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n >= self.bar.total:
                self.bar.close()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is pickled; titanlike never unpickles checkpoint entries")


# Without a process group DCP warns on every save and load ("torch.distributed is disabled,
# unavailable or uninitialized, assuming the intent is to save in a single process"), even when
# asked for no_dist: a single process is what titanlike means then, so that one warning is dropped.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextmanager
def single_process_dcp():
    """Around a DCP save or load in this thread: no single-process warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield


def ignore_single_process_warning() -> None:
    """For asynchronous single-process saves, whose warning comes from DCP's own writer thread
    after any `catch_warnings` here has ended: drop that one warning for the rest of the process
    (an idempotent entry in the warnings filters)."""
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)


def dcp_load(state_dict: dict, path: str, *, process_group=None, no_dist: bool = False) -> None:
    """dcp.load of a checkpoint folder, reading no pickle (raises DCP's exceptions)."""
    with single_process_dcp():
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path),
                 planner=NoPickleLoadPlanner(desc=f"loading {path}"), process_group=process_group, no_dist=no_dist)


def pickled_entries(keys, metadata: Metadata) -> list[str]:
    """The checkpoint's pickled entries among keys or under their first name parts (format 1
    pickled all non-tensor state, under other names than format 2's JSON entries)."""
    keys = set(keys)
    heads = {k.split(".")[0] for k in keys}
    return sorted(k for k, md in metadata.state_dict_metadata.items()
                  if isinstance(md, BytesStorageMetadata) and (k in keys or k.split(".")[0] in heads))


# Non-tensor state as JSON -----------------------------------------------------------------


class Json:
    """A non-tensor value to be stored as one JSON entry (a uint8 tensor) in a DCP checkpoint.

    A leaf for DCP's flattening: the manager turns it into a tensor before saving and, when
    loading, sizes the template from the index and decodes it back.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _to_json(value: Any, key: str) -> Any:
    """value as plain JSON; tuples, bytes, tensors, arrays and non-string dict keys are tagged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_to_json(v, key) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, key) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _to_json(v, key) for k, v in value.items()}
        return {"__dict__": [[_to_json(k, key), _to_json(v, key)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": [str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(raw).decode()]}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        a = np.ascontiguousarray(value)
        return {"__ndarray__": [a.dtype.str, list(a.shape), base64.b64encode(a.tobytes()).decode()]}
    raise CheckpointError(f"checkpoint entry {key!r} holds a {type(value).__name__}, which titanlike cannot "
                          "store without pickle (JSON types, tuples, bytes, tensors and numeric arrays only)")


def _shape(shape: Any, raw: bytes, itemsize: int) -> list[int]:
    """A tagged tensor's or array's shape, checked against its bytes before anything is allocated:
    a crafted entry cannot ask for a terabyte with a short string."""
    if not (isinstance(shape, list) and len(shape) <= 16
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
        raise ValueError(f"shape {shape!r:.60} is not a list of sizes")
    numel = 1
    for d in shape:
        numel *= d
    if numel * itemsize != len(raw):
        raise ValueError(f"shape {shape} needs {numel * itemsize} bytes but the entry holds {len(raw)}")
    return shape


def _from_json_object(obj: dict) -> Any:
    if len(obj) != 1:
        return obj
    (tag, body), = obj.items()
    if tag == "__tuple__":
        if not isinstance(body, list):
            raise ValueError("a tagged tuple is not a list")
        return tuple(body)
    if tag == "__dict__":
        if not (isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body)):
            raise ValueError("a tagged dict is not a list of pairs")
        return {(tuple(k) if isinstance(k, list) else k): v for k, v in body}
    if tag == "__bytes__":
        return base64.b64decode(body, validate=True)
    if tag == "__tensor__":
        name, shape, data = body
        dtype = vars(torch).get(name) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {name!r:.60}")
        raw = base64.b64decode(data, validate=True)
        shape = _shape(shape, raw, torch.empty(0, dtype=dtype).element_size())
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if tag == "__ndarray__":
        dtype_str, shape, data = body
        dtype = np.dtype(dtype_str)
        if dtype.kind not in "biuf":
            raise ValueError(f"array dtype {dtype_str!r:.60} is not numeric")
        raw = base64.b64decode(data, validate=True)
        return np.frombuffer(raw, dtype=dtype).reshape(_shape(shape, raw, dtype.itemsize)).copy()
    return obj


def encode_json(value: Any, key: str) -> torch.Tensor:
    """value as a 1-D uint8 tensor holding UTF-8 JSON (key names the entry in errors)."""
    text = json.dumps(_to_json(value, key), separators=(",", ":"), allow_nan=True)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)


def decode_json(tensor: torch.Tensor, key: str, path: str) -> Any:
    """The value of a JSON entry; a CheckpointError naming the entry if it is not ours."""
    try:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise ValueError(f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, not UTF-8 JSON bytes")
        return json.loads(tensor.numpy().tobytes().decode(), object_hook=_from_json_object)
    except Exception as e:  # JSONDecodeError, UnicodeDecodeError, a tag's body of the wrong kind, ...
        raise CheckpointError(f"checkpoint {path}: entry {key!r} is damaged ({type(e).__name__}: {e})") from None


def json_template(key: str, metadata: Metadata, path: str) -> torch.Tensor:
    """An empty tensor of the stored size of JSON entry key, to load it into."""
    md = metadata.state_dict_metadata.get(key)
    if md is None:
        raise CheckpointError(f"checkpoint {path} has no entry {key!r} that this job needs")
    if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != torch.uint8 or len(md.size) != 1:
        raise CheckpointError(f"checkpoint {path}: entry {key!r} is not a JSON entry")
    return torch.empty(md.size, dtype=torch.uint8)


# Checksums --------------------------------------------------------------------------------

# Each rank's writer records the CRC-32 of the files it wrote in <prefix>crc32.json (prefix:
# DCP's per-rank file prefix, "__<rank>_"); the sidecar, written by rank 0 once every rank is
# done, gathers them and adds the files written otherwise (.metadata, safetensors).
_CRC_SUFFIX = "crc32.json"
_CRC_RE = re.compile(r"__\d+_" + re.escape(_CRC_SUFFIX))
_CHUNK = 8 << 20


def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


class _Crc32Stream(io.RawIOBase):
    """A write stream that computes the CRC-32 of what passes through it, and remembers an
    OSError of the file system (torch.save's C++ writer turns it into an 'unexpected pos')."""

    def __init__(self, raw, on_error):
        super().__init__()
        self.raw, self.on_error, self.crc, self.sequential = raw, on_error, 0, True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        try:
            n = self.raw.write(view)
        except OSError as e:
            self.on_error(e)
            raise
        self.crc = zlib.crc32(view[: n if n is not None else len(view)], self.crc)
        return n if n is not None else len(view)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.raw.seekable()

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, *args) -> int:
        self.sequential = False  # the running CRC no longer describes the file: read it back
        return self.raw.seek(*args)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as e:
            self.on_error(e)
            raise


class _Crc32FileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.crcs: dict[str, str] = {}
        self.error: OSError | None = None

    def _on_error(self, e: OSError) -> None:
        self.error = self.error or e

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as raw:
                stream = _Crc32Stream(raw, self._on_error)
                yield stream
        except OSError as e:
            self._on_error(e)
            raise
        name = os.path.basename(os.fspath(path))
        self.crcs[name] = f"{stream.crc:08x}" if stream.sequential else file_crc32(os.fspath(path))


# Written into the index of every checkpoint this format writes (StorageMeta.modules, a list of names
# DCP keeps but never reads): a checkpoint whose sidecar is gone still says it had one.
INDEX_MARK = f"titanlike checkpoint format {FORMAT_VERSION}"


class ChecksumWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter that records the CRC-32 of every file it writes while writing
    (<prefix>crc32.json per rank, gathered into the sidecar at publishing), that marks the index
    as this format's (INDEX_MARK), and that reports a file system error (no space left, quota)
    as the OSError it was."""

    def __init__(self, path: str):
        super().__init__(path)
        self.fs = _Crc32FileSystem()

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None:
            meta.modules = [*meta.modules, INDEX_MARK]
        return meta

    def write_data(self, plan, planner):
        self.fs.crcs, self.fs.error = {}, None
        try:
            future = super().write_data(plan, planner)
            future.wait()
            prefix = plan.storage_data.prefix
            text = json.dumps(self.fs.crcs, sort_keys=True)
            with open(os.path.join(os.fspath(self.path), f"{prefix}{_CRC_SUFFIX}"), "w") as f:
                f.write(text)
        except Exception as e:
            if self.fs.error is not None and self.fs.error is not e:
                raise self.fs.error from None
            raise
        return future

    def finish(self, metadata, results) -> None:
        self.fs.error = None
        try:
            super().finish(metadata, results)
        except Exception as e:
            if self.fs.error is not None and self.fs.error is not e:
                raise self.fs.error from None
            raise


def dcp_save(state_dict: dict, path: str, *, process_group=None, no_dist: bool = False):
    """dcp.save through ChecksumWriter (raises DCP's exceptions)."""
    with single_process_dcp():
        return dcp.save(state_dict, storage_writer=ChecksumWriter(path), process_group=process_group,
                        no_dist=no_dist)


def collect_checksums(folder: str) -> dict[str, Any]:
    """{"crc32": {file: hex}} for every file in folder but the sidecar: the writers' records,
    gathered (and their record files removed), and the CRC of the files they did not write."""
    crcs: dict[str, str] = {}
    names = sorted(os.listdir(folder))
    for name in names:
        if _CRC_RE.fullmatch(name):
            with open(os.path.join(folder, name)) as f:
                crcs.update(json.load(f))
            os.remove(os.path.join(folder, name))
    for name in names:
        file = os.path.join(folder, name)
        if name != SIDECAR and not _CRC_RE.fullmatch(name) and name not in crcs and os.path.isfile(file):
            crcs[name] = file_crc32(file)
    return {"crc32": dict(sorted(crcs.items()))}


def checksummed_files(path: str) -> dict[str, str] | None:
    """{file: crc32 hex} from the sidecar, or None if the checkpoint records no checksums."""
    info = read_sidecar(path)
    if not info or "checksums" not in info:
        return None
    crcs = info["checksums"].get("crc32") if isinstance(info["checksums"], dict) else None
    if not isinstance(crcs, dict):
        raise CheckpointError(f"{os.path.join(path, SIDECAR)} is damaged: its checksums are not a table of files")
    return crcs


def plain_file(name: Any) -> bool:
    """Whether `name`, as a checkpoint records it (index, sidecar), is a plain file name: no
    path ('/', '..'), no NUL. What a checkpoint names may not lead outside it."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and os.sep not in name and "\0" not in name)


def verify_files(path: str, crcs: dict[str, str], names) -> str | None:
    """The first of names whose CRC-32 differs from crcs, as a sentence; None if all match."""
    for name in names:
        if not plain_file(name) or os.path.islink(os.path.join(path, name)):
            return f"checkpoint {path}: {SIDECAR} names {name!r:.200}, which is not a plain file of the checkpoint"
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"checkpoint file {file} is missing (listed in {SIDECAR})"
        got = file_crc32(file)
        if got != crcs[name]:
            return (f"checkpoint file {file} is corrupt: its CRC-32 is {got}, but {SIDECAR} recorded "
                    f"{crcs[name]} when it was saved")
    return None


def uncovered_files(metadata: Metadata, crcs: dict[str, str]) -> list[str]:
    """Data files named by the index that the checksums do not cover."""
    named = {info.relative_path for info in (metadata.storage_data or {}).values()} | {DCP_METADATA}
    return sorted(named - set(crcs))


def records_checksums(metadata: Metadata) -> bool:
    """Whether the index says a writer that records checksums wrote it: format 2 marks its index
    (INDEX_MARK) and stores train_state.format_version as a tensor (format 1 pickled it)."""
    try:
        modules = metadata.storage_meta.modules or []
    except AttributeError:  # no storage_meta (None), or one pickled before DCP had modules
        modules = []
    if any(isinstance(m, str) and m.startswith("titanlike checkpoint format ") for m in modules):
        return True
    return isinstance(metadata.state_dict_metadata.get("train_state.format_version"), TensorStorageMetadata)


def missing_checksums(path: str, metadata: Metadata) -> str | None:
    """For a checkpoint whose sidecar records no checksums: the sentence refusing it when its index
    says it was written with them (the sidecar was deleted or emptied), None for an older one."""
    if not records_checksums(metadata):
        return None
    missing = not os.path.isfile(os.path.join(path, SIDECAR))
    what = f"has no {SIDECAR}" if missing else f"has a {SIDECAR} without checksums"
    return (f"checkpoint {path} {what}, but its index says titanlike checkpoint format "
            f"{FORMAT_VERSION} wrote it, which records every file's checksum there: its files cannot be verified")


def verify_checksums(path: str, metadata: Metadata | None = None) -> str | None:
    """Check every file of checkpoint path against its sidecar, in this process: the first
    problem as a sentence, or None (also for an older checkpoint that records no checksums)."""
    crcs = checksummed_files(path)
    if crcs is None:
        return missing_checksums(path, metadata) if metadata is not None else None
    if metadata is not None and (missing := uncovered_files(metadata, crcs)):
        return f"checkpoint {path}: {SIDECAR} has no checksum for {missing[0]}, which {DCP_METADATA} names"
    return verify_files(path, crcs, sorted(crcs))


# Failures ---------------------------------------------------------------------------------

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(e: BaseException) -> bool:
    """Whether a save failed because the file system is full (or over quota), including inside
    a DCP CheckpointException that carries each rank's exception."""
    seen = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in _NO_SPACE:
            return True
        if "No space left on device" in str(x) or "Disk quota exceeded" in str(x):
            return True
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([x.__cause__, x.__context__])
    return False


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
        return SafeFileSystemReader(path).read_metadata()
    except ForbiddenInIndex as e:
        raise CheckpointError(
            f"checkpoint index {meta_path} refers to {e.name}, which a DCP index never holds; refusing to "
            "unpickle it (a crafted or foreign file?)") from None
    except Exception as e:  # unpickling garbage raises anything from EOFError to UnpicklingError
        raise CheckpointError(f"checkpoint index {meta_path} is damaged ({type(e).__name__}: {e})") from None


def check_dcp_files(path: str, metadata: Metadata) -> None:
    """Every data file the index points into exists and is long enough.

    DCP would otherwise fail deep inside a read (or on another rank) with an error that
    names neither the file nor the checkpoint.
    """
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        try:
            rel, offset, length = info.relative_path, info.offset, info.length
        except AttributeError:  # an allowed class of another kind where DCP puts a _StorageInfo
            raise CheckpointError(f"checkpoint index {os.path.join(path, DCP_METADATA)} is damaged: a data "
                                  f"location is a {type(info).__name__}") from None
        if not plain_file(rel) or os.path.islink(os.path.join(path, rel)):
            raise CheckpointError(f"checkpoint index {os.path.join(path, DCP_METADATA)} names data file {rel!r:.200}, "
                                  "which is not a plain file of the checkpoint (a path or a link leading out of it)")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointError(f"checkpoint index {os.path.join(path, DCP_METADATA)} is damaged: {rel} has "
                                  f"offset {offset!r:.50} and length {length!r:.50}")
        needed[rel] = max(needed.get(rel, 0), offset + length)
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


def read_dcp_model(path: str, *, dtype: torch.dtype | None = None, verify: bool = True) -> dict[str, torch.Tensor]:
    """The model's full tensors from a full or model-only DCP checkpoint, in one process. verify:
    check the files against the sidecar's checksums (off only for a staging folder this process
    has just written, which has no sidecar)."""
    metadata = read_dcp_metadata(path)
    check_dcp_files(path, metadata)
    problem = verify_checksums(path, metadata) if verify else None
    if problem:
        raise CheckpointError(problem)
    names, _ = dcp_model_keys(metadata)
    if not names:
        raise CheckpointError(f"checkpoint {path} holds no model tensors")
    template = {}
    for fqn, key in names.items():
        md = metadata.state_dict_metadata[key]
        template[key] = torch.empty(md.size, dtype=md.properties.dtype)
    load_into(template, path, f"checkpoint {path}")
    return {fqn: (template[key] if dtype is None else template[key].to(dtype)) for fqn, key in names.items()}


def load_into(template: dict[str, torch.Tensor], path: str, what: str) -> None:
    """DCP's tensors of `path` into the template's tensors, in this process (no process group);
    CheckpointError naming `what` when reading fails."""
    try:
        dcp_load(template, path, no_dist=True)
    except BaseException as e:  # CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading {what} failed: {summarize(e)}") from None


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


def stage_aliases(parts: list[nn.Module], held: list[set[str]]) -> list[dict[str, str]]:
    """Per part, {alias: owner} of the tied weights whose alias the part holds without its owner:
    a pipeline stage with one end of a tied pair (the output projection on the last stage keeps its
    own copy of the token table, synchronised by the tied-gradient sum). A checkpoint stores such a
    weight once, under the owner's name, whatever the layout, so a pipeline job and a job holding
    both ends read and write the same keys. held: each part's state-dict keys."""
    from titanlike.models import protocol

    return [{alias: owner for alias, owner in protocol.tied_weights(part).items()
             if alias in keys and owner not in keys} for part, keys in zip(parts, held)]


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
