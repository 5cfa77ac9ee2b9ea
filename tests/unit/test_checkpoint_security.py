"""Opening a checkpoint runs no code from it.

DCP's index (.metadata) is a pickle and DCP loads non-tensor entries with
torch.load(weights_only=False): a crafted checkpoint would execute code on resume, in
load_model and in the converters. titanlike reads the index with an allow-list unpickler
(in its own reads and in DCP's, inside dcp.load), stores non-tensor state as JSON tensors,
and refuses pickled entries. Every poisoned file here runs `touch MARKER` when unpickled
freely; the tests check the refusal and that the marker was never created.

train.py and the scripts on the same poisoned files: tests/integration/test_checkpoint_faults.py.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from faults import Evil, poison_entry, poison_index
from test_checkpoint_manager import ARGS, HF, Job, run

from titanlike.checkpoint import CheckpointError, load_model
from titanlike.checkpoint import format as fmt
from titanlike.checkpoint.hf import import_hf_to_dcp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Full, async, model-only (bfloat16) and seed checkpoints, and a Hugging Face import."""
    root = tmp_path_factory.mktemp("kinds")
    run(root / "full", 3, "--checkpoint.no_last_save_model_only", steps=3)
    run(root / "export", 3, "--checkpoint.export_dtype", "bfloat16", steps=3)
    job = Job(root / "async", "--checkpoint.async_mode", "async", "--checkpoint.interval", "2")
    job.start()
    job.train(2)
    job.manager.close()
    seed = Job(root / "seed", "--checkpoint.create_seed_checkpoint")
    seed.start()
    seed.manager.close()
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**HF.args_to_config(ARGS))).save_pretrained(root / "hf")
    import_hf_to_dcp(str(root / "hf"), str(root / "hfimport"))
    return {
        "full": root / "full" / "checkpoint" / "step-3",
        "export": root / "export" / "checkpoint" / "step-3",
        "async": root / "async" / "checkpoint" / "step-2",
        "seed": root / "seed" / "checkpoint" / "step-0",
        "hfimport": root / "hfimport",
    }


@pytest.fixture
def full(checkpoints, tmp_path):
    """A copy of the full checkpoint, as the latest of a job's checkpoint folder."""
    shutil.copytree(checkpoints["full"], tmp_path / "checkpoint" / "step-3")
    return tmp_path, str(tmp_path / "checkpoint" / "step-3")


# ------------------------------------------------------------------ the index


def test_allow_listed_unpickler_reads_every_kind_of_index_as_pickle_does(checkpoints):
    for name, path in checkpoints.items():
        with open(path / ".metadata", "rb") as f:
            ours = fmt.load_index(f)
        with open(path / ".metadata", "rb") as f:
            theirs = pickle.load(f)
        assert ours.state_dict_metadata == theirs.state_dict_metadata, name
        assert ours.storage_data == theirs.storage_data, name


def test_every_entry_is_a_tensor_and_state_is_json(checkpoints):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for name, path in checkpoints.items():
        metadata = fmt.read_dcp_metadata(str(path))
        assert all(isinstance(md, TensorStorageMetadata) for md in metadata.state_dict_metadata.values()), name
    keys = fmt.read_dcp_metadata(str(checkpoints["full"])).state_dict_metadata
    for key in ("lr_scheduler.state", "dataloader.dp_rank_0", "rng.rank_0", "optimizer.param_groups.output.weight"):
        assert keys[key].properties.dtype == torch.uint8 and len(keys[key].size) == 1, key
    assert fmt.read_sidecar(str(checkpoints["full"]))["format_version"] == fmt.FORMAT_VERSION == 2


def test_poisoned_index_is_refused_on_resume_and_in_load_model(full, tmp_path):
    root, path = full
    marker = tmp_path / "pwned"
    poison_index(path, marker)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        assert b"system" in f.read()  # the payload is there
    sentence = (rf"^checkpoint index {path}/\.metadata refers to posix\.system, which a DCP index never holds; "
                r"refusing to unpickle it \(a crafted or foreign file\?\)$")
    with pytest.raises(CheckpointError, match=sentence[:-1] + "; no older checkpoint in .* verifies$"):
        Job(root).start()
    with pytest.raises(CheckpointError, match=sentence):
        load_model(path)
    with pytest.raises(CheckpointError, match=sentence):
        load_model(root / "checkpoint")
    # DCP's own read of the index, inside dcp.load, goes through the same unpickler.
    with pytest.raises(BaseException, match="posix.system is not allowed in a checkpoint index"):
        fmt.dcp_load({"model.output.weight": torch.empty(320, 64)}, path, no_dist=True)
    assert not marker.exists()


def test_poisoned_state_entry_is_refused_on_resume(full, tmp_path):
    root, path = full
    marker = tmp_path / "pwned"
    poison_entry(path, "lr_scheduler.state", marker)
    with pytest.raises(CheckpointError, match=(
            rf"^checkpoint {path} holds pickled state \(lr_scheduler\), as an older titanlike wrote it, and titanlike "
            r"never unpickles checkpoint entries; resume with --checkpoint.exclude_from_loading lr_scheduler or "
            r"re-save it$")):
        Job(root).start()
    # The model loads: it holds no pickle.
    load_model(path)
    # The load planner is the backstop: a pickled entry asked for directly is refused too.
    with pytest.raises(BaseException, match="'lr_scheduler.state' is pickled; titanlike never unpickles"):
        fmt.dcp_load({"lr_scheduler.state": torch.empty(10, dtype=torch.uint8)}, path, no_dist=True)
    assert not marker.exists()
    # Excluding the component resumes from the rest.
    assert Job(root, "--checkpoint.exclude_from_loading", "lr_scheduler").start() == 3
    assert not marker.exists()


def test_format_1_checkpoint_with_pickled_state_is_refused_but_its_model_loads(full, tmp_path):
    """What titanlike 1 wrote: every non-tensor value pickled (DCP's BytesIO entries)."""
    root, path = full
    metadata = fmt.read_dcp_metadata(path)
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    fmt.dcp_load(state, path, no_dist=True)
    old = {k: v for k, v in state.items() if k.startswith(("model.", "optimizer.state."))}
    pickled = io.BytesIO(b"titanlike 1 torch.save()d its state into BytesIO entries")
    old.update({"train_state.step": 3, "lr_scheduler.state": pickled, "rng.rank_0": pickled,
                "dataloader.dp_rank_0": pickled, "optimizer.param_groups.output.weight.lr": 1e-3})
    shutil.rmtree(path)
    dcp.save(old, checkpoint_id=path, no_dist=True)
    with pytest.raises(CheckpointError, match=r"holds pickled state \(optimizer,lr_scheduler,dataloader,rng,"
                                              r"train_state\), as an older titanlike wrote it"):
        Job(root).start()
    excluded = Job(root, "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler,dataloader,rng,train_state")
    assert excluded.start() == 0
    assert torch.equal(excluded.parts[0].output.weight, state["model.output.weight"])


# ------------------------------------------------------------------ JSON entries


def test_json_entries_round_trip_tagged_values_exactly():
    value = {
        "ints": [1, -2, 2**40], "float": 0.1 + 0.2, "nan": float("nan"), "inf": -math.inf, "none": None,
        "tuple": (0.9, 0.95), "bytes": b"\x00\xff", "int_keys": {0: "a", 7: {"nested": (1, 2)}},
        "__dunder": 1, "tensor": torch.arange(5, dtype=torch.uint8),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "empty": torch.empty(0, 3), "array": np.arange(6, dtype=np.uint32).reshape(2, 3), "np_scalar": np.int64(5),
    }
    back = fmt.decode_json(fmt.encode_json(value, "k"), "k", "p")
    assert back.keys() == value.keys()
    for key in ("ints", "float", "none", "tuple", "bytes", "int_keys", "__dunder", "inf"):
        assert back[key] == value[key] and type(back[key]) is type(value[key]), key
    assert math.isnan(back["nan"]) and back["np_scalar"] == 5
    for key in ("tensor", "bf16", "empty"):
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key]), key
    assert back["array"].dtype == np.uint32 and np.array_equal(back["array"], value["array"])
    # The RNG state of this process survives exactly.
    state = torch.get_rng_state()
    assert torch.equal(fmt.decode_json(fmt.encode_json(state, "rng"), "rng", "p"), state)


def test_json_entries_refuse_what_would_need_pickle():
    with pytest.raises(CheckpointError, match=r"^checkpoint entry 'x' holds a Evil, which titanlike cannot store"):
        fmt.encode_json({"a": [Evil("m")]}, "x")
    with pytest.raises(CheckpointError, match=r"^checkpoint p: entry 'k' is damaged \(JSONDecodeError"):
        fmt.decode_json(torch.tensor(list(b"{not json"), dtype=torch.uint8), "k", "p")
    with pytest.raises(CheckpointError, match=r"entry 'k' is damaged \(ValueError: unknown tensor dtype 'Evil'\)"):
        fmt.decode_json(fmt.encode_json({"__tensor__": 1}, "k").new_tensor(
            list(b'{"__tensor__": ["Evil", [1], "AA=="]}')), "k", "p")
