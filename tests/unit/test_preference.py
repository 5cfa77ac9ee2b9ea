"""DPO and its variants against TRL (trl 1.16), on the same tiny transformers model and batch.

TRL's DPOTrainer computes its loss from its own padded batch (`_compute_loss`: chosen rows then
rejected rows, a completion mask); ours packs each pair into one sample (data/preferences.py) and
reads its log-probabilities from logits laid out like that sample. The logits of both come from the
same Hugging Face model: our packed layout takes each position's logits from the row and offset of
TRL's batch that it holds (which a document mask with per-document positions would compute), so the
loss, the rewards and every gradient of the model must agree. SimPO is CPOTrainer's: its cpo_loss
on its get_batch_logps, fed the same logits.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from titanlike.data.preferences import PreferenceSamples, pack_pairs
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives.base import BatchContext
from titanlike.objectives.preference import DPO, DPOOptions, pair_starts, token_logps

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

VOCAB = 64
# (prompt, chosen, rejected) as whitespace-separated token names of the test tokenizer.
ROWS = [("t5 t6", " t7 t8 t9", " t10"), ("t11", " t12", " t13 t14 t15 t16"), ("t17 t18 t19 t20", " t21 t22", " t23 t24"),
        ("t25 t26", " t27 t28 t29 t30 t31", " t32 t33 t34")]


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", pad_token="t2", unk_token="t0")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    policy, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)
    data = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS])
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], per_device_train_batch_size=len(ROWS),
                     use_cpu=True, bf16=False, beta=0.1)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer, policy, reference, batch


def packed_layout(batch, seq_len: int):
    """Our samples of TRL's batch (rows: the chosen answers, then the rejected ones), and for each of
    their positions the flat index (row * L + offset) of TRL's logits it takes."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    n, width = ids.shape[0] // 2, ids.shape[1]
    lengths = batch["attention_mask"].sum(1).tolist()

    def sides(values):
        return [(f"pair {k}", *[(values(r)[: lengths[r]], completion[r, : lengths[r]].bool().numpy())
                                for r in (k, n + k)]) for k in range(n)]

    tokens = PreferenceSamples(pack_pairs(sides(lambda r: ids[r].tolist()), seq_len=seq_len), seq_len=seq_len,
                               packing=True, pad_id=0)
    codes = PreferenceSamples(pack_pairs(sides(lambda r: [r * width + o for o in range(width)]), seq_len=seq_len),
                              seq_len=seq_len, packing=True, pad_id=0)
    samples = [tokens[i] for i in range(len(tokens))]
    stacked = {k: torch.as_tensor(np.stack([s[k] for s in samples])) for k in samples[0]}
    where = torch.as_tensor(np.stack([codes[i]["inputs"] for i in range(len(codes))]))
    return stacked, where, len(tokens)


def our_loss(objective: DPO, policy, reference, batch, *, seq_len: int = 24):
    """(mean loss per pair, mean reported terms) of our objective on TRL's batch, packed."""
    stacked, where, samples = packed_layout(batch, seq_len)
    assert samples < batch["input_ids"].shape[0] // 2, "packing put more than one pair in a sample"
    labels, documents = stacked["labels"], stacked["document_ids"]
    targets = {"labels": labels, "document_ids": documents, "pair_start": pair_starts(labels != -100, documents)}

    def logits(model):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return out.flatten(0, 1)[where]

    with torch.no_grad():
        targets["ref_logps"] = token_logps(logits(reference), labels)
    pairs = targets["pair_start"].sum()
    terms = objective.loss(logits(policy), targets, BatchContext(torch.device("cpu")))
    return terms.value / pairs, terms.reported / pairs


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1), ("robust", 0.0)]


@pytest.mark.parametrize("loss_type,smoothing", CASES)
def test_dpo_loss_rewards_and_gradients_equal_trl(trl_setup, loss_type, smoothing):
    trainer, policy, reference, batch = trl_setup
    trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = [loss_type], [1.0], smoothing
    trainer._metrics["train"].clear()
    policy.zero_grad()
    theirs = trainer._compute_loss(policy, batch, False)
    theirs.backward()
    their_grads = grads(policy)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    policy.zero_grad()
    objective = DPO(DPOOptions(beta=0.1, loss_type=loss_type, label_smoothing=smoothing))
    ours, reports = our_loss(objective, policy, reference, batch)
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert theirs.item() > 0
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    for value, name in zip(reports.tolist(), names):
        assert value == pytest.approx(metrics[name], abs=1e-5), name
    mine = grads(policy)
    assert mine.keys() == their_grads.keys()
    for name, g in their_grads.items():
        torch.testing.assert_close(mine[name], g, atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().max() > 1e-4 for g in their_grads.values())


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_sigmoid_label_smoothing_equals_trl_conservative_loss(trl_setup, smoothing):
    """trl 1.16's DPO sigmoid has no label smoothing; CPOTrainer's sigmoid keeps the conservative
    form, which is DPO's when fed the log-ratios (its loss is a function of their difference)."""
    from trl.experimental.cpo import CPOTrainer

    _, policy, reference, batch = trl_setup
    chosen, rejected = sequence_logps(policy, batch, average=False)
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logps(reference, batch, average=False)
    cpo = types.SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=0.1, label_smoothing=smoothing, simpo_gamma=0.0,
                                accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    losses, _, _ = CPOTrainer.cpo_loss(cpo, chosen - ref_chosen, rejected - ref_rejected)
    policy.zero_grad()
    losses.mean().backward()
    their_grads = grads(policy)
    policy.zero_grad()
    ours, _ = our_loss(DPO(DPOOptions(beta=0.1, label_smoothing=smoothing)), policy, reference, batch)
    ours.backward()
    assert ours.item() == pytest.approx(losses.mean().item(), abs=1e-5)
    for name, g in their_grads.items():
        torch.testing.assert_close(grads(policy)[name], g, atol=1e-5, rtol=1e-4, msg=name)


def sequence_logps(model, batch, *, average: bool):
    """CPOTrainer's per-sequence log-probabilities of the completions (chosen, rejected)."""
    from trl.experimental.cpo import CPOTrainer

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)
    return logps.chunk(2)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trl_cpo_simpo(trl_setup, smoothing):
    from trl.experimental.cpo import CPOTrainer

    _, policy, reference, batch = trl_setup
    cpo = types.SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, label_smoothing=smoothing, simpo_gamma=0.7,
                                accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    policy.zero_grad()
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, *sequence_logps(policy, batch, average=True))
    losses.mean().backward()
    their_grads = grads(policy)
    policy.zero_grad()
    options = DPOOptions(beta=2.0, loss_type="simpo", simpo_gamma=0.7, label_smoothing=smoothing)
    ours, reports = our_loss(DPO(options), policy, reference, batch)
    ours.backward()
    assert ours.item() == pytest.approx(losses.mean().item(), abs=1e-5)
    assert reports[0].item() == pytest.approx(chosen_rewards.mean().item(), abs=1e-5)
    assert reports[1].item() == pytest.approx(rejected_rewards.mean().item(), abs=1e-5)
    for name, g in their_grads.items():
        torch.testing.assert_close(grads(policy)[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_help_says_sigmoid_label_smoothing_is_conservative_dpo_not_trl_1_16s(trl_setup):
    """TRL 1.16's DPOTrainer ignores label_smoothing for sigmoid (its loss with 0.2 is its loss with 0);
    ours is conservative DPO (test above), and dpo.label_smoothing's help says which we follow."""
    import dataclasses

    from titanlike.config.loader import help_text

    trainer, policy, _, batch = trl_setup
    trainer.loss_types, trainer.loss_weights = ["sigmoid"], [1.0]
    with torch.no_grad():
        trainer.label_smoothing = 0.2
        smoothed = trainer._compute_loss(policy, batch, False).item()
        trainer.label_smoothing = 0.0
        plain = trainer._compute_loss(policy, batch, False).item()
    assert smoothed == plain
    doc = next(f for f in dataclasses.fields(DPOOptions) if f.name == "label_smoothing").metadata["doc"]
    assert "conservative DPO for sigmoid" in doc and "TRL 1.16's DPOTrainer, which ignores it for sigmoid" in doc
    assert "TRL 1.16's DPOTrainer" in " ".join(help_text().split())


@pytest.mark.parametrize("converters,adapter_path,reference,want", [
    ([], None, "auto", "model"), (["lora"], None, "auto", "adapters"), (["lora"], "peft_adapter", "auto", "model"),
    (["lora"], "peft_adapter", "adapters", "adapters"), (["lora"], None, "model", "model")])
def test_the_reference_of_a_pretrained_adapter_is_its_copy_as_trl_has_it(converters, adapter_path, reference, want):
    """TRL 1.16's DPOTrainer on a PEFT model: a new adapter's reference is the base (adapters disabled), a
    pretrained adapter's a frozen copy of it; dpo.reference auto (the default) does the same, and both
    stay on offer (issue 45.18)."""
    from titanlike.config.schema import JobConfig
    from titanlike.models.registry import get_model_spec
    from titanlike.objectives.companion import Source

    cfg = JobConfig()
    cfg.model.converters, cfg.lora.adapter_path, cfg.dpo.reference = converters, adapter_path, reference
    objective = DPO.for_job(cfg, get_model_spec("llama3").flavors["debugmodel"])
    assert objective.options.reference == want
    (companion,) = objective.companions
    assert companion.source == (Source.POLICY if want == "adapters" else Source.FROZEN_COPY)
    assert companion.converters_off == (want == "adapters")
    assert DPOOptions().reference == "auto"
