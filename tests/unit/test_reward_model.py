"""Reward models (training.objective reward) against transformers and TRL (trl 1.16).

Our model with its scalar head is exported (checkpoint/hf.py write_hf) as the family's
`...ForSequenceClassification` (num_labels 1, pad_token_id set); transformers loads it and scores
right-padded sequences at their last non-pad token with the scores our model gives at that token
(fp32, within 1e-4). TRL's RewardTrainer.compute_loss on that transformers model and a batch of
chosen rows then rejected rows gives the loss and metrics our objective gives on the same pairs,
packed two documents per pair (data/preferences.py) with their whole sequences as inputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from titanlike.data.preferences import PreferenceSamples, pack_pairs
from titanlike.models.registry import get_model_spec
from titanlike.objectives.base import BatchContext
from titanlike.objectives.reward import RewardModel, RewardOptions

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

VOCAB, PAD = 64, 2
# (chosen, rejected) whole token sequences (prompt then answer); the answer starts at PROMPT[i].
PAIRS = [([5, 6, 7, 8, 9], [5, 6, 10]), ([11, 12], [11, 13, 14, 15, 16]), ([17, 18, 19, 20, 21, 22], [17, 18, 19, 20, 23]),
         ([25, 26, 27, 28, 29, 30, 31], [25, 26, 32, 33])]
PROMPT = [2, 1, 4, 2]


def our_model(family: str):
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debugmodel_tiny" if family == "llama3" else "debugmodel"], n_layers=2,
                               vocab_size=VOCAB, max_seq_len=64).with_score_head()
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return spec, args, model.eval()


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


def packed_batch(margins=None):
    """Our samples of PAIRS: each side whole as inputs (a final pad target, as tokenize_pairs' end_id);
    margins: each pair's `margin` (None: the rows have none)."""
    def side(ids, start):
        mask = np.zeros(len(ids) + 1, dtype=bool)
        mask[start:] = True
        return [*ids, PAD], mask

    extra = [()] * len(PAIRS) if margins is None else [({"margin": m},) for m in margins]
    pairs = pack_pairs([(f"pair {k}", side(c, s), side(r, s), *extra[k])
                        for k, ((c, r), s) in enumerate(zip(PAIRS, PROMPT))], seq_len=24)
    samples = PreferenceSamples(pairs, seq_len=24, packing=True, pad_id=PAD)
    rows = [samples[i] for i in range(len(samples))]
    assert len(rows) < len(PAIRS)  # several pairs share a sample
    return {k: torch.as_tensor(np.stack([r[k] for r in rows])) for k in samples.fields}


@pytest.mark.parametrize("family,margins", [("llama3", None), ("qwen3", None), ("llama3", [0.5, -1.0, 2.0, 0.0])])
def test_exported_reward_model_scores_and_trl_loss_agree(family, margins, tmp_path):
    """margins: TRL's `margin` column, which its RewardTrainer subtracts inside the sigmoid (issue 45.18)."""
    import json

    from titanlike.checkpoint.hf import write_hf

    spec, args, model = our_model(family)
    write_hf(dict(model.state_dict()), spec, args, str(tmp_path), context_len=64, bos_id=0, eos_id=1, pad_id=PAD)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [spec.hf.score_architecture] and config["num_labels"] == 1
    assert config["pad_token_id"] == PAD
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    hf.eval()

    rows = [c for c, _ in PAIRS] + [r for _, r in PAIRS]
    ids = padded(rows)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=(ids != PAD).long()).logits[:, 0]
        ours = torch.stack([model(torch.tensor([r]))[0, -1, 0] for r in rows])
    assert torch.allclose(ours, theirs, atol=1e-4), (ours, theirs)

    # TRL's loss computation on the transformers model.
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import RewardConfig, RewardTrainer

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", pad_token=f"t{PAD}", unk_token="t0")
    data = Dataset.from_list([{"chosen": "t5", "rejected": "t6"}])
    trainer = RewardTrainer(model=hf, args=RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                                                       bf16=False, center_rewards_coefficient=0.01),
                            train_dataset=data, processing_class=tokenizer)
    hf.train()
    inputs = {"input_ids": ids, "attention_mask": (ids != PAD).long()}
    if margins is not None:
        inputs["margin"] = torch.tensor(margins)
    trl_loss = trainer.compute_loss(hf, inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    objective = RewardModel(RewardOptions(center_rewards_coefficient=0.01))
    ctx = BatchContext(torch.device("cpu"), mask_kernel="sdpa")
    mb = objective.prepare(packed_batch(margins), ctx)
    pairs = mb.units
    assert int(pairs) == len(PAIRS)
    model.train()
    terms = objective.loss(model(mb.inputs, **mb.forward_kwargs()), mb.targets, ctx)
    loss = terms.value / pairs
    chosen, rejected, margin, accuracy = (terms.reported / pairs).tolist()
    assert abs(loss.item() - trl_loss.item()) < 1e-5, (loss.item(), trl_loss.item())
    assert abs(margin - metrics["margin"]) < 1e-5 and abs(accuracy - metrics["accuracy"]) < 1e-6
    assert abs((chosen + rejected) / 2 - metrics["mean_reward"]) < 1e-5


def test_a_family_without_a_scalar_head_is_refused_in_one_sentence():
    from titanlike.config.loader import ConfigError
    from titanlike.config.schema import JobConfig
    from titanlike.train.plan import plan_job

    cfg = JobConfig()
    cfg.model.name, cfg.model.flavor, cfg.training.objective = "bert", "debugmodel", "reward"
    cfg.training.seq_len = 128
    with pytest.raises(ConfigError, match="reward puts a scalar head on a decoder") as e:
        plan_job(cfg, 1, vocab_size=256)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["hf", "dcp"])
def test_a_reward_model_starts_from_a_language_model(kind, tmp_path):
    """SFT -> reward: a job starting from a LlamaForCausalLM folder (checkpoint.initial_load_in_hf) or
    from a language model's DCP checkpoint (an SFT run's step folder) loads every tensor but the output
    projection, whose one-score head starts from its initialization."""
    from conftest import REPO, train_in_process

    import titanlike
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_hf
    from titanlike.checkpoint.hf import write_dcp_model

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], n_layers=2, vocab_size=2048, max_seq_len=64)
    with torch.device("meta"):
        lm = spec.model_cls(args)
    lm.to_empty(device="cpu")
    lm.init_weights(seed=5)
    if kind == "hf":
        write_hf(dict(lm.state_dict()), spec, args, str(tmp_path / "sft"), context_len=64)
    else:
        write_dcp_model(dict(lm.state_dict()), str(tmp_path / "sft"),
                        {"contents": "model_only", "step": 0, "model": model_description("llama3", args)})
    train_in_process(["--job.config_file", str(REPO / "train_configs" / "reward_debug.toml"), "--training.steps", "1",
                      "--optimizer.lr", "1e-10", "--metrics.no_enable_tensorboard", "--job.dump_folder", str(tmp_path / "rm"),
                      "--checkpoint.initial_load_path", str(tmp_path / "sft"),
                      *(["--checkpoint.initial_load_in_hf"] if kind == "hf" else [])])
    reward = titanlike.load_model(tmp_path / "rm" / "checkpoint")
    loaded, source = dict(reward.named_parameters()), dict(lm.named_parameters())
    assert loaded["output.weight"].shape == (1, 64)
    for name in ("tok_embeddings.weight", "layers.1.attention.wq.weight", "norm.weight"):
        assert torch.allclose(loaded[name], source[name], atol=1e-8), name  # (one step of lr 1e-10)
    if kind == "dcp":  # a reward model generates no text: generate.py, serve and lm-eval load it this way
        from titanlike.inference.engine import GenerationError
        from titanlike.inference.loading import load_for_inference

        with pytest.raises(GenerationError, match="cannot generate text: it is a reward model") as e:
            load_for_inference(str(tmp_path / "rm" / "checkpoint"))
        assert "\n" not in str(e.value)


def test_margin_column_is_read_from_every_row_or_none():
    from titanlike.data.chat_template import load_chat_template
    from titanlike.data.errors import DataError
    from titanlike.data.preferences import tokenize_pairs
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    rows = [{"prompt": "Say a colour.", "chosen": "Red.", "rejected": "Seven.", "margin": 1.5},
            {"prompt": "Say a number.", "chosen": "Two.", "rejected": "Blue.", "margin": 0.25}]

    def tokenized(rows, margins=True):
        return tokenize_pairs([(f"pairs.jsonl line {i + 1}", r) for i, r in enumerate(rows)],
                              load_chat_template("llama3", tok), tok, seq_len=128, margins=margins)

    pairs = tokenized(rows)
    samples = PreferenceSamples(pairs, seq_len=128, packing=True, pad_id=0)
    sample = samples[0]
    assert sorted(sample["margins"][sample["margins"] != 0].tolist()) == [0.25, 1.5]
    assert tokenized(rows, margins=False).margin is None  # DPO: TRL's DPOTrainer reads no margin
    with pytest.raises(DataError, match="some preference rows have a 'margin' and some do not"):
        tokenized([rows[0], {k: v for k, v in rows[1].items() if k != "margin"}])
    with pytest.raises(DataError, match="line 1: its margin 'big' is not a finite number"):
        tokenized([{**rows[0], "margin": "big"}])
