"""The step's update (titanlike/train/step.py): fused AdamW takes the division by the token count and
the clipping coefficient as its grad_scale, the foreach and for-loop kernels get gradients scaled in a
pass of their own; both must make the same update."""

from __future__ import annotations

import torch

from conftest import TINY_JOB
from titanlike.config import load_job_config
from titanlike.train.plan import plan_job
from titanlike.train.trainer import Trainer


def _trained(tmp_path, implementation: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    cfg = load_job_config([*TINY_JOB, "--model.flavor", "debugmodel_tiny", "--training.steps", "4",
                           "--training.local_batch_size", "2", "--optimizer.implementation", implementation,
                           # Clipped at every step, by a coefficient that changes from step to step:
                           # AdamW is blind to a constant scale of the gradients, not to that.
                           "--training.max_norm", "0.05", "--lr_scheduler.warmup_steps", "0",
                           "--job.dump_folder", str(tmp_path / implementation)])
    trainer = Trainer(plan_job(cfg, 1))
    try:
        model = trainer.model_parts[0]
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer.train()
        return before, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        trainer.close()


def test_fused_adamw_clips_through_grad_scale_as_foreach_clips_the_gradients(tmp_path):
    start, fused = _trained(tmp_path, "fused")
    _, foreach = _trained(tmp_path, "foreach")
    moved = [k for k in fused if not torch.equal(fused[k], start[k])]
    assert len(moved) > len(fused) // 2
    for key in fused:
        torch.testing.assert_close(fused[key], foreach[key], rtol=1e-5, atol=1e-6, msg=key)
