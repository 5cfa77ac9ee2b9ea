"""Choosing the next token from logits: greedy, or sampled after repetition penalty, temperature,
top-k and top-p, in that order (the order of transformers' logits processors and warpers, so the
same settings mean the same distribution). Batched: one row per sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 1e-4
MIN_PENALTY, MAX_PENALTY = 1e-2, 1e2
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to continue a prompt. temperature 0 is greedy (argmax after the repetition penalty);
    top_k 0 and top_p 1 filter nothing; repetition_penalty 1 changes nothing (> 1 discourages tokens
    the sequence already holds, prompt included, as CTRL and transformers apply it; for an encoder-
    decoder the encoder's prompt counts too, where transformers counts the decoder's tokens only).
    Generation of a row ends at a stop token (kept as the last token), at a stop string (cut from
    the text), after max_new_tokens, or at the model's context (prompt and new tokens together).
    seed: the same seed gives the same samples; None draws from torch's global generator.
    logprobs: each completion also gets the log-probability of every token it drew (sampled_logprobs).

    The ranges are those the step can compute: logits divided by a temperature below
    MIN_TEMPERATURE, or by a repetition penalty outside [MIN_PENALTY, MAX_PENALTY], overflow
    float32 to infinities whose softmax is NaN, and torch.Generator takes seeds below 2**64 (the
    server's n choices use seed + j, so a seed stays below 2**63)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        self.validate()

    def validate(self) -> None:
        """ValueError, one sentence naming the setting, for a value out of range."""
        def bad(name: str, value, want: str) -> ValueError:
            return ValueError(f"{name} must be {want}, got {value!r}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise bad("max_new_tokens", self.max_new_tokens, "an integer of at least 1")
        if not _finite(self.temperature) or self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise bad("temperature", self.temperature, f"a finite number >= 0 (0: greedy, else at least "
                      f"{MIN_TEMPERATURE:g})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0: no top-k filtering)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "a number in (0, 1] (1: no nucleus filtering)")
        if not _finite(self.repetition_penalty) or not MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY:
            raise bad("repetition_penalty", self.repetition_penalty, f"a finite number > 0, from {MIN_PENALTY:g} to "
                      f"{MAX_PENALTY:g} (1: no penalty)")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", sorted(self.stop_token_ids, key=str), "token ids (integers >= 0)")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop_strings", list(self.stop_strings), "non-empty strings")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", self.seed, f"an integer from 0 to {MAX_SEED} (2**63 - 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Divide the positive logits of tokens already seen (seen: (batch, vocab) bool) by penalty and
    multiply the negative ones by it (transformers' RepetitionPenaltyLogitsProcessor)."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    # A token is dropped when the tokens before it already reach p.
    drop = (probs.cumsum(-1) - probs) >= p
    drop[:, 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def next_tokens(logits: torch.Tensor, params: SamplingParams, *, seen: torch.Tensor | None,
                generator: torch.Generator | None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, vocab) logits -> (batch,) token ids. uniforms: the rows' random numbers, when the caller
    drew them (see draw)."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(-1)
    logits = filter_top_p(filter_top_k(logits / params.temperature, params.top_k), params.top_p)
    return draw(logits.softmax(-1), generator, uniforms=uniforms)


def draw_uniforms(rows: int, generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """(rows, 1) float64 numbers in [0, 1): the random numbers draw takes, one per row."""
    return torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=device)


def draw(probs: torch.Tensor, generator: torch.Generator | None, *,
         uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of probs (batch, vocab), drawn by inverting each row's cumulative distribution
    at one uniform number: the distribution torch.multinomial draws from, at one random number per row
    where multinomial takes one per vocabulary entry (those draws were 7-11% of a GRPO rollout's CPU
    time: docs/performance.md). The sums are in float64, and the number stays below the row's total, so
    a token of probability 0 (filtered by top-k or top-p) is never drawn. Checking the rows costs one host sync.
    uniforms: (batch, 1) numbers drawn by the caller (draw_uniforms) instead of from generator:
    a generate call whose batch shrinks as rows end draws them for all its rows and passes the live ones
    (engine.py), so each row's samples do not depend on which other rows are still running."""
    cumulative = probs.cumsum(-1, dtype=torch.float64)
    total = cumulative[:, -1:]
    # As multinomial does: a row whose settings broke its probabilities (NaN or inf logits) raises, which
    # the continuous batch turns into that sequence's "error" end (continuous.py _sample).
    if not bool(((total > 0) & total.isfinite()).all()):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")
    if uniforms is None:
        uniforms = draw_uniforms(total.shape[0], generator, probs.device)
    u = uniforms * total
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cumulative, u, right=True)[:, 0]


def sampled_logprobs(logits: torch.Tensor, chosen: torch.Tensor, params: SamplingParams, *,
                     seen: torch.Tensor | None) -> torch.Tensor:
    """(batch,) fp32 log-probabilities of the chosen tokens under the distribution they were drawn from
    after the repetition penalty and the temperature, before top-k and top-p: log_softmax(logits / T),
    what a trainer recomputes from its own logits (TRL's GRPOTrainer divides its logits by the
    temperature and nothing else), so that their difference measures numerics only. vLLM's
    processed_logprobs, which TRL asks of vLLM, are taken after top-k / top-p as well; the two agree
    when neither filters (top_k 0, top_p 1, GRPO's defaults). Greedy: temperature 1."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if not params.greedy:
        logits = logits / params.temperature
    return torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0]


__all__ = ["MAX_SEED", "SamplingParams", "apply_repetition_penalty", "draw", "draw_uniforms", "filter_top_k",
           "filter_top_p", "next_tokens", "sampled_logprobs"]
