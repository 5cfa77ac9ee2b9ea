"""GRPO's rollouts: prompts from the dataset, G completions of each from the policy through the
generation engine, their rewards and group advantages, as token rows the objective trains on.

Rows of the prompt dataset (JSONL or Parquet files, or a saved datasets folder: data/conversations.py
reads them, as it reads SFT's) hold a `prompt` (TRL's column: a text, or a conversation answered
with the chat template) and the columns the reward functions read (`answer`, ...). The loader gives
the prompts as token ids with their row index (PromptSamples); the generating companion
(train/companions.py) hands each loader batch to GRPORollout.generate with the policy's whole module
(PolicyWeights), which returns a batch of B x G rows of prompt + completion tokens with named
targets: the completion tokens as labels, the engine's log-probabilities of them, each row's
advantage, reward and truncation. Right padding: a causal model's rows need no attention mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from titanlike.data.errors import DataError

if TYPE_CHECKING:
    import torch.nn as nn

    from titanlike.inference.processor import Processor
    from titanlike.objectives.grpo import GRPOOptions
    from titanlike.rl.rewards import Reward

IGNORE_INDEX = -100  # models/outputs.py's
PROMPT_COLUMN = "prompt"
SAMPLES, SAMPLE_CHARS = 4, 200  # the sample completions logged every grpo.sample_freq steps, and their length
GROUPS = "groups"  # a generated batch's (groups kept, groups of its loader batch): GRPORollout.missing


def _join(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The rows of two generated batches, the first's then the second's, right-padded to the wider."""
    width = max(first["inputs"].shape[1], second["inputs"].shape[1])
    fill = {"inputs": pad_id, "labels": IGNORE_INDEX}
    out = {}
    for name, a in first.items():
        if name == GROUPS:
            continue
        b = second[name]
        if a.ndim == 2:
            a, b = (torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill.get(name, 0)) for x in (a, b))
        out[name] = torch.cat([a, b])
    return out


@dataclass
class PromptRows:
    """The prompt dataset's rows (where each comes from, the row), each prompt's token ids, and the
    columns every row holds beside the prompt (what reward functions may read)."""

    rows: list[dict]
    ids: list[list[int]]
    columns: tuple[str, ...]

    @classmethod
    def read(cls, dataset_path: str, split, split_name: str, processor: Processor) -> PromptRows:
        """The rows of training.split's part `split_name`, their prompts encoded by the processor (a
        conversation through the chat template, with its generation prompt). DataError, one sentence,
        for a row without a prompt or a prompt that is neither a text nor a list of messages."""
        from titanlike.data.conversations import split_rows

        rows, ids = [], []
        for where, row in split_rows(dataset_path, split, split_name):
            prompt = row.get(PROMPT_COLUMN)
            if isinstance(prompt, np.ndarray):  # Parquet's lists
                prompt = list(prompt)
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                                 and all(isinstance(m, dict) for m in prompt))):
                raise DataError(f"{where} has no {PROMPT_COLUMN!r} column holding a text or a list of messages "
                                f"(its keys: {', '.join(sorted(row)) or 'none'})")
            row = dict(row, prompt=prompt)
            rows.append(row)
            ids.append(processor.encode(prompt))
        if not rows:
            raise DataError(f"{dataset_path} holds no prompt rows")
        columns = set(rows[0])
        for row in rows[1:]:
            columns &= set(row)
        return cls(rows, ids, tuple(sorted(columns - {PROMPT_COLUMN})))


class PromptSamples:
    """Map-style samples, one per prompt: its token ids padded to seq_len, its length and its row."""

    def __init__(self, prompts: PromptRows, *, seq_len: int, pad_id: int):
        self.prompts, self.seq_len, self.pad_id = prompts, seq_len, pad_id

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"prompt_ids": ((self.seq_len,), "int64"), "prompt_length": ((1,), "int64"), "row": ((1,), "int64")}

    def __len__(self) -> int:
        return len(self.prompts.ids)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        ids = self.prompts.ids[index][:self.seq_len]
        tokens = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        tokens[:len(ids)] = ids
        return {"prompt_ids": tokens, "prompt_length": np.asarray([len(ids)], dtype=np.int64),
                "row": np.asarray([index], dtype=np.int64)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} prompts of at most {self.seq_len} tokens)"


class GRPORollout:
    """One generated batch per loader batch of prompts (module docstring); a Rollout of
    objectives/companion.py. `multiple`: row lengths are rounded up to it (fewer shapes; under tensor
    parallelism a multiple of its degree, as sequence parallelism splits the sequence).

    With dynamic_sampling (DAPO) the groups whose rewards are all equal are dropped, and the generating
    companion draws more loader batches (rounds) for a batch still short of its groups, up to
    dynamic_sampling_max_rounds: `generate(..., joining=)` adds a round's kept groups to the batch so far,
    `missing` says how many it still lacks. A batch that kept no group at all trains its first round's
    groups (advantages 0: no policy-gradient term) rather than an empty microbatch."""

    def __init__(self, options: GRPOOptions, prompts: PromptRows, processor: Processor, rewards: list[Reward], *,
                 seq_len: int, multiple: int, pad_id: int, compute_dtype: torch.dtype | None = None):
        self.options, self.prompts, self.processor, self.rewards = options, prompts, processor, rewards
        # The training step's autocast dtype (one process under bf16 mixed precision): the engine generates
        # from a copy of the policy's weights in it, as the step computes (inference/engine.py).
        self.compute_dtype = compute_dtype
        self.seq_len, self.multiple, self.pad_id = seq_len, multiple, pad_id
        self.iterations, self.sample_freq = options.num_iterations, options.sample_freq
        self.ahead = options.max_offpolicy_steps
        self.rounds = options.dynamic_sampling_max_rounds if options.dynamic_sampling else 1
        self._figures: dict[str, list[float]] = {}
        self._latest: list[tuple[str, str, dict[str, float]]] = []
        self._engine = None  # kept from call to call: a compiled decode step and its static cache are built once

    def _engine_for(self, policy: nn.Module):
        """The generation engine of this policy module (a new one when the module changed)."""
        from titanlike.inference.engine import Engine

        if self._engine is None or self._engine.source is not policy:
            self._engine = Engine(policy, context_len=self.seq_len, compile=self.options.compile_generation,
                                  dtype=self.compute_dtype)
        policy.eval()  # the caller puts the module back in training mode after each call
        return self._engine

    def _note(self, **values: float) -> None:
        for name, value in values.items():
            self._figures.setdefault(name, []).append(value)

    @staticmethod
    def missing(batch: dict[str, torch.Tensor]) -> int:
        """The groups a generated batch lacks of its loader batch's prompts (dynamic sampling dropped them)."""
        kept, wanted = batch[GROUPS].tolist()
        return wanted - kept

    @torch.no_grad()
    def generate(self, prompts: dict[str, torch.Tensor], policy: nn.Module, *, seed: int,
                 joining: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        from titanlike.inference.sampling import SamplingParams
        from titanlike.rl.advantages import group_advantages, kept_groups, overlong_penalty
        from titanlike.rl.rewards import compute_rewards

        o, g = self.options, self.options.num_generations
        lengths = prompts["prompt_length"][:, 0].tolist()
        rows = [r for r in prompts["row"][:, 0].tolist() for _ in range(g)]
        ids = [prompts["prompt_ids"][i, :n].tolist() for i, n in enumerate(lengths) for _ in range(g)]
        texts = [self.prompts.rows[r][PROMPT_COLUMN] for r in rows]
        chat = [not isinstance(t, str) for t in texts]
        stop = frozenset().union(*(self.processor.stop_ids(chat=c) for c in set(chat)))
        params = SamplingParams(max_new_tokens=o.max_completion_length, temperature=o.temperature, top_k=o.top_k,
                                top_p=o.top_p, stop_token_ids=stop, seed=seed, logprobs=True)
        completions, stats = self._engine_for(policy).generate(ids, params)
        # The text the rewards have always scored, special tokens included (TRL's GRPO skips them:
        # a change of the objective's results, for its own issue).
        answers = [self.processor.decode(c.tokens, stop_ids=stop, skip_special_tokens=False) for c in completions]
        # TRL's forms: a text completes a text prompt, an assistant message a conversation.
        given = [[{"role": "assistant", "content": a}] if c else a for a, c in zip(answers, chat)]
        columns = {k: [self.prompts.rows[r][k] for r in rows] for k in self.prompts.columns}
        total, per_function, _ = compute_rewards(self.rewards, o.reward_weights or None, texts, given, columns,
                                                 timeout=o.reward_timeout, slow=o.reward_slow_warning)
        new = torch.tensor([len(c.tokens) for c in completions])
        if o.overlong_buffer_length:
            total = total + overlong_penalty(new, o.max_completion_length, o.overlong_buffer_length,
                                             o.overlong_penalty_factor)
        # Scaled by the batch's std, the whole generation's (every microbatch, every rank, as TRL's global
        # batch): that std is known once all of it is made (complete()).
        advantages = group_advantages(total, g, "none" if o.scale_rewards == "batch" else o.scale_rewards)
        truncated = torch.tensor([c.finish_reason != "stop" for c in completions])
        groups = kept_groups(total, g) if o.dynamic_sampling else torch.ones(len(lengths), dtype=torch.bool)
        # Over every completion generated, before dynamic sampling drops groups (metrics()).
        self._note(**{"reward/mean": _nan_mean(total), "reward/std": _nan_std(total),
                      "completion_length/mean": new.float().mean().item(), "completion_length/max": float(new.max()),
                      "completion_length/clipped_fraction": truncated.float().mean().item(),
                      "kept_fraction": groups.float().mean().item(),
                      "rollout_tokens_per_second": stats.tokens_per_second})
        for reward, values in zip(self.rewards, per_function):
            self._note(**{f"reward/{reward.name}/mean": _nan_mean(values),
                          f"reward/{reward.name}/std": _nan_std(values)})
        self._latest = [(_shown(texts[i]), _shown(answers[i]),
                         {"reward": total[i].item(), **{f"reward/{r.name}": v[i].item()
                                                        for r, v in zip(self.rewards, per_function)}})
                        for i in range(0, min(len(rows), SAMPLES * g), g)]
        have = 0 if joining is None else joining[GROUPS][0].item()
        kept = groups.nonzero()[:, 0][:len(lengths) - have]  # the first groups kept, up to the batch's size
        if len(kept) == 0:  # nothing new: the batch so far, or a first round's groups as they are
            if joining is not None:
                return joining
            kept, count = torch.arange(len(lengths)), 0
        else:
            count = have + len(kept)
        index = (kept[:, None] * g + torch.arange(g)).flatten().tolist()
        batch = self._rows(ids, completions, index)
        batch.update(advantages=advantages[index], rewards=total[index], truncated=truncated[index])
        if have:  # after the groups kept by earlier rounds (a batch that kept none is replaced)
            batch = _join(joining, batch, self.pad_id)
        batch[GROUPS] = torch.tensor([count, len(lengths)])
        return batch

    def complete(self, batches: list[dict[str, torch.Tensor]], total) -> None:
        """scale_rewards batch: every row's advantage divided by the std (Bessel-corrected, NaN rewards
        left out) of the rewards of every row that trains in this generation, on every data-parallel rank,
        + 1e-4: TRL's std over the global batch (the same rows when no group is dropped). The sums are
        float64, one all-reduce."""
        if self.options.scale_rewards != "batch":
            return
        rewards = torch.cat([b["rewards"] for b in batches]).double()
        known = rewards[~rewards.isnan()]
        sums = total(torch.stack([torch.tensor(float(len(known)), dtype=torch.float64), known.sum(),
                                  (known ** 2).sum()]))
        count, first, second = sums.tolist()
        variance = (second - first * first / count) / (count - 1) if count > 1 else math.nan
        std = math.sqrt(max(variance, 0.0))
        for b in batches:
            b["advantages"] = torch.nan_to_num(b["advantages"] / (std + 1e-4), nan=0.0)

    def _rows(self, ids: list[list[int]], completions, index: list[int]) -> dict[str, torch.Tensor]:
        """Rows of prompt + completion tokens (inputs), the completion as labels and the engine's
        log-probabilities of it, for the completions `index`, right-padded to a common width."""
        longest = max(len(ids[i]) + len(completions[i].tokens) - 1 for i in index)
        width = min(self.seq_len, -(-longest // self.multiple) * self.multiple)
        inputs = torch.full((len(index), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(index), width), IGNORE_INDEX, dtype=torch.long)
        engine = torch.zeros(len(index), width)
        for out, i in enumerate(index):
            prompt, c = ids[i], completions[i]
            sequence = (prompt + c.tokens)[:width + 1]
            inputs[out, :len(sequence) - 1] = torch.tensor(sequence[:-1])
            start, n = len(prompt) - 1, len(sequence) - len(prompt)
            labels[out, start:start + n] = torch.tensor(c.tokens[:n])
            engine[out, start:start + n] = torch.tensor(c.logprobs[:n])
        return {"inputs": inputs, "labels": labels, "engine_logps": engine}

    def metrics(self) -> dict[str, float]:
        """The figures of the completions generated since the last call, before dynamic sampling drops
        groups, averaged over the batches (a */max figure: its maximum); empty when none was."""
        figures, self._figures = self._figures, {}
        return {name: max(values) if name.endswith("/max") else sum(values) / len(values)
                for name, values in figures.items()}

    def samples(self) -> list[tuple[str, str, dict[str, float]]]:
        """(prompt, completion, rewards) of the first completion of each of the latest generated batch's
        first SAMPLES prompts, texts cut to SAMPLE_CHARS characters: what the log shows every
        grpo.sample_freq steps."""
        return list(self._latest)


def _shown(text) -> str:
    """A prompt or completion as a sample shows it: a conversation's last message, cut to SAMPLE_CHARS."""
    if isinstance(text, list):
        text = text[-1].get("content", "") if text else ""
    text = str(text)
    return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + "..."


def _nan_mean(values: torch.Tensor) -> float:
    finite = values[~values.isnan()]
    return finite.mean().item() if len(finite) else math.nan


def _nan_std(values: torch.Tensor) -> float:
    finite = values[~values.isnan()]
    return finite.std(correction=0).item() if len(finite) > 1 else 0.0


__all__ = ["GROUPS", "GRPORollout", "PROMPT_COLUMN", "PromptRows", "PromptSamples"]
