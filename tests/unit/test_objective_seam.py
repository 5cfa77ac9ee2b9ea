"""The objective seam: a family's forward may return auxiliary losses beside the logits, and its
spec names its objective; the trainer only calls objective.loss(output, targets, ctx) and divides by
the step's target tokens. A test-only family (Llama 3 whose forward adds a logit-size penalty, with an
objective that records what its loss got) goes through the real Trainer in one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_JOB
from titanlike.config import load_job_config
from titanlike.models.llama3 import Transformer, llama3_flavors
from titanlike.models.outputs import IGNORE_INDEX, ModelOutput
from titanlike.models.registry import ModelSpec, get_model_spec, model_names, register_model_spec
from titanlike.objectives import BatchContext, CausalLM
from titanlike.objectives.registry import register_family_objective
from titanlike.train.trainer import Trainer
from titanlike.train.plan import plan_job

PENALTY = 1e-3
SEEN: list[tuple[ModelOutput, torch.Tensor]] = []


class PenalizedLlama(Transformer):
    def forward(self, tokens, positions=None, mask=None):
        logits = super().forward(tokens, positions, mask)
        return ModelOutput(logits, {"logit_penalty": PENALTY * logits.float().pow(2).sum()})


class RecordingCausalLM(CausalLM):
    name = "test_recording_causal_lm"

    def loss(self, output, targets, ctx, *, correct=False):
        SEEN.append((output, targets["labels"]))
        return super().loss(output, targets, ctx, correct=correct)


def _register() -> None:
    if "test_penalized_llama" not in model_names():
        register_family_objective(RecordingCausalLM.name, RecordingCausalLM.for_job)
        llama = get_model_spec("llama3")
        register_model_spec(ModelSpec(name="test_penalized_llama", model_cls=PenalizedLlama, flavors=llama3_flavors,
                                      shard=llama.shard, pipeline_ends=llama.pipeline_ends,
                                      objective=RecordingCausalLM.name))


def first_step(tmp_path, name: str) -> tuple[float, float]:
    cfg = load_job_config([*TINY_JOB, "--model.name", name, "--training.steps", "1", "--training.local_batch_size", "2",
                           "--job.dump_folder", str(tmp_path / name)])
    trainer = Trainer(plan_job(cfg, 1))
    try:
        data = iter(trainer.dataloader)
        out = trainer.train_step([trainer.prepare(next(data))])
        return (out.loss_sum / out.tokens).item(), out.grad_norm.item()
    finally:
        trainer.close()


def test_auxiliary_losses_reach_the_loss_and_the_gradients(tmp_path):
    _register()
    SEEN.clear()
    plain_loss, plain_norm = first_step(tmp_path, "llama3")
    loss, norm = first_step(tmp_path, "test_penalized_llama")
    # The spec's objective was used, and its loss got the whole ModelOutput.
    assert len(SEEN) == 1
    output, labels = SEEN[0]
    assert isinstance(output, ModelOutput) and set(output.aux_losses) == {"logit_penalty"}
    tokens = (labels != IGNORE_INDEX).sum().item()
    ce = F.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
    penalty = output.aux_losses["logit_penalty"].item()
    assert penalty > 0.01 * ce  # large enough to show
    # Same init (same parameter names and seed): the plain model's loss is the CE part alone.
    assert plain_loss == pytest.approx(ce / tokens, rel=1e-6)
    assert loss == pytest.approx((ce + penalty) / tokens, rel=1e-6)
    # The penalty's gradient flowed: the clipped norm is not the plain one.
    assert math.isfinite(norm) and abs(norm - plain_norm) > 1e-3 * plain_norm


# ---------------------------------------------------------------- the objectives' own pieces


def _loader(objective, seq_len: int = 32):
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_dataloader, build_tokenizer

    return build_dataloader(dataset="default", dataset_path=None, tokenizer=build_tokenizer(DEFAULT_TOKENIZER_PATH),
                            seq_len=seq_len, local_batch_size=2, global_batch_size=2, dp_rank=0, dp_degree=1, seed=0,
                            objective=objective)


@pytest.mark.parametrize("name", ["causal_lm", "masked_lm", "span_corruption"])
def test_the_loader_yields_the_fields_each_objective_declares(name):
    """sample_fields (what the estimator fakes batches from) is what the loader yields, by name,
    shape and dtype, for every objective (causal LM's token windows included)."""
    from titanlike.objectives import CausalLM, MaskedLM, SpanCorruption, SpanCorruptionOptions

    objective = {"causal_lm": CausalLM(), "masked_lm": MaskedLM(sentence_pairs=True),
                 "span_corruption": SpanCorruption(SpanCorruptionOptions(decoder_seq_len=8))}[name]
    batch = next(iter(_loader(objective)))
    want = objective.sample_fields(32)
    assert {k: (tuple(v.shape), str(v.dtype)) for k, v in batch.items()} == {
        k: ((2, *shape), f"torch.{dtype}") for k, (shape, dtype) in want.items()}


def test_causal_lm_prepares_masks_lookahead_and_the_context_parallel_cut():
    """Labels masked after an end of document, positions restarting per document, multi-token
    prediction's targets built on the whole sequence; then every per-token tensor cut to this cp
    rank's load-balanced positions, the document ids kept whole."""
    from titanlike.models.common.attention import DocumentMask
    from titanlike.objectives import BatchContext, lookahead_targets
    from titanlike.parallel.context import load_balanced_positions

    eos = 0
    inputs = torch.tensor([[7, 8, eos, 9, 10, 11, 12, 13], [eos, 5, 6, 7, eos, 8, 9, 10]])
    labels = torch.cat([inputs[:, 1:], torch.tensor([[14], [11]])], 1)
    objective = CausalLM(document_masking=True, eod_mask_loss=True)
    positions = load_balanced_positions(8, 2, 1, "cpu")
    ctx = BatchContext(torch.device("cpu"), cp_positions=positions, eos_id=eos, lookahead_tokens=2)
    mb = objective.prepare({"inputs": inputs, "labels": labels}, ctx)
    masked = labels.masked_fill(inputs == eos, IGNORE_INDEX)
    whole = DocumentMask.from_tokens(inputs, eos, None)
    assert torch.equal(mb.inputs, inputs[:, positions]) and torch.equal(mb.targets["labels"], masked[:, positions])
    assert torch.equal(mb.positions, whole.positions[:, positions])
    assert torch.equal(mb.mask.document_ids, whole.document_ids)  # whole: cp attention picks its rows
    want = lookahead_targets(labels, masked, 2, whole.document_ids)[:, positions]
    assert torch.equal(mb.lookahead, want)
    assert set(mb.forward_kwargs()) == {"positions", "mask", "lookahead"}
    plain = CausalLM().prepare({"inputs": inputs, "labels": labels}, BatchContext(torch.device("cpu")))
    assert plain.mask is None and plain.positions is None and plain.lookahead is None
    assert torch.equal(plain.targets["labels"], labels) and plain.forward_kwargs() == {"positions": None, "mask": None}


def test_padded_samples_cut_their_token_fields_only():
    """Masked LM: document ids -> a bidirectional padding mask; under context parallelism inputs,
    labels and token types are cut, the per-sample binary fields are not."""
    from titanlike.objectives import BatchContext, MaskedLM
    from titanlike.parallel.context import load_balanced_positions

    batch = next(iter(_loader(MaskedLM(sentence_pairs=True))))
    positions = load_balanced_positions(32, 2, 0, "cpu")
    mb = MaskedLM(sentence_pairs=True).prepare(batch, BatchContext(torch.device("cpu"), cp_positions=positions))
    assert torch.equal(mb.inputs, batch["inputs"][:, positions])
    assert torch.equal(mb.targets["labels"], batch["labels"][:, positions])
    assert torch.equal(mb.fields["token_types"], batch["token_types"][:, positions])
    assert torch.equal(mb.fields["binary_labels"], batch["binary_labels"])
    assert not mb.mask.causal and torch.equal(mb.mask.document_ids, batch["document_ids"])
    assert set(mb.rows(0, 1)) == {"positions", "mask", "token_types", "binary_labels", "binary_weights"}


def test_loss_adds_auxiliary_losses_and_compiles_only_when_used():
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    labels[0, 0] = IGNORE_INDEX
    objective = CausalLM(compile_loss=True, compile_backend="no_such_backend")
    assert "_cross_entropy" not in vars(objective)  # building one to check a job's rules compiles nothing
    plain = CausalLM()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ctx = BatchContext(torch.device("cpu"))
    assert torch.equal(plain.loss(logits, {"labels": labels}, ctx).value, ce)
    aux = torch.tensor(0.25)
    assert torch.equal(plain.loss(ModelOutput(logits, {"aux": aux}), {"labels": labels}, ctx).value, ce + aux)
