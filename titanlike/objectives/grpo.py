"""GRPO and its variants (Dr. GRPO, BNPO, DAPO, GSPO): the options, the group advantages, the loss, and
the objective `training.objective grpo` that trains with them.

On-policy RL samples G completions of each prompt (a group), scores each with the reward functions
(titanlike/rl/rewards.py), turns the rewards into advantages relative to the group, and trains the
policy on the completion tokens with a clipped importance ratio (PPO's surrogate). The formulas are
TRL's GRPOTrainer (trl 1.16: `_generate_and_score_completions` for the advantages and the engine's
importance-sampling ratio, `_compute_loss` for the loss); tests/unit/test_grpo_loss.py runs TRL's own
methods on the same batch and compares the loss, its gradient and the logged terms.

The objective's samples are prompts; its generating companion (objectives/companion.py, run by
train/companions.py) samples the completions through the generation engine on the policy's current
weights and scores them (titanlike/rl/rollout.py), so that `prepare` and `loss` see rows of prompt +
completion tokens with their advantages, the engine's log-probabilities, and, from other companions,
the old policy's (num_iterations > 1) and the reference's (beta > 0; the policy with its LoRA adapters
off for a LoRA job) log-probabilities.

The loss is a sum over its units, like every objective's here (the training step divides once by
their global count), so that sum / units is TRL's loss:
  grpo     each completion's mean token loss, summed over completions      units: completions
  bnpo     the token losses summed                                        units: completion tokens
  dapo     the same sum (TRL divides by the generation batch's tokens)    units: completion tokens
  dr_grpo  the token losses summed, / max_completion_length               units: completions
Per token, with r = pi / pi_old (per token, or GSPO's exp of the completion's mean log-ratio for
importance_sampling_level sequence), A the completion's advantage:
  -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) * w  +  beta * kl * (r if kl_bias_correction)
where kl = exp(ref - logp) - (ref - logp) - 1 (the k3 estimator) and w the generation engine's
truncated importance weight (pi_old / pi_engine, clipped or masked; 1 when the correction is off).
Without old log-probabilities (one optimisation step per generation) pi_old is pi detached: r = 1
with the gradient of log pi. With old_logprobs engine, pi_old is the engine's log-probabilities (no
forward of the old policy): r = pi / pi_engine, whose clip truncates the correction of the engine's
sampling, and w is 1 (pi_old is pi_engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import torch

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.outputs import IGNORE_INDEX, logits_of
from titanlike.objectives.base import (BatchContext, FieldShapes, LossTerms, Microbatch, Objective, compile_options,
                                       refuse_pretraining_options)
from titanlike.objectives.companion import Companion, Source, Targets
from titanlike.objectives.registry import register_objective
from titanlike.rl.advantages import SCALE_REWARDS, group_advantages, kept_groups, overlong_penalty

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees
    from titanlike.train.plan import JobPlan

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ENGINE_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OLD_LOGPROBS = ("trainer", "engine")


@dataclass
class GRPOOptions:
    num_generations: int = opt(8, "completions sampled per prompt (G, one group); at least 2")
    beta: float = opt(0.0, "the weight of the KL penalty toward the reference model (0: no reference is built)")
    epsilon: float = opt(0.2, "the ratio's lower clipping bound is 1 - epsilon")
    epsilon_high: float | None = opt(None, "the ratio's upper clipping bound is 1 + epsilon_high (DAPO's clip-higher: "
                                     "0.28); empty: epsilon")
    loss_type: str = opt("dapo", "how token losses are summed: grpo (per completion, a mean over its tokens), bnpo "
                         "and dapo (over tokens), dr_grpo (over tokens / max_completion_length); TRL's meanings",
                         choices=LOSS_TYPES)
    importance_sampling_level: str = opt("token", "the policy ratio per token, or per completion (sequence: GSPO, the "
                                         "exp of the mean token log-ratio)", choices=("token", "sequence"))
    scale_rewards: str = opt("group", "advantages divided by the group's reward std (group), the std of "
                             "the rewards of every completion the generation trains on, over all microbatches and "
                             "data-parallel ranks (batch: TRL's global batch), or not at all (none: Dr. GRPO)", choices=SCALE_REWARDS)
    mask_truncated_completions: bool = opt(False, "completions cut at max_completion_length (no end-of-text) add no "
                                           "loss (DAPO)")
    kl_bias_correction: bool = opt(True, "multiply the KL term by the policy ratio, the unbiased reverse-KL gradient "
                                   "(TRL's use_bias_correction_kl)")
    num_iterations: int = opt(1, "optimisation steps on each generated batch (mu); above 1 the old policy's "
                              "log-probabilities are kept")
    old_logprobs: str = opt("trainer", "the old policy's log-probabilities (pi_old) where the policy ratio needs them: "
                            "the trainer's forward with the weights that generated (trainer), or the generation "
                            "engine's, with no forward (engine: the ratio is then pi / pi_engine, whose clip is the "
                            "truncated importance-sampling correction; mismatch then compares the engine with the "
                            "policy being trained)", choices=OLD_LOGPROBS)
    max_completion_length: int = opt(512, "the most tokens generated per completion")
    temperature: float = opt(1.0, "sampling temperature of the generation")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1: all")
    top_k: int = opt(0, "sample among the top_k most likely tokens; 0: all")
    engine_importance_sampling_correction: bool = opt(
        True, "weight each token by pi_old / pi_engine, the generation engine's log-probabilities against the "
        "trainer's, truncated or masked by the mode (TRL's vllm_importance_sampling_correction)")
    engine_importance_sampling_mode: str = opt(
        "sequence_mask", "token_* weights each token, sequence_* each completion (the product of its tokens'); "
        "*_truncate clips the weight into [clip_min, clip_max], *_mask zeroes it outside", choices=ENGINE_IS_MODES)
    engine_importance_sampling_clip_max: float | None = opt(3.0, "the engine weight's upper bound (TRL's "
                                                            "vllm_importance_sampling_cap); empty: none")
    engine_importance_sampling_clip_min: float | None = opt(None, "the engine weight's lower bound; empty: none")
    dynamic_sampling: bool = opt(False, "drop the groups whose rewards are all equal (no advantage to learn from) and "
                                 "generate more prompts of the data until each batch is full again (DAPO)")
    dynamic_sampling_max_rounds: int = opt(10, "the most rounds of generation one batch may take with "
                                           "dynamic_sampling, the first included (verl's max_num_gen_batches); a "
                                           "batch still short then trains on the groups it has (logged)")
    max_offpolicy_steps: int = opt(0, "generation may run ahead of training by this many optimizer steps: the "
                                   "rollouts of step s + k come from the weights of step s, k <= this (0: "
                                   "synchronous); the old log-probabilities are then the generating policy's")
    overlong_buffer_length: int = opt(0, "DAPO's soft overlong punishment: a completion longer than "
                                      "max_completion_length - this many tokens loses up to overlong_penalty_factor "
                                      "reward, linearly (TRL's soft_punish_cache); 0: off")
    overlong_penalty_factor: float = opt(1.0, "the reward a completion of max_completion_length tokens loses")
    reward_funcs: list[str] = opt([], "reward functions, each a built-in name (exact_answer, format, reward_model) or "
                                  "module:function (titanlike/rl/rewards.py)")
    reward_weights: list[float] = opt([], "one weight per reward function; empty: all 1")
    format_pattern: str = opt("", "the regular expression a whole completion must match for the format reward")
    reward_model_path: str | None = opt(None, "the reward model of the reward_model reward: a titanlike checkpoint "
                                        "or a Hugging Face ...ForSequenceClassification folder")
    reward_timeout: float = opt(300.0, "seconds a reward function may take on one batch before the job stops")
    reward_slow_warning: float = opt(10.0, "a reward function's call longer than this many seconds is logged")
    sample_freq: int = opt(10, "steps between logs of a few sample completions with their rewards (console, "
                           "TensorBoard text, metrics.jsonl); 0: none")
    compile_generation: bool = opt(False, "generate with a torch.compile'd decode step on static caches of "
                                   "training.seq_len slots (inference/engine.py Engine(compile=True): a CUDA graph on "
                                   "one GPU); the first generation pays the compile")
    chat_template: str = opt("auto", "the template conversation prompts are rendered with, as sft.chat_template: "
                             "auto, tokenizer, llama3, chatml, a published template's name (gemma3, ...), or a "
                             "Jinja file")


def check_options(o: GRPOOptions) -> None:
    """ValueError (one sentence naming the option) for values GRPO cannot train with."""
    if o.num_generations < 2:
        raise ValueError(f"grpo.num_generations must be at least 2 (a group's advantages compare its completions), "
                         f"got {o.num_generations}")
    if o.beta < 0:
        raise ValueError(f"grpo.beta must not be negative, got {o.beta}")
    if not 0 <= o.epsilon < 1:
        raise ValueError(f"grpo.epsilon must lie in [0, 1), got {o.epsilon}")
    if o.epsilon_high is not None and o.epsilon_high < 0:
        raise ValueError(f"grpo.epsilon_high must not be negative, got {o.epsilon_high}")
    if o.sample_freq < 0:
        raise ValueError(f"grpo.sample_freq must not be negative (0: no samples), got {o.sample_freq}")
    for name in ("num_iterations", "max_completion_length", "dynamic_sampling_max_rounds"):
        if getattr(o, name) < 1:
            raise ValueError(f"grpo.{name} must be at least 1, got {getattr(o, name)}")
    if o.max_offpolicy_steps < 0:
        raise ValueError(f"grpo.max_offpolicy_steps must not be negative, got {o.max_offpolicy_steps}")
    if o.temperature <= 0 or not 0 < o.top_p <= 1 or o.top_k < 0:
        raise ValueError(f"grpo.temperature must be positive, top_p in (0, 1] and top_k not negative, got "
                         f"{o.temperature}, {o.top_p} and {o.top_k}")
    lo, hi = o.engine_importance_sampling_clip_min, o.engine_importance_sampling_clip_max
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"grpo.engine_importance_sampling_clip_min ({lo}) must not exceed clip_max ({hi})")
    if o.engine_importance_sampling_mode.endswith("truncate") and hi is None and lo is None:
        raise ValueError("grpo.engine_importance_sampling_mode truncate needs clip_max or clip_min")
    if not 0 <= o.overlong_buffer_length <= o.max_completion_length:
        raise ValueError(f"grpo.overlong_buffer_length must lie in [0, max_completion_length "
                         f"{o.max_completion_length}], got {o.overlong_buffer_length}")
    if o.reward_timeout <= 0 or o.reward_slow_warning <= 0:
        raise ValueError(f"grpo.reward_timeout and grpo.reward_slow_warning must be positive, got {o.reward_timeout} "
                         f"and {o.reward_slow_warning}")
    if o.reward_weights and len(o.reward_weights) != len(o.reward_funcs):
        raise ValueError(f"grpo.reward_weights has {len(o.reward_weights)} weights for {len(o.reward_funcs)} "
                         "reward functions; give one per function, or none")


# Advantages ------------------------------------------------------------------------------------


# Loss ------------------------------------------------------------------------------------------


class GRPOTerms(NamedTuple):
    """value: the loss summed over its units (module docstring); units: their count, 0-d; reported:
    the logged terms, name -> a (2,) [sum, count] whose global value is the sum of the sums over the sum
    of the counts, or, for names ending in _min / _max / /min / /max, a 0-d value reduced by min or max
    (NaN: none on this rank). All detached."""

    value: torch.Tensor
    units: torch.Tensor
    reported: dict[str, torch.Tensor]


def engine_weights(options: GRPOOptions, old_logps: torch.Tensor, engine_logps: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """The truncated importance weights pi_old / pi_engine, (B, T) per token or (B, 1) per completion;
    a token the engine could not score (NaN) counts as a ratio of 1."""
    o = options
    diff = torch.nan_to_num((old_logps - engine_logps) * mask, nan=0.0)
    if o.engine_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weights = diff.exp()
    lo, hi = o.engine_importance_sampling_clip_min, o.engine_importance_sampling_clip_max
    if o.engine_importance_sampling_mode.endswith("truncate"):
        return weights.clamp(min=lo, max=hi)
    outside = (weights < (-math.inf if lo is None else lo)) | (weights > (math.inf if hi is None else hi))
    return weights.masked_fill(outside, 0.0)


def _mean_of(values: torch.Tensor, mask: torch.Tensor, *, per_completion: bool = False) -> torch.Tensor:
    """[sum, count] of per-token values (B, T) over the mask, or of per-completion values (B, 1) over
    every completion (said explicitly: TRL tells them apart by shape, which a one-token batch confuses)."""
    if per_completion:
        return torch.stack([values.sum(), torch.full((), float(values.shape[0]), device=values.device)])
    return torch.stack([(values * mask).sum(), mask.sum()])


def _extreme(values: torch.Tensor, valid: torch.Tensor, *, largest: bool, empty: float) -> torch.Tensor:
    """The largest (smallest) of the valid values, `empty` when none is; no host sync."""
    fill = -math.inf if largest else math.inf
    masked = torch.where(valid, values, torch.full_like(values, fill))
    extreme = masked.amax() if largest else masked.amin()
    return torch.where(valid.any(), extreme, torch.full_like(extreme, empty))


def _clip_reports(ratio, advantages, m, *, low: float, high: float, per_completion: bool) -> dict[str, torch.Tensor]:
    """TRL's clip_ratio terms: the share of tokens (completions, for a sequence-level ratio) whose ratio
    is clipped below with a negative advantage, above with a positive one, either; and the smallest
    (largest) per-completion share."""
    low_clipped = ((ratio < 1 - low) & (advantages < 0)).to(m.dtype)
    high_clipped = ((ratio > 1 + high) & (advantages > 0)).to(m.dtype)
    either = torch.maximum(low_clipped, high_clipped)

    def per_seq(x):  # NaN for a completion without tokens, as TRL's
        return x.squeeze(1) if per_completion else (x * m).sum(-1) / m.sum(-1)

    low_seq, high_seq = per_seq(low_clipped), per_seq(high_clipped)
    return {"clip_ratio/low_mean": _mean_of(low_clipped, m, per_completion=per_completion),
            "clip_ratio/high_mean": _mean_of(high_clipped, m, per_completion=per_completion),
            "clip_ratio/region_mean": _mean_of(either, m, per_completion=per_completion),
            "clip_ratio/low_min": _extreme(low_seq, ~low_seq.isnan(), largest=False, empty=math.nan),
            "clip_ratio/high_max": _extreme(high_seq, ~high_seq.isnan(), largest=True, empty=math.nan)}


def _engine_reports(old, engine, weights, mask, *, per_completion: bool) -> dict[str, torch.Tensor]:
    """TRL's sampling terms: |log pi_old - log pi_engine| over the scored completion tokens (mean, max),
    and the engine weights over the completion tokens, or the completions (min, mean, max)."""
    delta = (old - engine).abs()
    scored = mask & ~delta.isnan()
    delta = torch.where(scored, delta, torch.zeros_like(delta))
    kept = torch.ones_like(weights, dtype=torch.bool) if per_completion else mask
    return {"sampling/sampling_logp_difference/mean": torch.stack([delta.sum(), scored.sum().to(delta.dtype)]),
            "sampling/sampling_logp_difference/max": _extreme(delta, scored, largest=True, empty=0.0),
            "sampling/importance_sampling_ratio/min": _extreme(weights, kept, largest=False, empty=0.0),
            "sampling/importance_sampling_ratio/mean": torch.stack(
                [(weights * kept).sum(), kept.sum().to(weights.dtype)]),
            "sampling/importance_sampling_ratio/max": _extreme(weights, kept, largest=True, empty=0.0)}


def old_logps(options: GRPOOptions, logps: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """pi_old of the policy ratio: the engine's log-probabilities (old_logprobs engine; a token it could not
    score, NaN, takes the policy's own, a ratio of 1), else the old policy's when kept (num_iterations > 1,
    max_offpolicy_steps > 0), else the policy's own detached (one step on rollouts of the weights now)."""
    if options.old_logprobs == "engine":
        engine = targets["engine_logps"]
        return torch.where(engine.isnan(), logps.detach(), engine)
    old = targets.get("old_logps")
    return logps.detach() if old is None else old


def grpo_token_loss(options: GRPOOptions, logps: torch.Tensor, targets: dict[str, torch.Tensor], *,
                    entropies: torch.Tensor | None = None) -> GRPOTerms:
    """The GRPO loss of one microbatch (module docstring) from the policy's (B, T) log-probabilities of
    the completion tokens (objectives/preference.py token_logps). targets: completion_mask (bool, B x T),
    advantages (float32, B), truncated (bool, B; read with mask_truncated_completions), old_logps (B x T;
    absent: pi_old is pi detached), ref_logps (B x T, with beta > 0), engine_logps (B x T, with the engine
    correction). entropies: (B, T) per-token entropies of the policy, reported when given. The reported
    terms need no host sync."""
    o = options
    engine_old = o.old_logprobs == "engine"
    for name, needed in (("engine_logps", o.engine_importance_sampling_correction or engine_old),
                         ("ref_logps", o.beta != 0.0)):
        if needed and name not in targets:
            raise ValueError(f"the GRPO loss needs the target {name} with these grpo options (engine correction on, "
                             "old_logprobs engine, or beta > 0)")
    mask = targets["completion_mask"].bool()
    if o.mask_truncated_completions:
        mask = mask & ~targets["truncated"].bool().unsqueeze(1)
    m = mask.to(logps.dtype)
    tokens = m.sum(-1)
    advantages = targets["advantages"].to(logps.dtype).unsqueeze(1)
    old = old_logps(o, logps, targets)
    log_ratio = logps - old
    sequence_ratio = o.importance_sampling_level == "sequence"
    if sequence_ratio:
        log_ratio = ((log_ratio * m).sum(-1) / tokens.clamp(min=1.0)).unsqueeze(-1)
    ratio = log_ratio.exp()
    low, high = o.epsilon, o.epsilon if o.epsilon_high is None else o.epsilon_high
    per_token = -torch.min(ratio * advantages, ratio.clamp(1 - low, 1 + high) * advantages)
    reported = {}
    if o.engine_importance_sampling_correction and not engine_old:  # engine_old: pi_old / pi_engine is 1
        weights = engine_weights(o, old, targets["engine_logps"], m)
        per_token = per_token * weights
        reported.update(_engine_reports(old, targets["engine_logps"], weights, mask,
                                        per_completion=o.engine_importance_sampling_mode.startswith("sequence")))
    if o.beta != 0.0:
        d = targets["ref_logps"] - logps
        kl = d.exp() - d - 1
        if o.kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + o.beta * kl
        reported["kl"] = _mean_of(kl.detach(), m)
    per_completion = (per_token * m).sum(-1)
    completions = torch.full((), float(logps.shape[0]), device=logps.device)
    if o.loss_type == "grpo":
        value, units = (per_completion / tokens.clamp(min=1.0)).sum(), completions
    elif o.loss_type == "dr_grpo":
        value, units = per_completion.sum() / o.max_completion_length, completions
    else:  # bnpo, dapo
        value, units = per_completion.sum(), m.sum()
    if entropies is not None:
        reported["entropy"] = _mean_of(entropies.detach(), m)
    reported.update(_clip_reports(ratio.detach(), advantages, m, low=low, high=high, per_completion=sequence_ratio))
    return GRPOTerms(value, units, reported)


def reported_values(reported: dict[str, torch.Tensor]) -> dict[str, float]:
    """One process's logged values of GRPOTerms.reported: sum / count, or the extreme itself."""
    return {name: (v[0] / v[1].clamp(min=1.0)).item() if v.ndim else v.item() for name, v in reported.items()}


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T) entropies of the (B, T, vocab) logits' distributions, without gradient: what
    grpo_token_loss reports as entropy (whole logits; one extra pass over the vocabulary)."""
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)


# The objective ----------------------------------------------------------------------------------


register_section("grpo", GRPOOptions)


def at_positions(values: torch.Tensor, logits_at: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """(N,) values at the flattened positions logits_at -> (batch, seq), 0 elsewhere; values itself when
    logits_at is None (they are (batch, seq) already)."""
    if logits_at is None:
        return values
    return values.new_zeros(shape.numel()).index_copy(0, logits_at, values).view(shape)


def completion_logps(logits: torch.Tensor, targets: Targets) -> torch.Tensor:
    """(batch, seq) log-probabilities of the labels, 0 where there is none, from (batch, seq, vocab)
    logits or from (N, vocab) logits of the positions targets["logits_at"] names."""
    from titanlike.objectives.preference import token_logps

    labels, at = targets["labels"], targets.get("logits_at")
    if at is None:
        return token_logps(logits, labels)
    return at_positions(token_logps(logits[None], labels.flatten().index_select(0, at)[None])[0], at, labels.shape)


def policy_logps(name: str, temperature: float, output, targets: Targets) -> Targets:
    """What a companion adds: the log-probabilities of the labels under logits / temperature, as `name`
    (the old policy's, the reference's)."""
    return {name: completion_logps(logits_of(output) / temperature, targets)}


class GRPO(Objective):
    """training.objective grpo: on-policy RL from rewards (module docstring). Its samples are prompts;
    its generating companion (titanlike/rl/rollout.py, run by train/companions.py) turns each batch of
    them into rows of prompt + completion with their advantages, which `prepare` and `loss` take."""

    name = "grpo"
    generation = "chat"

    def __init__(self, options: GRPOOptions | None = None, *, lora: bool = False, **loss_options):
        super().__init__(**loss_options)
        self.options = options or GRPOOptions()
        self.lora = lora  # the reference is then the policy with its adapters off
        # reward/trained_mean and completion_length/trained_mean: the rows trained (after dynamic sampling's
        # drops), every step; the rollout's own figures over all its completions are the companion's
        # (titanlike/rl/rollout.py GRPORollout.metrics: reward/mean, completion_length/mean, ...).
        self.reported_terms = ("reward/trained_mean", *(("kl",) if self.options.beta else ()), "clip_ratio", "entropy",
                               "mismatch", "completion_length/trained_mean")

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> GRPO:
        if family_objective is not None and family_objective.generation is None:
            raise ValueError(f"training.objective grpo trains models that generate text; {model} trains with "
                             f"{family_objective.name}")
        return cls(cfg.grpo, lora="lora" in cfg.model.converters, **compile_options(cfg))

    @property
    def companions(self) -> tuple[Companion, ...]:
        o = self.options
        # The old policy's forward, right after each generation with the weights that generated: needed when a
        # batch trains after an update (several iterations, or generated ahead), unless the engine's stand in.
        stale = o.num_iterations > 1 or o.max_offpolicy_steps > 0
        old = partial(policy_logps, "old_logps", o.temperature) if stale and o.old_logprobs == "trainer" else None
        out = [Companion("generator", "training.objective grpo", Source.POLICY, old, rollout=self.rollout,
                         completions=o.num_generations, max_new_tokens=o.max_completion_length)]
        if o.beta:
            out.append(Companion("reference", "grpo.beta", Source.POLICY if self.lora else Source.FROZEN_COPY,
                                 partial(policy_logps, "ref_logps", o.temperature), converters_off=self.lora))
        return tuple(out)

    # Rules ------------------------------------------------------------------------------------

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str, data: bool = True, tokenizer=None) -> None:
        super().validate(cfg, dims, model=model, data=data, tokenizer=tokenizer)
        if data:
            self._check_prompts(cfg)

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        o = self.options
        check_options(o)
        refuse_pretraining_options(cfg, "grpo")
        if dims.pp > 1:
            raise ValueError("training.objective grpo generates with the policy's whole module on every rank "
                             "(train/companions.py PolicyWeights), which pipeline parallelism splits over stages: set "
                             "parallelism.pipeline_parallel_degree 1")
        if dims.cp > 1:
            raise ValueError("training.objective grpo does not take context parallelism yet (its rows are cut to "
                             "their longest): set parallelism.context_parallel_degree 1")
        if cfg.validation.enable:
            raise ValueError("training.objective grpo has no validation loss (its samples are prompts): remove "
                             "validation.enable and measure a checkpoint's answers instead")
        if not o.reward_funcs:
            raise ValueError("grpo.reward_funcs names no reward function: give at least one (exact_answer, format, "
                             "reward_model, or module:function)")
        if o.max_completion_length >= cfg.training.seq_len:
            raise ValueError(f"grpo.max_completion_length {o.max_completion_length} leaves no room for a prompt in "
                             f"training.seq_len {cfg.training.seq_len}")

    def _check_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        from titanlike.data.conversations import check_row_dataset

        check_row_dataset(dataset, dataset_path, option=option, objective="grpo", files="prompt files",
                          contents="the prompts")

    def _check_prompts(self, cfg: JobConfig) -> None:
        """ValueError (one sentence) for a prompt dataset without a column a reward reads, or a prompt
        longer than training.seq_len less grpo.max_completion_length (no room left to answer)."""
        from titanlike.data import DEFAULT_TOKENIZER_PATH
        from titanlike.data.tokenizer import job_tokenizer
        from titanlike.rl.rewards import check_columns
        from titanlike.rl.rollout import PromptRows

        o, t, m = self.options, cfg.training, cfg.model
        tokenizer = job_tokenizer(m.tokenizer_path, m.hf_assets_path, DEFAULT_TOKENIZER_PATH)
        prompts = PromptRows.read(t.dataset_path, t.split, "train", self._processor(tokenizer))
        check_columns(self._rewards(tokenizer), prompts.columns)
        room = t.seq_len - o.max_completion_length
        longest = max(range(len(prompts.ids)), key=lambda i: len(prompts.ids[i]))
        if len(prompts.ids[longest]) > room:
            raise ValueError(f"prompt {longest + 1} of {t.dataset_path} has {len(prompts.ids[longest])} tokens, more "
                             f"than training.seq_len {t.seq_len} less grpo.max_completion_length "
                             f"{o.max_completion_length} ({room}): raise training.seq_len or shorten the prompts")

    def _processor(self, tokenizer):
        from titanlike.data.chat_template import load_chat_template
        from titanlike.inference.processor import Processor

        return Processor(tokenizer, template=load_chat_template(self.options.chat_template, tokenizer,
                                                                 option="grpo.chat_template"))

    def _rewards(self, tokenizer):
        from titanlike.rl.rewards import load_rewards

        o = self.options
        return load_rewards(o.reward_funcs, pattern=o.format_pattern or None, path=o.reward_model_path,
                            tokenizer=tokenizer)

    def rollout(self, plan: JobPlan):
        """The generating companion's Rollout for a planned job (titanlike/rl/rollout.py)."""
        from titanlike.data.tokenizer import pad_id
        from titanlike.rl.rollout import GRPORollout, PromptRows

        t = plan.cfg.training
        processor = self._processor(plan.tokenizer)
        prompts = PromptRows.read(t.dataset_path, t.split, "train", processor)
        return GRPORollout(self.options, prompts, processor, self._rewards(plan.tokenizer), seq_len=t.seq_len,
                           multiple=math.lcm(16, plan.dims.tp), pad_id=pad_id(plan.tokenizer),
                           compute_dtype=plan.precision.autocast_dtype)

    # Samples and batch ------------------------------------------------------------------------

    def sample_fields(self, seq_len: int) -> FieldShapes:
        """A generated row, what `prepare` takes (the loader's prompts are PromptSamples.fields): the step and
        the estimator see these. A microbatch holds num_generations rows per prompt."""
        tokens, row = ((seq_len,), "int64"), ((), "float32")
        return {"inputs": tokens, "labels": tokens, "engine_logps": ((seq_len,), "float32"), "advantages": row,
                "rewards": row, "truncated": ((), "int64")}

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.loader import GlobalSamples
        from titanlike.data.tokenizer import pad_id
        from titanlike.rl.rollout import PromptRows, PromptSamples

        self._check_dataset(dataset, dataset_path)
        prompts = PromptRows.read(dataset_path, split, split_name, self._processor(tokenizer))
        source = PromptSamples(prompts, seq_len=seq_len, pad_id=pad_id(tokenizer))
        return GlobalSamples(source, shuffle=True, fields=source.fields)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        """A generated batch (titanlike/rl/rollout.py GRPORollout.generate) as the model and the loss take
        it; the old policy's log-probabilities come with it when num_iterations > 1."""
        o = self.options
        labels = batch["labels"].to(ctx.device)
        targets = {"labels": labels, "completion_mask": labels != IGNORE_INDEX}
        logits_at = None
        if ctx.select_logits:
            # Logits of the completion tokens only (TRL's logits_to_keep, per token): the prompts' and
            # the padding's would be computed and never read. Found on the host, where the rows are.
            logits_at = batch["labels"].flatten().ne(IGNORE_INDEX).nonzero().squeeze(1).to(ctx.device)
            targets["logits_at"] = logits_at
        for name in ("advantages", "rewards", "truncated", "engine_logps", "old_logps"):
            if name in batch:
                targets[name] = batch[name].to(ctx.device)
        if o.loss_type in ("grpo", "dr_grpo"):
            units = torch.tensor(float(labels.shape[0]), device=ctx.device)
        else:
            mask = targets["completion_mask"]
            if o.mask_truncated_completions:
                mask = mask & ~targets["truncated"].bool().unsqueeze(1)
            units = mask.sum()
        return Microbatch(batch["inputs"].to(ctx.device), targets, units, logits_at=logits_at)

    # Loss -------------------------------------------------------------------------------------

    def loss(self, output, targets: Targets, ctx: BatchContext, *, correct: bool = False) -> LossTerms:
        """grpo_token_loss on the policy's log-probabilities of the completion tokens (logits / the
        sampling temperature, as TRL), with the reported terms as means over the microbatch times its
        units (the step divides their sums by the global units)."""
        from torch.distributed.tensor import DTensor

        o = self.options
        logits = logits_of(output) / o.temperature
        logps = completion_logps(logits, targets)
        entropies = None if isinstance(logits, DTensor) else at_positions(  # whole logits only
            token_entropy(logits), targets.get("logits_at"), targets["labels"].shape)
        terms = grpo_token_loss(o, logps, targets, entropies=entropies)
        with torch.no_grad():
            mask = targets["completion_mask"]
            m = mask.float()

            def mean(pair: torch.Tensor) -> torch.Tensor:
                return pair[0] / pair[1].clamp(min=1.0)

            nan = torch.full((), math.nan, device=logps.device)
            rewards = targets["rewards"].float()
            finite = ~rewards.isnan()
            values = [torch.where(finite, rewards, 0.0).sum() / finite.sum().clamp(min=1)]
            if o.beta:
                values.append(mean(terms.reported["kl"]))
            values.append(mean(terms.reported["clip_ratio/region_mean"]))
            values.append(mean(terms.reported["entropy"]) if entropies is not None else nan)
            # The engine's against the trainer's for the policy that generated (TRL's sampling_logp_difference):
            # the old policy's when kept, else the policy now (the first step on a batch).
            trainer = targets.get("old_logps", logps)
            values.append(((targets["engine_logps"] - trainer).abs() * m).sum() / m.sum().clamp(min=1.0))
            values.append(m.sum(-1).mean())
            reported = torch.stack(values) * terms.units
        return LossTerms(terms.value, reported)


register_objective("grpo", GRPO.for_job, section="grpo")


__all__ = ["ENGINE_IS_MODES", "GRPO", "GRPOOptions", "GRPOTerms", "LOSS_TYPES", "OLD_LOGPROBS", "SCALE_REWARDS",
           "at_positions", "check_options", "completion_logps", "engine_weights", "group_advantages", "grpo_token_loss", "kept_groups", "old_logps",
           "overlong_penalty", "policy_logps", "reported_values", "token_entropy"]
