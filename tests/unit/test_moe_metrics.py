"""MoE load-balance metrics: ExpertBalance.summary's figures, the console's compact MoE summary,
and what reaches TensorBoard (scalars, per-layer histograms over expert ids) and metrics.jsonl."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

from titanlike.models.common.moe import STAT_NAMES, MoEArgs
from titanlike.observe.metrics import MetricsLogger, format_moe
from titanlike.train.expert_balance import ExpertBalance

E = 4
GLOBAL_TOKENS = 100.0


def _balance() -> ExpertBalance:
    # 3 layers, layer 0 dense: rows 1 and 2 are MoE. No model parts: summary() only reads the table.
    args = MoEArgs(num_experts=E, top_k=2, hidden_dim=8, first_k_dense=1, aux_loss_coeff=0.01)
    return ExpertBalance([], args, num_layers=3, device=torch.device("cpu"), group=None)


def _table() -> torch.Tensor:
    table = torch.zeros(3, E + len(STAT_NAMES))
    stat = {name: E + j for j, name in enumerate(STAT_NAMES)}
    table[1, :E] = torch.tensor([10.0, 10.0, 10.0, 10.0])  # perfectly balanced
    table[2, :E] = torch.tensor([5.0, 10.0, 15.0, 10.0])  # mean 10, population std sqrt(12.5)
    table[1, stat["routes"]], table[2, stat["routes"]] = 40, 40
    table[2, stat["dropped"]] = 4
    table[1, stat["aux_loss"]], table[2, stat["aux_loss"]] = 2.0, 4.0  # summed units
    return table


def test_summary_figures_of_a_known_table():
    out = _balance().summary(_table(), GLOBAL_TOKENS)
    cv2 = math.sqrt(12.5) / 10
    assert out["moe/layer1/load_cv"] == pytest.approx(0.0)
    assert out["moe/layer2/load_cv"] == pytest.approx(cv2)
    assert out["moe/layer1/load_min"] == pytest.approx(1.0) and out["moe/layer1/load_max"] == pytest.approx(1.0)
    assert out["moe/layer2/load_min"] == pytest.approx(0.5) and out["moe/layer2/load_max"] == pytest.approx(1.5)
    assert out["moe/layer1/dropped"] == 0.0 and out["moe/layer2/dropped"] == pytest.approx(0.1)
    assert out["moe/layer1/aux_loss"] == pytest.approx(0.02) and out["moe/layer2/aux_loss"] == pytest.approx(0.04)
    # Over layers: mean CV and drop fraction, extreme loads, summed losses (they add up in the objective).
    assert out["moe/load_cv"] == pytest.approx(cv2 / 2)
    assert out["moe/load_min"] == pytest.approx(0.5) and out["moe/load_max"] == pytest.approx(1.5)
    assert out["moe/dropped"] == pytest.approx(0.05)
    assert out["moe/aux_loss"] == pytest.approx(0.06)
    # The dense layer has no figures; a loss that is off (all zero) has no key.
    assert not any(k.startswith("moe/layer0/") for k in out)
    assert not any("z_loss" in k or "seq_aux_loss" in k for k in out)


def test_console_summary_format():
    out = _balance().summary(_table(), GLOBAL_TOKENS)
    assert format_moe(out) == "moe: cv 0.18 min 0.50 max 1.50 drop 5.0% aux 0.0600"
    assert format_moe({**out, "moe/z_loss": 0.00123}).endswith("aux 0.0600 z 0.0012")
    assert format_moe({"loss": 1.0}) == ""


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def console():
    handler, log = _Lines(), logging.getLogger("titanlike")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(old_level)


def _logger(tmp_path, **kwargs) -> MetricsLogger:
    return MetricsLogger(device=torch.device("cpu"), flops_per_token=1.0, tokens_per_step_per_device=64,
                         log_freq=1, is_writer=True, **kwargs)


def test_console_line_has_compact_moe_summary_only(console, tmp_path):
    metrics = _logger(tmp_path)
    out = _balance().summary(_table(), GLOBAL_TOKENS)
    metrics.step_done()
    metrics.log(1, loss=2.5, grad_norm=0.5, lr=1e-3, extra=out)
    metrics.step_done()
    metrics.log(2, loss=2.4, grad_norm=0.4, lr=1e-3)  # a dense model: the line as before
    metrics.close()
    moe_line, dense_line = console
    assert moe_line.endswith("GiB  moe: cv 0.18 min 0.50 max 1.50 drop 5.0% aux 0.0600")
    assert "layer" not in moe_line  # per-layer figures stay out of the console
    assert re.fullmatch(r"step:\s+2  loss:\s+2\.4000  grad_norm:\s+0\.4000  lr: 1\.000e-03  tps: [\d,]+  "
                        r"max_rss: \d+\.\d\dGiB", dense_line)


def test_tensorboard_and_jsonl_get_every_moe_key_and_expert_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    balance, table = _balance(), _table()
    metrics = _logger(tmp_path, tb_folder=str(tmp_path / "tb"), jsonl_path=str(tmp_path / "metrics.jsonl"))
    out = balance.summary(table, GLOBAL_TOKENS)
    counts = {1: table[1, :E], 2: table[2, :E]}
    for step in (1, 2):
        metrics.step_done()
        record = metrics.log(step, loss=2.0, grad_norm=1.0, lr=1e-3, extra=out, expert_counts=counts)
    metrics.close()
    assert all(not isinstance(v, (list, dict)) for v in record.values())  # the returned record: scalars

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})  # 0: keep all (default 1)
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert set(out) <= scalars and {"loss", "tps", "max_rss"} <= scalars
    assert [e.value for e in acc.Scalars("moe/layer2/load_max")] == pytest.approx([1.5, 1.5])
    assert set(acc.Tags()["histograms"]) == {"moe/layer1/tokens_per_expert", "moe/layer2/tokens_per_expert"}
    events = acc.Histograms("moe/layer2/tokens_per_expert")
    assert [e.step for e in events] == [1, 2]
    hist = events[-1].histogram_value
    # One bucket per expert id, holding that expert's routes.
    assert list(hist.bucket_limit) == [0.5, 1.5, 2.5, 3.5]
    assert list(hist.bucket) == [5.0, 10.0, 15.0, 10.0]
    assert (hist.min, hist.max, hist.num) == (0, 3, 40)
    assert hist.sum == pytest.approx(0 * 5 + 1 * 10 + 2 * 15 + 3 * 10)

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert set(out) <= set(lines[0])
    assert lines[0]["tokens_per_expert"] == {"1": [10, 10, 10, 10], "2": [5, 10, 15, 10]}


def test_histogram_skips_a_layer_without_routes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = _logger(tmp_path, tb_folder=str(tmp_path / "tb"))
    metrics.step_done()
    metrics.log(1, loss=2.0, grad_norm=1.0, lr=1e-3, expert_counts={1: torch.zeros(E), 2: [0.0, 3.0, 1.0, 0.0]})
    metrics.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["histograms"] == ["moe/layer2/tokens_per_expert"]
    hist = acc.Histograms("moe/layer2/tokens_per_expert")[0].histogram_value
    assert (hist.min, hist.max, hist.num) == (1, 2, 4)  # the ids of the least and greatest used expert
