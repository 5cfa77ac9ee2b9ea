"""The distillation loss (objectives/distill.py) against direct references on the same logits: torch's
F.kl_div on the whole vocabulary, TRL's generalized_jsd_loss (trl 1.16, GKDTrainer) at beta 0
(forward KL) and 1 (reverse KL), the top-k variant written out by hand, and the mix with the hard
labels; and the teachers a job refuses, each in one sentence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives.base import BatchContext
from titanlike.objectives.distill import Distill, DistillOptions, kl_per_token, teacher_targets

CPU = BatchContext(torch.device("cpu"))

B, S, V = 2, 5, 48


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(B, S, V, generator=g, dtype=torch.float64).float() * 2
    teacher = torch.randn(B, S, V, generator=g).float() * 3
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[0, :2] = IGNORE_INDEX
    return student, teacher, targets


def labels_of(teacher, targets, **options) -> dict[str, torch.Tensor]:
    o = DistillOptions(**options)
    return {"labels": targets, **teacher_targets(teacher, o.top_k, o.temperature)}


@pytest.mark.parametrize("loss,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0)])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kl_equals_kl_div_and_trl_generalized_jsd(logits, loss, beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    student, teacher, targets = logits
    student.requires_grad_(True)
    objective = Distill(family=None, options=DistillOptions(teacher="t", loss=loss, temperature=temperature))
    labels = labels_of(teacher, targets, temperature=temperature)
    terms = objective.loss(student, labels, CPU)
    ours = terms.value
    trained = targets != IGNORE_INDEX
    ls, lt = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
    direct = (F.kl_div(ls, lt, log_target=True, reduction="none") if loss == "forward_kl"
              else F.kl_div(lt, ls, log_target=True, reduction="none")).sum(-1)[trained].sum()
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=targets, beta=beta, temperature=temperature,
                                          reduction="sum")
    assert torch.allclose(ours, direct, rtol=1e-5) and torch.allclose(ours, trl, rtol=1e-5), (ours, direct, trl)
    grad, = torch.autograd.grad(ours, student)
    want, = torch.autograd.grad(direct, student)
    assert torch.allclose(grad, want, atol=1e-6)
    kl, hard = terms.reported
    assert torch.allclose(kl, ours.detach()) and torch.allclose(hard, F.cross_entropy(
        student.detach().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"))


def test_top_k_and_the_hard_label_mix(logits):
    student, teacher, targets = logits
    k, weight = 6, 0.25
    objective = Distill(family=None, options=DistillOptions(teacher="t", top_k=k, kl_weight=weight))
    labels = labels_of(teacher, targets, top_k=k)
    assert labels["teacher_logps"].shape == labels["teacher_ids"].shape == (B, S, k)
    assert labels["teacher_ids"].dtype == torch.int64
    ours = objective.loss(student, labels, CPU).value
    values, ids = teacher.topk(k, -1)
    p = F.softmax(values, -1)  # the teacher renormalized over its top k
    logq = F.log_softmax(student, -1).gather(-1, ids)
    trained = targets != IGNORE_INDEX
    kl = (p * (p.log() - logq)).sum(-1)[trained].sum()
    hard = F.cross_entropy(student.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    assert torch.allclose(ours, weight * kl + (1 - weight) * hard, rtol=1e-5)
    assert kl > 0
    # k = the vocabulary: the whole forward KL.
    whole = Distill(family=None, options=DistillOptions(teacher="t", top_k=V)).loss(
        student, labels_of(teacher, targets, top_k=V), CPU).value
    full = Distill(family=None, options=DistillOptions(teacher="t")).loss(student, labels_of(teacher, targets), CPU).value
    assert torch.allclose(whole, full, rtol=1e-5)
    assert torch.allclose(kl_per_token(student, labels, loss="forward_kl", top_k=k, temperature=1.0)[trained].sum(),
                          kl, rtol=1e-5)


def _teacher(tmp_path, name, flavor, **changes):
    """A model-only DCP checkpoint of `name` `flavor` (args changed by `changes`), written directly."""
    import dataclasses

    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_dcp_model
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors[flavor], **changes)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=1)
    out = tmp_path / name
    write_dcp_model(dict(model.state_dict()), str(out), {"contents": "model_only", "step": 0,
                                                        "model": model_description(name, args)})
    return out


def _plan(teacher, *extra):
    from titanlike.config.loader import load_job_config
    from titanlike.train.plan import plan_job

    cfg = load_job_config(["--model.flavor", "debugmodel_tiny", "--training.seq_len", "64", "--training.objective",
                           "distill", "--distill.teacher", str(teacher), *extra])
    return plan_job(cfg, 1)


def test_teachers_a_job_refuses_in_one_sentence(tmp_path):
    from titanlike.config.loader import ConfigError

    def refused(teacher, match, *extra):
        with pytest.raises(ConfigError, match=match) as e:
            _plan(teacher, *extra)
        assert "\n" not in str(e.value), e.value

    refused(_teacher(tmp_path, "llama3", "debugmodel_tiny", n_layers=1, vocab_size=1000), "has a vocabulary of 1000 "
            "tokens and the student 2048: a teacher must use the student's tokenizer")
    refused(_teacher(tmp_path, "bert", "debugmodel", n_layers=1), "is a bert model, which does not predict the next "
            "token: a teacher must")
    refused(tmp_path / "nowhere", "distill.teacher: .* is neither a DCP checkpoint")
    refused(tmp_path / "llama3", "distill.top_k keeps the teacher's most likely tokens", "--distill.top_k", "4",
            "--distill.loss", "reverse_kl")
    # Another family and size with the student's vocabulary is a teacher.
    plan = _plan(_teacher(tmp_path, "qwen3", "debugmodel", n_layers=1, vocab_size=2048))
    assert plan.objective.name == "distill"


def test_a_hugging_face_teacher_is_built_and_loaded_as_transformers_runs_it(tmp_path):
    """A teacher given as a Hugging Face folder (another family: Qwen3) is built with the job's layout
    and loaded (train/model_parts.py build_frozen_model): frozen, and its logits are transformers'."""
    import dataclasses

    import transformers

    from titanlike.checkpoint.hf import write_hf
    from titanlike.models.registry import get_model_spec
    from titanlike.train.model_parts import build_frozen_model

    spec = get_model_spec("qwen3")
    args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=1, vocab_size=2048)
    with torch.device("meta"):
        source = spec.model_cls(args)
    source.to_empty(device="cpu")
    source.init_weights(seed=2)
    folder = tmp_path / "qwen3_hf"
    write_hf(dict(source.state_dict()), spec, args, str(folder), context_len=64)
    plan = _plan(folder)
    parts = build_frozen_model(plan, str(folder), torch.device("cpu"), seed=0)
    assert len(parts) == 1 and not any(p.requires_grad for p in parts[0].parameters())
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(parts[0](tokens), hf(tokens).logits, atol=1e-4)


def test_a_dcp_teacher_is_loaded_from_its_shards_as_read_whole(tmp_path):
    """A DCP teacher goes through the sharded load (checkpoint/loading.py load_frozen_model: the
    checkpoint's index checked, then each rank's shards read): the same tensors as the checkpoint read
    whole (titanlike.load_model); an index of another shape and a damaged file are refused in one sentence."""
    import json

    import titanlike
    from titanlike.checkpoint.format import CheckpointError
    from titanlike.train.model_parts import build_frozen_model

    teacher = _teacher(tmp_path, "qwen3", "debugmodel", n_layers=1, vocab_size=2048)
    parts = build_frozen_model(_plan(teacher), str(teacher), torch.device("cpu"), seed=5)
    whole = titanlike.load_model(teacher).state_dict()
    got = parts[0].state_dict()
    assert set(got) == set(whole)
    for name, tensor in whole.items():
        assert torch.equal(got[name], tensor), name
    # A sidecar that does not describe the tensors beside it (a narrower model under its name).
    narrow = _teacher(tmp_path / "narrow", "qwen3", "debugmodel", n_layers=1, vocab_size=2048, dim=128)
    sidecar = json.loads((narrow / "titanlike.json").read_text())
    sidecar["model"] = json.loads((teacher / "titanlike.json").read_text())["model"]
    (narrow / "titanlike.json").write_text(json.dumps(sidecar))
    with pytest.raises(CheckpointError, match="has shape .* but model qwen3 needs") as e:
        build_frozen_model(_plan(teacher), str(narrow), torch.device("cpu"), seed=5)
    assert "\n" not in str(e.value)
    # A damaged file is found against the sidecar's checksums before any tensor is read.
    data = next(teacher.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="is corrupt: its CRC-32"):
        build_frozen_model(_plan(teacher), str(teacher), torch.device("cpu"), seed=5)


def test_a_nan_dcp_teacher_or_reference_is_refused_by_name_as_load_model_refuses_it(tmp_path):
    """A DCP checkpoint with a NaN weight, as a teacher (or an RL reference: the CHECKPOINT companion,
    the same build_frozen_model) and as a job's initial load (where a FROZEN_COPY reference starts):
    refused in one sentence naming the tensor, as titanlike.load_model refuses the same file."""
    import dataclasses

    import titanlike
    from titanlike.checkpoint.format import CheckpointError, model_description
    from titanlike.checkpoint.hf import write_dcp_model
    from titanlike.models.registry import get_model_spec
    from titanlike.train.model_parts import build_frozen_model

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=2048)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=1)
    sd = dict(model.state_dict())
    sd["layers.0.attention.wq.weight"] = sd["layers.0.attention.wq.weight"].clone()
    sd["layers.0.attention.wq.weight"][0, 0] = float("nan")
    bad = tmp_path / "nan"
    write_dcp_model(sd, str(bad), {"contents": "model_only", "step": 0, "model": model_description("llama3", args)})
    words = r"layers.0.attention.wq.weight holds non-finite values \(NaN or infinity\)"
    with pytest.raises(CheckpointError, match=words):
        titanlike.load_model(bad)
    with pytest.raises(CheckpointError, match=words) as e:
        build_frozen_model(_plan(bad), str(bad), torch.device("cpu"), seed=5)
    assert "\n" not in str(e.value)
