import math

import pytest
import torch

from titanlike.config.schema import LRScheduler
from titanlike.train.optimizer import build_lr_scheduler, lr_factor


def factors(total, **kw):
    base = dict(warmup_steps=2, total_steps=total, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    base.update(kw)
    return [lr_factor(s, **base) for s in range(total)]


def test_warmup_then_linear_decay():
    f = factors(6)
    assert f[:2] == pytest.approx([1 / 3, 2 / 3])
    # Decay spans the 4 post-warm-up steps: 1, 0.75, 0.5, 0.25.
    assert f[2:] == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_wsd_stable_phase_and_min_lr():
    f = factors(12, warmup_steps=2, decay_ratio=0.5, min_lr_factor=0.1)
    assert f[2:7] == pytest.approx([1.0] * 5)  # stable
    assert f[7] == pytest.approx(1.0)  # decay starts at 1
    assert f[11] == pytest.approx(0.1 + 0.9 * (1 - 4 / 5))
    assert min(f) >= 0.1 - 1e-12


def test_cosine_and_sqrt():
    f = factors(6, warmup_steps=0, decay_type="cosine")
    assert f == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 6)) for s in range(6)])
    f = factors(4, warmup_steps=0, decay_type="sqrt")
    assert f == pytest.approx([1 - math.sqrt(s / 4) for s in range(4)])


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=1, decay_type="linear"), total_steps=3)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 2.0, 1.0])
