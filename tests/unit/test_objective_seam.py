"""The objective seam: a family's forward may return auxiliary losses beside the logits, and its
spec may build the loss; the trainer only calls loss_fn(output, labels) and divides by the step's
target tokens. A test-only family (Llama 3 whose forward adds a logit-size penalty) goes through
the real Trainer in one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_JOB
from titanlike.config import load_job_config
from titanlike.models.llama3 import Transformer, llama3_flavors
from titanlike.models.outputs import ModelOutput
from titanlike.models.registry import ModelSpec, get_model_spec, model_names, register_model_spec
from titanlike.train.loss import IGNORE_INDEX, build_cross_entropy_loss
from titanlike.train.trainer import Trainer
from titanlike.train.validate import validate_config

PENALTY = 1e-3
SEEN: list[tuple[ModelOutput, torch.Tensor]] = []


class PenalizedLlama(Transformer):
    def forward(self, tokens, positions=None, mask=None):
        logits = super().forward(tokens, positions, mask)
        return ModelOutput(logits, {"logit_penalty": PENALTY * logits.float().pow(2).sum()})


def recording_loss(cfg):
    default = build_cross_entropy_loss()

    def loss_fn(output, labels):
        SEEN.append((output, labels))
        return default(output, labels)

    return loss_fn


def _register() -> None:
    if "test_penalized_llama" not in model_names():
        llama = get_model_spec("llama3")
        register_model_spec(ModelSpec(name="test_penalized_llama", model_cls=PenalizedLlama, flavors=llama3_flavors,
                                      shard=llama.shard, pipeline_ends=llama.pipeline_ends,
                                      build_loss=recording_loss))


def first_step(tmp_path, name: str) -> tuple[float, float]:
    cfg = load_job_config([*TINY_JOB, "--model.name", name, "--training.steps", "1", "--training.local_batch_size", "2",
                           "--job.dump_folder", str(tmp_path / name)])
    trainer = Trainer(cfg, validate_config(cfg, world_size=1))
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
    # The spec's loss builder was used, and it got the whole ModelOutput.
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
