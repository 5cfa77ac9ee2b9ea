"""A family and an objective from outside titanlike/ train through train.py like the built-in ones.

tests/toy_family.py (a decoder of parallel blocks with a fused head-major QKV parameter, its own
tensor-parallel style, and a synthetic copy objective with its own [toy_copy] section) registers
itself on import and imports only public titanlike entry points (test_toy_family_imports_nothing_private
checks that); tests/conftest.py imports it and the reference job runs train.main in the test process,
as a user's own script would (import the module that registers the family, then call train.main). No
file under titanlike/ names it.

One job: the single-process reference, 6 fp32 steps, whose loss falls. Its layouts (FSDP 2, TP 2
with the fused QKV split by its own style, PP 2) reproduce one process's loss and every gradient at
model level in tests/layouts/test_family_layouts.py (toy-tiny), built as train.py builds them (the
train.py runs of FSDP2, TP2 and PP2 that were here: tests/MAP.md).
The unit checks show the custom pieces are the ones that ran: the QKV parameter split on its heads
dimension, the [toy_copy] section read and checked by plan_job, labels on the copied half only.

Importing toy_family here registers the toy family for the whole pytest session, so the family
checks that iterate over every registered family (tests/unit/test_module_protocol.py) check it too.
"""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F

import toy_family
from conftest import REPO, read_metrics, train_in_process
from titanlike.config import ConfigError, load_job_config
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives.base import BatchContext
from titanlike.train.plan import plan_job

TOY_JOB = ["--model.name", "toy", "--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "6",
           "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "1",
           "--toy_copy.label_smoothing", "0.1", "--metrics.log_freq", "1", "--metrics.enable_jsonl",
           "--metrics.no_enable_tensorboard"]
@pytest.fixture(scope="module")
def toy_reference(tmp_path_factory) -> list[dict]:
    dump = tmp_path_factory.mktemp("toy1") / "single"
    train_in_process([*TOY_JOB, "--training.local_batch_size", "8", "--job.dump_folder", str(dump)])
    return read_metrics(dump)


def test_reference_loss_falls(toy_reference):
    losses = [r["loss"] for r in toy_reference]
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 1.0, losses


# ------------------------------------------------------------------- the custom pieces are the ones that ran


def test_tp2_splits_the_fused_qkv_on_its_heads():
    """The generic TP step applies the family's shard (on meta, over a fake 2-rank mesh): the fused
    (3, heads, head_dim, dim) parameter becomes a DTensor sharded on dim 1, two heads per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from estimation.fake import fake_world
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    with torch.device("meta"):
        model = toy_family.ToyDecoder(toy_family.ToyArgs())
    with fake_world(2):
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), toy_family.toy_spec.shard, loss_parallel=True)
        params = dict(model.named_parameters())
        qkv = params["layers.0.attention.qkv"]
        assert isinstance(qkv, DTensor) and qkv.placements == (Shard(1),)
        assert qkv.shape == (3, 4, 16, 64) and qkv.to_local().shape == (3, 2, 16, 64)
        assert params["layers.0.attention.wo.weight"].placements == (Shard(1),)  # rowwise: its input's heads
        assert params["tok_embeddings.weight"].placements == (Shard(0),)  # vocabulary-parallel
        assert params["layers.0.norm.weight"].placements == (Replicate(),)
        assert all(isinstance(p, DTensor) for p in params.values())


@pytest.mark.parametrize(("extra", "world", "refusal"), [
    (["--toy_copy.label_smoothing", "1.5"], 1, r"^toy_copy.label_smoothing must be in \[0, 1\), got 1.5$"),
    (["--parallelism.context_parallel_degree", "2"], 2, r"toy_copy does not cut its samples for context parallelism"),
    (["--training.seq_len", "63"], 1, r"training.seq_len must be even, got 63$"),
])
def test_plan_job_refuses_in_one_sentence(extra, world, refusal):
    with pytest.raises(ConfigError, match=refusal):
        plan_job(load_job_config([*TOY_JOB, *extra]), world)


def test_plan_reads_the_toy_copy_section():
    plan = plan_job(load_job_config([*TOY_JOB, "--toy_copy.label_smoothing", "0.25"]), 1)
    assert isinstance(plan.objective, toy_family.ToyCopy)
    assert plan.objective.options.label_smoothing == 0.25
    # The objective's loss needs whole logits, so the plan keeps TP's logits gathered for it, while a
    # cross-entropy objective keeps them vocabulary-parallel.
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    assert not plan_job(load_job_config([*TOY_JOB, *tp2]), 2).parallelize.loss_parallel
    assert plan_job(load_job_config(["--training.seq_len", "64", *tp2]), 2).parallelize.loss_parallel


def test_labels_cover_only_the_copied_half():
    objective = toy_family.ToyCopy()
    samples = objective.samples("default", dataset_path=None, tokenizer=None, seq_len=16, seed=3)
    assert samples.fields == {"tokens": ((16,), "int64")}
    batch = {"tokens": torch.from_numpy(samples.source[7]["tokens"]).unsqueeze(0)}
    mb = objective.prepare(batch, BatchContext(torch.device("cpu")))
    tokens, labels = mb.inputs[0], mb.targets["labels"][0]
    assert torch.equal(tokens[8:], tokens[:8])
    # Position t predicts token t + 1: targets exactly where that token lies in the second half.
    assert (labels[:7] == IGNORE_INDEX).all() and labels[-1] == IGNORE_INDEX
    assert torch.equal(labels[7:15], tokens[8:])
    # A pure function of (seed, sample index).
    assert (samples.source[7]["tokens"] == toy_family.CopySamples(16, 3)[7]["tokens"]).all()
    assert not (samples.source[8]["tokens"] == samples.source[7]["tokens"]).all()


def test_loss_is_a_label_smoothed_cross_entropy_summed_over_targets():
    logits = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, -100, 3, 4, 5, -100], [-100, -100, 1, 2, 9, -100]])
    objective = toy_family.ToyCopy(toy_family.ToyCopyOptions(label_smoothing=0.1))
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum",
                               label_smoothing=0.1)
    torch.testing.assert_close(objective.loss(logits, {"labels": labels}, BatchContext(torch.device("cpu"))).value,
                               expected)


def test_toy_family_imports_nothing_private():
    """Every titanlike name tests/toy_family.py imports, and every attribute it reads of what it
    imported from titanlike, is public (no part of it starts with an underscore): a grep through the
    file's syntax tree, so that parenthesized imports and aliases count too."""
    tree = ast.parse((REPO / "tests" / "toy_family.py").read_text())
    imported = []  # (dotted path, the name it is bound to)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titanlike"):
            imported += [(f"{node.module}.{a.name}", a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            imported += [(a.name, a.asname or a.name.split(".")[0]) for a in node.names
                         if a.name.startswith("titanlike")]
    bound = {name for _, name in imported}
    private = [path for path, _ in imported if any(part.startswith("_") for part in path.split("."))]
    private += [f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id in bound and n.attr.startswith("_")]
    assert imported and not private, private
