"""titanlike-convert from-megatron on Megatron-LM's default torch_dist format, written by
megatron.core.dist_checkpointing.save itself (whose writer forks a process and starts a multiprocessing
manager: hence this lane), and train.py starting from the converted checkpoint. The megatron-core models
run in this process (tests/megatron_models.py); the legacy format and hostile input:
tests/unit/test_megatron_import.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_JOB, read_metrics, train_here
from family_checks import first_batch_and_hf_loss
from megatron_models import FAMILIES, build_model, convert_options, megatron_world, reference_logits, save_torch_dist
from titanlike.checkpoint.hf import load_model
from titanlike.cli.convert import main as convert_main


def test_torch_dist_checkpoints_give_megatron_core_logits(tmp_path, capsys):
    with megatron_world():
        check_torch_dist(tmp_path, capsys)


def check_torch_dist(tmp_path, capsys):
    for family in FAMILIES:
        model = build_model(family, vocab_size=384, seed=2)
        tokens = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(1))
        want = reference_logits(model, tokens)
        folder = save_torch_dist(model, str(tmp_path / family), family)
        out = tmp_path / f"{family}-dcp"
        assert convert_main(["from-megatron", str(tmp_path / family), str(out), *convert_options(family)]) == 0
        with torch.no_grad():
            ours = load_model(out)(tokens)
        assert (ours - want).abs().max() <= 1e-5 * want.abs().max(), family
        sidecar = json.loads((out / "titanlike.json").read_text())
        assert sidecar["model"]["name"] == family and sidecar["source"] == folder
    # common.pt's Megatron-LM args are checked as a legacy file's are: an epsilon the flavor does not have.
    common = tmp_path / "qwen3" / "iter_0000010" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].norm_epsilon = 1e-5
    torch.save(state, common)
    assert convert_main(["from-megatron", str(tmp_path / "qwen3"), str(tmp_path / "again"),
                         *convert_options("qwen3")]) == 1
    assert "norm_epsilon 1e-05, the flavor has norm_eps 1e-06" in capsys.readouterr().err


def test_train_from_a_converted_checkpoint(tmp_path):
    """train.py (one process, the user's entry point) starts from the converted weights, Megatron's vocabulary
    padding dropped (--true-vocab-size): its first loss is megatron-core's on the same batch over the tokenizer's
    ids; two steps run."""
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    vocab = tokenizer.vocab_size
    with megatron_world():  # ended before train.py builds its own
        model = build_model("llama3", vocab_size=vocab + 128, seed=3)  # padded as Megatron pads
        save_torch_dist(model, str(tmp_path / "megatron"), "llama3")
        _, megatron_loss = first_batch_and_hf_loss(
            lambda tokens: SimpleNamespace(logits=reference_logits(model, tokens)[..., :vocab]), tokenizer)
    assert convert_main(["from-megatron", str(tmp_path / "megatron"), str(tmp_path / "step-0"),
                         "--model.name", "llama3", "--model.flavor", "debugmodel_tiny",
                         "--true-vocab-size", str(vocab)]) == 0
    dump = tmp_path / "run"
    proc = train_here([*TINY_JOB, "--model.flavor", "debugmodel_tiny", "--training.steps", "2",
                       "--training.local_batch_size", "8", "--job.dump_folder", str(dump), "--checkpoint.enable",
                       "--checkpoint.initial_load_path", str(tmp_path / "step-0")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(dump)]
    assert len(losses) == 2
    assert losses[0] == pytest.approx(megatron_loss, rel=1e-5)
