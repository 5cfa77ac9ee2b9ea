"""CheckpointManager in one process: what a checkpoint restores, atomic publishing, purging,
and a clear error (never a fresh start) for every kind of damage.

The multi-process and train.py-level checks (layouts, SIGKILL, async modes) are in
tests/distributed/test_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titanlike.checkpoint import CheckpointError, CheckpointManager, load_model, published_steps
from titanlike.checkpoint import format as ckpt_format
from titanlike.config import load_job_config
from titanlike.train.plan import plan_job
from titanlike.data.loader import build_dataloader_from_source
from titanlike.models.llama3 import Transformer, llama3_flavors
from titanlike.models.registry import get_model_spec
from titanlike.train.optimizer import build_lr_scheduler, build_optimizer

SEQ = 16
ARGS = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=320, max_seq_len=SEQ)
HF = get_model_spec("llama3").hf


class Job:
    """The trainer's pieces, small: model, AdamW, WSD schedule, stateful loader, manager."""

    def __init__(self, tmp_path, *overrides: str, steps: int = 6, seed: int = 0, args=ARGS, parts=None):
        self.cfg = load_job_config([
            "--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path),
            "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "2",
            "--checkpoint.enable", "--checkpoint.interval", "3", *overrides,
        ])
        dims = plan_job(self.cfg, world_size=1, vocab_size=args.vocab_size).dims
        if parts is None:
            with torch.device("meta"):
                model = Transformer(args)
            model.to_empty(device="cpu")
            model.init_weights(seed=seed)
            parts = [model]
        self.parts = parts
        self.optimizer = build_optimizer(parts, self.cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, self.cfg.lr_scheduler, steps)
        rng = np.random.default_rng(0)
        samples = [rng.integers(0, args.vocab_size, SEQ + 1) for _ in range(64)]
        self.loader = build_dataloader_from_source(
            samples, seq_len=SEQ, local_batch_size=2, global_batch_size=2, dp_rank=0, dp_degree=1,
            seed=0, shuffle=True)
        self.manager = CheckpointManager(
            self.cfg, dims=dims, model_parts=parts, optimizer=self.optimizer, lr_scheduler=self.scheduler,
            dataloader=self.loader, model_args=args)
        self.step = 0
        self.data = None

    def forward(self, tokens):
        h = tokens
        for part in self.parts:
            h = part(h)
        return h

    def start(self):
        start = self.manager.load()
        self.step = start or 0
        self.data = iter(self.loader)
        return start

    def train(self, n: int) -> list[float]:
        losses = []
        for _ in range(n):
            self.step += 1
            batch = next(self.data)
            inputs, labels = batch["inputs"], batch["labels"]
            loss = F.cross_entropy(self.forward(inputs).flatten(0, 1), labels.flatten())
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            losses.append(loss.item())
            self.manager.save(self.step)
        return losses

    def params(self):
        return {k: v.detach().clone() for part in self.parts for k, v in part.state_dict().items()}

    def folder(self):
        return self.manager.folder


def run(tmp_path, n, *overrides, **kw) -> Job:
    job = Job(tmp_path, *overrides, **kw)
    job.start()
    job.train(n)
    job.manager.close()
    return job


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------ what a checkpoint restores


def test_resume_restores_model_optimizer_schedule_loader_and_rng(tmp_path):
    straight = Job(tmp_path / "straight")
    straight.start()
    losses = straight.train(6)

    first = Job(tmp_path / "resumed")
    first.start()
    first.train(2)
    # Known RNG states right before the step that saves (a training step draws no random numbers).
    random.seed(11); np.random.seed(12); torch.manual_seed(13)  # noqa: E702
    saved_rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    first.train(1)  # saves step-3 (interval 3)
    first.manager.close()
    torch.manual_seed(99); random.seed(99); np.random.seed(99)  # noqa: E702

    second = Job(tmp_path / "resumed", seed=123)  # other initial weights: all must come from the checkpoint
    assert second.manager.load() == 3
    # Checked before iter(loader): creating a DataLoader iterator draws from the global torch RNG.
    assert torch.equal(torch.get_rng_state(), saved_rng[0])
    assert random.getstate() == saved_rng[1]
    assert np.array_equal(np.random.get_state()[1], saved_rng[2])
    second.step, second.data = 3, iter(second.loader)
    assert_same_tensors(second.params(), first.params())
    assert second.scheduler.last_epoch == 3
    assert second.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    s1, s2 = first.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for i in s1:
        for name in s1[i]:
            assert torch.equal(s1[i][name], s2[i][name]), (i, name)
    # Exact continuation: the same losses as the uninterrupted run, bit for bit.
    assert second.train(3) == losses[3:]


def test_async_thread_mode_publishes_and_resumes(tmp_path):
    ref = run(tmp_path / "ref", 6)
    job = Job(tmp_path / "a", "--checkpoint.async_mode", "async", "--checkpoint.interval", "2",
              "--checkpoint.no_last_save_model_only")
    job.start()
    job.train(4)
    job.manager.close()  # waits for the save of step 4 and publishes it
    assert published_steps(job.folder()) == [2, 4]
    resumed = Job(tmp_path / "a", "--checkpoint.async_mode", "async", "--checkpoint.interval", "2")
    assert resumed.start() == 4
    resumed.train(2)
    resumed.manager.close()
    assert_same_tensors(resumed.params(), ref.params())


def test_model_parts_keys_do_not_depend_on_the_split(tmp_path):
    """A pipeline-style split (two parts, one optimizer) loads into the unsplit model."""
    def part(keep_layers, first, last):
        with torch.device("meta"):
            m = Transformer(ARGS)
        for k in [k for k in m.layers if k not in keep_layers]:
            del m.layers[k]
        if not first:
            m.tok_embeddings = None
        if not last:
            m.norm, m.output = None, None
        m.to_empty(device="cpu")
        m.init_weights(seed=0)
        return m

    split = Job(tmp_path, "--checkpoint.no_last_save_model_only", steps=3,
                parts=[part({"0"}, True, False), part({"1"}, False, True)])
    split.start()
    split.train(3)
    split.manager.close()
    whole = Job(tmp_path, steps=6, seed=5)
    assert whole.start() == 3
    assert_same_tensors(whole.params(), split.params())
    names = {id(p): n for n, p in whole.parts[0].named_parameters()}
    split_names = {id(p): n for part_ in split.parts for n, p in part_.named_parameters()}
    by_name = {split_names[id(p)]: split.optimizer.state[p] for g in split.optimizer.param_groups for p in g["params"]}
    for g in whole.optimizer.param_groups:
        for p in g["params"]:
            for key, value in whole.optimizer.state[p].items():
                assert torch.equal(value, by_name[names[id(p)]][key]), (names[id(p)], key)


def test_tied_embedding_is_stored_once_and_stays_tied(tmp_path):
    tied = dataclasses.replace(ARGS, tie_word_embeddings=True)
    first = run(tmp_path, 3, "--checkpoint.no_last_save_model_only", steps=3, args=tied)
    keys = ckpt_format.read_dcp_metadata(os.path.join(first.folder(), "step-3")).state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and "model.output.weight" not in keys
    second = Job(tmp_path, steps=6, seed=5, args=tied)
    assert second.start() == 3
    model = second.parts[0]
    assert model.output.weight is model.tok_embeddings.weight
    assert_same_tensors(second.params(), first.params())
    assert torch.equal(load_model(first.folder()).output.weight, first.parts[0].output.weight)


def test_exclude_from_loading_skips_components(tmp_path):
    run(tmp_path, 3, "--checkpoint.no_last_save_model_only", steps=3)
    job = Job(tmp_path, "--checkpoint.exclude_from_loading", "optimizer,train_state", steps=6, seed=4)
    assert job.start() == 0  # train_state not loaded: the step starts over
    assert not job.optimizer.state
    assert job.scheduler.last_epoch == 3


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_muon_state_resumes_exactly(tmp_path, state_dtype):
    """Muon's momentum (and the AdamW half's moments, and bfloat16 states' rounding count) save and
    resume: the resumed run's losses equal the uninterrupted run's, bit for bit."""
    muon = ("--optimizer.name", "Muon", "--optimizer.state_dtype", state_dtype, "--checkpoint.no_last_save_model_only")
    straight = Job(tmp_path / "straight", *muon)
    straight.start()
    losses = straight.train(6)
    first = Job(tmp_path / "resumed", *muon)
    first.start()
    first.train(3)
    first.manager.close()
    second = Job(tmp_path / "resumed", *muon, seed=123)
    assert second.start() == 3
    assert any("momentum_buffer" in s for s in second.optimizer.state.values())
    assert second.train(3) == losses[3:]


def test_switching_optimizer_on_resume_is_refused_unless_excluded(tmp_path):
    run(tmp_path, 3, "--checkpoint.no_last_save_model_only", steps=3)
    with pytest.raises(CheckpointError, match="holds another optimizer's state for layers.0.attention.wq.weight "
                                              r"\(exp_avg, exp_avg_sq, step, where this job's optimizer keeps "
                                              r"momentum_buffer\); resume with --checkpoint.exclude_from_loading "
                                              "optimizer"):
        Job(tmp_path, "--optimizer.name", "Muon", steps=6).start()
    job = Job(tmp_path, "--optimizer.name", "Muon", "--checkpoint.exclude_from_loading", "optimizer", steps=6)
    assert job.start() == 3
    job.train(1)


# ------------------------------------------------------------------ publishing and purging


def test_unfinished_save_is_ignored_and_removed(tmp_path):
    run(tmp_path, 3, "--checkpoint.no_last_save_model_only", steps=3)
    folder = os.path.join(tmp_path, "checkpoint")
    # What a crash in the middle of saving step 5 leaves behind: a partial .tmp folder.
    os.makedirs(os.path.join(folder, "step-5.tmp"))
    with open(os.path.join(folder, "step-5.tmp", "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 100)
    job = Job(tmp_path, steps=6)
    assert job.start() == 3
    assert not os.path.exists(os.path.join(folder, "step-5.tmp"))


def test_keep_latest_k_purges_older_checkpoints(tmp_path):
    job = run(tmp_path, 5, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2", steps=5)
    assert published_steps(job.folder()) == [4, 5]
    assert sorted(os.listdir(job.folder())) == ["step-4", "step-5"]


def test_keep_latest_k_zero_keeps_all(tmp_path):
    job = run(tmp_path, 3, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0", steps=3)
    assert published_steps(job.folder()) == [1, 2, 3]


def test_load_step_picks_an_older_checkpoint(tmp_path):
    run(tmp_path, 6, "--checkpoint.no_last_save_model_only")
    job = Job(tmp_path, "--checkpoint.load_step", "3")
    assert job.start() == 3


# ------------------------------------------------------------------ fine-tuning entry points


def test_seed_checkpoint_then_training_starts_from_it(tmp_path):
    seed = Job(tmp_path, "--checkpoint.create_seed_checkpoint", seed=7)
    assert seed.start() is None
    seed.manager.close()
    assert published_steps(seed.folder()) == [0]
    job = Job(tmp_path, seed=8)
    assert job.start() == 0
    assert_same_tensors(job.params(), seed.params())


def test_model_only_export_in_bfloat16_feeds_initial_load_path(tmp_path):
    trained = run(tmp_path / "a", 3, "--checkpoint.export_dtype", "bfloat16", steps=3)
    export = os.path.join(trained.folder(), "step-3")
    info = json.load(open(os.path.join(export, "titanlike.json")))
    assert info["contents"] == "model_only"
    metadata = ckpt_format.read_dcp_metadata(export)
    assert {md.properties.dtype for md in metadata.state_dict_metadata.values()} == {torch.bfloat16}
    assert "optimizer" not in {k.split(".")[0] for k in metadata.state_dict_metadata}

    job = Job(tmp_path / "b", "--checkpoint.initial_load_path", export, seed=9)
    assert job.start() == 0
    want = {k: v.to(torch.bfloat16).float() for k, v in trained.params().items()}
    assert_same_tensors(job.params(), want)
    # load_model reads the same export.
    model = load_model(export)
    assert_same_tensors({k: v.float() for k, v in model.state_dict().items()}, want)


def test_resuming_from_a_model_only_checkpoint_is_refused(tmp_path):
    run(tmp_path, 3, steps=3)  # last_save_model_only (the default)
    job = Job(tmp_path, steps=6)
    with pytest.raises(CheckpointError, match=r"step-3 holds the model only"):
        job.start()


# ------------------------------------------------------------------ damage gives a clear error


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    run(root, 3, "--checkpoint.no_last_save_model_only", steps=3)
    return root


@pytest.fixture
def saved(pristine, tmp_path):
    """A fresh copy of one full checkpoint at step 3, to damage."""
    shutil.copytree(pristine / "checkpoint", tmp_path / "checkpoint")
    return tmp_path, os.path.join(tmp_path, "checkpoint", "step-3")


def test_truncated_data_file(saved):
    root, path = saved
    data = os.path.join(path, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is truncated"):
        Job(root).start()


def test_missing_data_file(saved):
    root, path = saved
    os.remove(os.path.join(path, "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        Job(root).start()


def test_missing_index(saved):
    root, path = saved
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(CheckpointError, match=r"step-3 has no \.metadata file"):
        Job(root).start()


def test_garbage_index(saved):
    root, path = saved
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata is damaged"):
        Job(root).start()


def test_garbage_inside_an_entry_is_reported_not_raised_as_base_exception(saved):
    root, path = saved
    info = next(v for k, v in ckpt_format.read_dcp_metadata(path).storage_data.items() if k.fqn == "train_state.step")
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff" * info.length)
    # The checksums would name the file first (tests/unit/test_checkpoint_integrity.py): resealed
    # over the damage (a format-2 checkpoint without them is refused), it surfaces in DCP's read.
    from faults import reseal

    reseal(path)
    with pytest.raises(CheckpointError, match=r"loading checkpoint .*step-3 failed: rank 0"):
        Job(root).start()


def test_checkpoint_of_another_model_names_the_key(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match=r"'model\.tok_embeddings\.weight' has shape \(320, 64\) but this job's is \(400, 64\)"):
        Job(root, args=dataclasses.replace(ARGS, vocab_size=400)).start()


def test_checkpoint_missing_a_key_names_it(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match=r"has no entry 'model\.layers\.2\."):
        Job(root, args=dataclasses.replace(ARGS, n_layers=3)).start()


def test_load_step_that_does_not_exist(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match=r"load_step 7: .*step-7 does not exist \(published steps in .*: \[3\]\)"):
        Job(root, "--checkpoint.load_step", "7").start()


def test_seed_checkpoint_refuses_a_folder_with_checkpoints(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        Job(root, "--checkpoint.create_seed_checkpoint").start()


# ------------------------------------------------------------------ Hugging Face in one process


def test_initial_load_in_hf_and_last_save_in_hf(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**HF.args_to_config(ARGS))).eval()
    hf.save_pretrained(tmp_path / "hf")
    job = Job(tmp_path / "run", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
              "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf", steps=2, seed=3)
    assert job.start() == 0
    assert_same_tensors(job.params(), HF.from_hf_state_dict(hf.state_dict(), ARGS))
    job.train(2)
    job.manager.close()
    export = os.path.join(job.folder(), "step-2")
    assert ckpt_format.is_hf_folder(export) and not os.path.exists(os.path.join(export, "dcp"))
    back = LlamaForCausalLM.from_pretrained(export).eval()
    assert_same_tensors(HF.from_hf_state_dict(back.state_dict(), ARGS), job.params())
    # A Hugging Face export is not something training resumes from.
    with pytest.raises(CheckpointError, match="is a Hugging Face export"):
        Job(tmp_path / "run", steps=4).start()


def test_initial_load_in_hf_of_another_size_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = dataclasses.replace(ARGS, dim=128)
    LlamaForCausalLM(LlamaConfig(**HF.args_to_config(other))).save_pretrained(tmp_path / "hf")
    job = Job(tmp_path / "run", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
              "--checkpoint.initial_load_in_hf")
    with pytest.raises(CheckpointError, match=r"hf has hidden_size=128 but this job's model has 64 \(model\.flavor"):
        job.start()


def test_hf_config_comparison_is_key_by_key_and_ignores_the_context():
    """check_hf_args compares the two models' configs from the family's adapter, so it needs no
    family's field names."""
    from titanlike.checkpoint.loading import check_hf_args

    spec = get_model_spec("llama3")
    check_hf_args(spec, ARGS, ARGS.with_context_len(4096), "hf")  # context: not compared
    with pytest.raises(CheckpointError, match=r"^Hugging Face checkpoint hf has rope_theta=10000\.0 but this "
                                              r"job's model has 500000\.0 \(model\.flavor / tokenizer\)$"):
        check_hf_args(spec, ARGS, dataclasses.replace(ARGS, rope_theta=10000.0), "hf")
    with pytest.raises(CheckpointError, match=r"has tie_word_embeddings=true but this job's model has false"):
        check_hf_args(spec, ARGS, dataclasses.replace(ARGS, tie_word_embeddings=True), "hf")


# ------------------------------------------------------------------ the sidecar and the format module


def test_sidecar_records_the_args_with_the_flavors_context(tmp_path):
    job = run(tmp_path, 3, steps=3)
    info = json.load(open(os.path.join(job.folder(), "step-3", "titanlike.json")))
    context = llama3_flavors["debugmodel_tiny"].context_len
    assert info["model"] == {"name": "llama3", "flavor": "debugmodel_tiny",
                             "args": ARGS.with_context_len(context).to_dict()}
    spec, args = ckpt_format.build_args(info["model"])
    assert spec.name == "llama3" and args == ARGS.with_context_len(context)
    with pytest.raises(CheckpointError, match=r"^here: the args do not fit model llama3: .*n_experts"):
        ckpt_format.build_args({"name": "llama3", "args": {**info["model"]["args"], "n_experts": 8}}, where="here")
    with pytest.raises(CheckpointError, match=r"^here: unknown model 'nope'"):
        ckpt_format.build_args({"name": "nope", "args": {}}, where="here")


def test_unknown_hf_model_type_is_a_checkpoint_error():
    from titanlike.checkpoint.hf import hf_model_from_config

    with pytest.raises(CheckpointError, match=r"^x/config\.json: Hugging Face model_type 'whisper' is not supported"):
        hf_model_from_config({"model_type": "whisper"}, where="x/config.json")


def test_checkpoint_modules_import_in_layers():
    """No import cycle: each module of the package imports only those below it (format.py at the
    bottom, the manager's facade on top); hf.py, in particular, never imports the manager."""
    import ast

    import titanlike.checkpoint as package

    layers = ["format", "resume", "states", "hf", "megatron", "saving", "loading", "manager"]
    folder = os.path.dirname(package.__file__)
    assert sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py") and n != "__init__.py") == sorted(layers)
    for i, name in enumerate(layers):
        tree = ast.parse(open(os.path.join(folder, f"{name}.py")).read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported.add(node.module or "")
                imported.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
        above = {m for m in imported for other in layers[i:] if m.startswith(f"titanlike.checkpoint.{other}")}
        assert not above, (name, above)


def test_checkpoint_package_knows_no_converter_and_no_objective():
    """What a converter or an objective adds on load comes in as a LoadHook (models/load_hooks.py): no
    module of the package imports LoRA, the converters or an objective, at its top or in a function."""
    import ast

    import titanlike.checkpoint as package

    folder = os.path.dirname(package.__file__)
    forbidden = ("titanlike.models.lora", "titanlike.models.converters", "titanlike.objectives")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(folder, name)).read())):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            bad = [m for m in modules if m in forbidden or m.startswith(tuple(f"{f}." for f in forbidden))]
            assert not bad, f"titanlike/checkpoint/{name}:{node.lineno} imports {bad[0]}"


def test_load_model_refuses_tensors_that_do_not_fit_the_sidecar(tmp_path):
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_dcp_model

    model = Job(tmp_path, steps=1).parts[0]
    claimed = dataclasses.replace(ARGS, vocab_size=400)
    write_dcp_model(model.state_dict(), str(tmp_path / "x"),
                    {"contents": "model_only", "step": 0, "model": model_description("llama3", claimed)})
    with pytest.raises(CheckpointError, match=r"tok_embeddings\.weight has shape \(320, 64\) but model llama3 "
                                              r"needs \(400, 64\)"):
        load_model(tmp_path / "x")



def test_an_initial_load_with_a_nan_weight_is_refused_by_name(tmp_path):
    """checkpoint.initial_load_path is a DCP checkpoint this run did not write: its values are checked
    as a Hugging Face folder's are (a NaN weight named), before the first step, not a NaN loss at step 1.
    A frozen-copy reference (DPO, KL) starts from the same load."""
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_dcp_model

    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["layers.1.feed_forward.w2.weight"][3, 1] = float("inf")
    bad = tmp_path / "bad"
    write_dcp_model(sd, str(bad), {"contents": "model_only", "step": 0, "model": model_description("llama3", ARGS)})
    job = Job(tmp_path / "run", "--checkpoint.initial_load_path", str(bad), seed=9)
    with pytest.raises(CheckpointError, match=r"layers.1.feed_forward.w2.weight holds non-finite values") as e:
        job.start()
    assert "checkpoint.initial_load_path" in str(e.value) and "\n" not in str(e.value)
