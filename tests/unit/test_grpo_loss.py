"""GRPO's loss, advantages and logged terms against TRL's own code (trl 1.16).

TRL's GRPOTrainer is built without its __init__ (object.__new__) and given the attributes its
methods read; stand-ins replace generation (`_generate`: fixed completions, ragged, two of them cut
at the length limit), the model (`_get_per_token_logps_and_entropies`: our log-probabilities, the old
policy's or the reference's by the model asked) and the rewards (`_calculate_rewards`: our
rewards per function). Its `_generate_and_score_completions` then computes the advantages, the
truncation mask and the engine's importance weights, and its `_compute_loss` the loss and the logged
metrics; ours must give the same loss (value / units), gradient with respect to the log-probabilities
and reported terms, within 1e-6, for every combination of the options below.
"""

from __future__ import annotations

import itertools
import math
import types
from collections import defaultdict

import pytest
import torch

from titanlike.objectives.grpo import (GRPOOptions, check_options, group_advantages, grpo_token_loss, kept_groups,
                                       overlong_penalty, reported_values)
from titanlike.rl.rewards import Reward, compute_rewards

trl = pytest.importorskip("trl")

B, G, T = 8, 4, 7
LENGTHS = [7, 3, 5, 1, 6, 7, 2, 4]
TRUNCATED = [True, False, False, False, False, True, False, False]  # cut at T tokens: no end-of-text
EOS, PAD = 2, 0
TOL = 1e-6
# Rewards per function (None: no reward for that row); row 7 has none at all, group 2 is constant in its
# first function.
REWARDS = [[1.0, 0.5], [0.0, None], [2.0, 0.25], [0.5, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [None, None]]
WEIGHTS = [1.0, 0.5]
ENGINE_MODES = (None, "sequence_mask", "token_truncate", "sequence_truncate", "token_mask")


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    logps = -2 * torch.rand(B, T, generator=g) - 0.05
    old = logps + 0.3 * torch.randn(B, T, generator=g)
    # Ratios clipped on both sides, per token and per completion (group 1's advantages: +, -, +, -).
    old[1, 0] = logps[1, 0] + 1.0
    old[0, 1] = logps[0, 1] - 0.5
    old[3, 0] = logps[3, 0] + 0.5
    old[2, :5] = logps[2, :5] - 0.4
    return {"logps": logps, "old_logps": old, "ref_logps": logps + 0.5 * torch.randn(B, T, generator=g),
            "engine_logps": old + 0.4 * torch.randn(B, T, generator=g), "completion_mask": mask,
            "entropies": 3 * torch.rand(B, T, generator=g), "truncated": torch.tensor(TRUNCATED)}


def rewards() -> tuple[torch.Tensor, torch.Tensor]:
    """Our total and per-function rewards of REWARDS, through compute_rewards."""
    funcs = [Reward(f"r{i}", lambda prompts, completions, i=i, **kw: [row[i] for row in REWARDS])
             for i in range(2)]
    total, per_function, _ = compute_rewards(funcs, WEIGHTS, ["p"] * B, ["c"] * B, {})
    return total, per_function


def trl_trainer(o: GRPOOptions, data: dict, policy_logps: torch.Tensor, *, engine: bool, off_policy: bool):
    """A GRPOTrainer with only what _generate_and_score_completions and _compute_loss read."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    policy, ref_model = object(), object()
    t.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    t.ref_model = ref_model if o.beta else None
    t.accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x,
                                          gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
                                          process_index=0, num_processes=1)
    t.args = types.SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1, per_device_train_batch_size=B,
                                   gradient_checkpointing_kwargs=None, delta=None,
                                   use_bias_correction_kl=o.kl_bias_correction)
    for name, value in dict(
            environment_factories=None, environments=None, tools=None, pad_to_multiple_of=None, eos_token_ids=[EOS],
            log_multimodal=False,
            _tokenizer=types.SimpleNamespace(pad_token_id=PAD), num_generations=G, beta=o.beta, loss_type=o.loss_type,
            scale_rewards=o.scale_rewards, importance_sampling_level=o.importance_sampling_level,
            mask_truncated_completions=o.mask_truncated_completions, multi_objective_aggregation="sum_then_normalize",
            reward_weights=torch.tensor(WEIGHTS), reward_func_names=["r0", "r1"], epsilon_low=o.epsilon,
            epsilon_high=o.epsilon if o.epsilon_high is None else o.epsilon_high,
            num_iterations=2 if off_policy else 1, max_completion_length=T, use_vllm=engine,
            vllm_importance_sampling_correction=engine, vllm_importance_sampling_mode=o.engine_importance_sampling_mode,
            vllm_importance_sampling_clip_min=o.engine_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=o.engine_importance_sampling_clip_max, off_policy_mask_threshold=None,
            top_entropy_quantile=1.0, aux_loss_enabled=False, _entropy_bonus_enabled=False,
            current_gradient_accumulation_steps=1).items():
        setattr(t, name, value)
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []}
    t._pending_extra_logs, t._pending_metrics = defaultdict(list), defaultdict(list)

    completion_ids = [[7] * (n - 1) + [9 if cut else EOS] for n, cut in zip(LENGTHS, TRUNCATED)]
    engine_lists = [data["engine_logps"][i, :n].tolist() for i, n in enumerate(LENGTHS)]
    t._generate = lambda prompts: ([[5, 6]] * B, completion_ids, None, ["c"] * B,
                                   engine_lists if engine else None, {}, None, None)
    rows = torch.tensor([[math.nan if r is None else r for r in row] for row in REWARDS])
    t._calculate_rewards = lambda inputs, prompts, completions, ids: rows.clone()

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        if model is policy:
            return policy_logps, data["entropies"], None
        if model is ref_model:
            return data["ref_logps"].clone(), None, None
        # The old policy, computed at generation: the current one when on-policy.
        return (data["old_logps"] if off_policy else data["logps"]).clone(), None, None

    t._get_per_token_logps_and_entropies = logps_and_entropies
    return t, policy


def run_trl(o: GRPOOptions, data: dict, *, engine: bool, off_policy: bool):
    logps = data["logps"].clone().requires_grad_()
    t, policy = trl_trainer(o, data, logps, engine=engine, off_policy=off_policy)
    inputs = t._generate_and_score_completions([{"prompt": "p"}] * B)
    loss = t._compute_loss(policy, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in t._metrics["train"].items() if not k.startswith(("reward", "frac_"))}
    return loss.detach(), logps.grad, metrics, inputs


def run_ours(o: GRPOOptions, data: dict, advantages: torch.Tensor, *, off_policy: bool):
    logps = data["logps"].clone().requires_grad_()
    targets = {"completion_mask": data["completion_mask"], "advantages": advantages, "truncated": data["truncated"],
               "ref_logps": data["ref_logps"], "engine_logps": data["engine_logps"]}
    if off_policy:
        targets["old_logps"] = data["old_logps"]
    terms = grpo_token_loss(o, logps, targets, entropies=data["entropies"])
    loss = terms.value / terms.units
    loss.backward()
    return loss.detach(), logps.grad, reported_values(terms.reported)


def options(loss_type, level, beta, epsilon_high, engine_mode, mask_truncated) -> GRPOOptions:
    o = GRPOOptions(num_generations=G, loss_type=loss_type, importance_sampling_level=level, beta=beta,
                    epsilon_high=epsilon_high, mask_truncated_completions=mask_truncated, max_completion_length=T,
                    engine_importance_sampling_correction=engine_mode is not None,
                    engine_importance_sampling_mode=engine_mode or "sequence_mask",
                    # Bounds that the batch's weights cross on both sides, so clipping and masking act.
                    engine_importance_sampling_clip_max=1.5 if engine_mode else 3.0,
                    engine_importance_sampling_clip_min=0.6 if engine_mode else None)
    check_options(o)
    return o


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_gradient_and_reports_equal_trl(loss_type, level):
    data = batch()
    total, _ = rewards()
    largest = defaultdict(float)
    for beta, epsilon_high, engine_mode, mask_truncated, off_policy in itertools.product(
            (0.0, 0.04), (None, 0.28), ENGINE_MODES, (False, True), (False, True)):
        case = f"{loss_type} {level} beta={beta} epsilon_high={epsilon_high} engine={engine_mode} " \
               f"mask_truncated={mask_truncated} off_policy={off_policy}"
        o = options(loss_type, level, beta, epsilon_high, engine_mode, mask_truncated)
        want, want_grad, want_reports, inputs = run_trl(o, data, engine=engine_mode is not None, off_policy=off_policy)
        advantages = group_advantages(total, G, o.scale_rewards)
        largest["advantages"] = max(largest["advantages"], (advantages - inputs["advantages"]).abs().max().item())
        assert largest["advantages"] <= TOL, case
        got, got_grad, got_reports = run_ours(o, data, advantages, off_policy=off_policy)
        largest["loss"] = max(largest["loss"], (got - want).abs().item())
        largest["gradient"] = max(largest["gradient"], (got_grad - want_grad).abs().max().item())
        assert largest["loss"] <= TOL, case
        assert largest["gradient"] <= TOL, case
        assert got_reports.keys() == want_reports.keys(), case
        for name, value in want_reports.items():
            largest["reported"] = max(largest["reported"], abs(got_reports[name] - value))
            assert abs(got_reports[name] - value) <= TOL, f"{case}: {name} {got_reports[name]} != TRL's {value}"
    print(f"\nlargest differences {loss_type} {level}: {dict(largest)}")


def test_the_batch_exercises_every_branch():
    """The cases above mean something: ratios are clipped on both sides, the engine's weights cross
    both bounds, and masking truncated completions changes the loss."""
    data = batch()
    total, _ = rewards()
    advantages = group_advantages(total, G, "group")
    for level in ("token", "sequence"):
        _, _, reports = run_ours(options("dapo", level, 0.0, 0.28, None, False), data, advantages, off_policy=True)
        assert reports["clip_ratio/low_mean"] > 0 and reports["clip_ratio/high_mean"] > 0, level
    o = options("dapo", "token", 0.0, None, "token_mask", False)
    _, _, reports = run_ours(o, data, advantages, off_policy=True)
    assert reports["sampling/importance_sampling_ratio/min"] == 0.0  # masked
    o = options("dapo", "token", 0.0, None, "token_truncate", False)
    _, _, reports = run_ours(o, data, advantages, off_policy=True)
    assert reports["sampling/importance_sampling_ratio/min"] == pytest.approx(0.6)
    assert reports["sampling/importance_sampling_ratio/max"] == pytest.approx(1.5)
    loss = [run_ours(options("grpo", "token", 0.0, None, None, m), data, advantages, off_policy=True)[0]
            for m in (False, True)]
    assert loss[0] != loss[1]


@pytest.mark.parametrize("missing, change", [("engine_logps", {}), ("ref_logps", {"beta": 0.04})])
def test_a_missing_target_is_one_sentence(missing, change):
    data = batch()
    o = GRPOOptions(**change)
    targets = {"completion_mask": data["completion_mask"], "advantages": torch.zeros(B), "truncated": data["truncated"],
               "ref_logps": data["ref_logps"], "engine_logps": data["engine_logps"]}
    del targets[missing]
    with pytest.raises(ValueError, match=f"the GRPO loss needs the target {missing} with these grpo options"):
        grpo_token_loss(o, data["logps"], targets)


@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_engines_log_probabilities_as_the_old_policy(level, correction):
    """old_logprobs engine: pi_old is pi_engine (a token it could not score: the policy's own), so the ratio
    pi / pi_engine carries the correction and its clip truncates it; the engine weight pi_old / pi_engine is
    1 whatever the correction's options; old_logps, if a batch had them, are not read. By hand, dapo."""
    data = batch()
    engine = data["engine_logps"].clone()
    engine[4, 2] = math.nan
    advantages = torch.linspace(-1.5, 1.5, B)
    targets = {"completion_mask": data["completion_mask"], "advantages": advantages, "truncated": data["truncated"],
               "engine_logps": engine, "old_logps": data["old_logps"] - 5.0}
    o = GRPOOptions(num_generations=G, loss_type="dapo", importance_sampling_level=level, epsilon_high=0.28,
                    old_logprobs="engine", engine_importance_sampling_correction=correction)
    logps = data["logps"].clone().requires_grad_()
    terms = grpo_token_loss(o, logps, targets)
    (terms.value / terms.units).backward()

    lp = data["logps"].clone().requires_grad_()
    m = data["completion_mask"].float()
    old = torch.where(engine.isnan(), lp.detach(), engine)
    log_ratio = lp - old
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1)).unsqueeze(-1)
    r, a = log_ratio.exp(), advantages.unsqueeze(1)
    want = (-torch.min(r * a, r.clamp(0.8, 1.28) * a) * m).sum() / m.sum()
    want.backward()
    assert terms.units == m.sum()
    assert (terms.value / terms.units - want).abs() <= TOL and (logps.grad - lp.grad).abs().max() <= TOL
    if level == "token":
        assert 0 < terms.reported["clip_ratio/region_mean"][0]  # some ratios against the engine are clipped
    assert not any(name.startswith("sampling/") for name in terms.reported)  # no engine weight: it is 1
    # The trainer's old policy instead: another loss.
    trainer = grpo_token_loss(GRPOOptions(num_generations=G, loss_type="dapo", importance_sampling_level=level,
                                          epsilon_high=0.28, engine_importance_sampling_correction=correction),
                              data["logps"], targets)
    assert (trainer.value - terms.value).abs() > 1e-3


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards):
    """Group means, the group's or the batch's std (Bessel), none; a row without rewards gets 0."""
    data = batch()
    total, per_function = rewards()
    assert per_function.shape == (2, B) and math.isnan(total[7])
    o = GRPOOptions(num_generations=G, scale_rewards=scale_rewards, engine_importance_sampling_correction=False)
    _, _, _, inputs = run_trl(o, data, engine=False, off_policy=False)
    got = group_advantages(total, G, scale_rewards)
    print(f"\nlargest difference of the advantages, scale_rewards {scale_rewards}: "
          f"{(got - inputs['advantages']).abs().max().item()}")
    assert (got - inputs["advantages"]).abs().max() <= TOL
    assert got[7] == 0.0


def test_batch_scaling_spans_every_microbatch_of_a_generation_as_trls_global_batch():
    """scale_rewards batch: TRL divides by the std of its whole (global) batch; titanlike's rollout makes a
    generation as several microbatches (and ranks: `total` sums over them, tests/distributed/
    test_grpo_parity.py), each with unscaled advantages, then complete() scales them all by that std."""
    from titanlike.rl.rollout import GRPORollout

    total, _ = rewards()
    o = GRPOOptions(num_generations=G, scale_rewards="batch", engine_importance_sampling_correction=False)
    _, _, _, inputs = run_trl(o, batch(), engine=False, off_policy=False)
    halves = [{"rewards": part, "advantages": group_advantages(part, G, "none")} for part in total.split(B // 2)]
    GRPORollout.complete(types.SimpleNamespace(options=o), halves, total=lambda t: t)
    got = torch.cat([h["advantages"] for h in halves])
    assert (got - inputs["advantages"]).abs().max() <= TOL
    # Each half by its own std (what the rollout did before) is not TRL's.
    assert (torch.cat([group_advantages(h, G, "batch") for h in total.split(B // 2)]) - got).abs().max() > 1e-2


def test_dynamic_sampling_keeps_groups_with_different_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 2.0, math.nan, 2.0, math.nan, 3.0, math.nan,
                            math.nan])
    assert kept_groups(rewards, 4).tolist() == [False, True, False, False]
    # TRL counts the same groups as having zero reward std.
    std = torch.tensor([0.0, 0.5, 0.0])
    assert torch.isclose(std, torch.zeros(3)).tolist() == (~kept_groups(rewards[:12], 4)).tolist()


def test_overlong_penalty_equals_trl():
    from trl.rewards import get_soft_overlong_punishment

    lengths = list(range(0, 14))
    want = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)([[1] * n for n in lengths])
    got = overlong_penalty(torch.tensor(lengths), 10, 4, factor=0.5)
    assert torch.allclose(got, 0.5 * torch.tensor(want), atol=TOL)
    assert overlong_penalty(torch.tensor(lengths), 10, 0).abs().sum() == 0


@pytest.mark.parametrize("change, message", [
    ({"num_generations": 1}, "grpo.num_generations must be at least 2"),
    ({"max_offpolicy_steps": -1}, "grpo.max_offpolicy_steps must not be negative"),
    ({"dynamic_sampling_max_rounds": 0}, "grpo.dynamic_sampling_max_rounds must be at least 1"),
    ({"beta": -0.1}, "grpo.beta must not be negative"),
    ({"epsilon": 1.0}, "grpo.epsilon must lie in"),
    ({"engine_importance_sampling_clip_min": 4.0}, "clip_min (4.0) must not exceed clip_max"),
    ({"overlong_buffer_length": 600}, "grpo.overlong_buffer_length must lie in"),
    ({"reward_funcs": ["format"], "reward_weights": [1.0, 2.0]}, "grpo.reward_weights has 2 weights for 1"),
    ({"sample_freq": -1}, "grpo.sample_freq must not be negative"),
])
def test_bad_options_are_one_sentence(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_options(GRPOOptions(**change))


def test_the_loss_and_its_reports_read_nothing_back_to_the_host():
    """No .item(), bool(), ... of a tensor (test_host_syncs.py's count), with every option on."""
    from test_host_syncs import counting_syncs

    data = batch()
    targets = {"completion_mask": data["completion_mask"], "advantages": torch.randn(B), "truncated": data["truncated"],
               "old_logps": data["old_logps"], "ref_logps": data["ref_logps"], "engine_logps": data["engine_logps"]}
    counter = {"on": True, "calls": []}
    for level, mode in (("token", "token_mask"), ("sequence", "sequence_truncate")):
        o = options("grpo", level, 0.04, 0.28, mode, True)
        with counting_syncs(counter):
            terms = grpo_token_loss(o, data["logps"].clone().requires_grad_(), targets, entropies=data["entropies"])
            (terms.value / terms.units).backward()
    assert counter["calls"] == []


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_logits_of_the_completion_tokens_only_give_the_same_loss_gradients_and_reports(beta):
    """BatchContext.select_logits: the model projects only the completion tokens (Microbatch.logits_at), the
    loss reads them back into (batch, seq): the loss, the reported terms and every parameter's gradient are
    those of the whole logits (one row's logits do not depend on which other rows are computed)."""
    from titanlike.models.outputs import IGNORE_INDEX
    from titanlike.models.registry import get_model_spec
    from titanlike.objectives.base import BatchContext
    from titanlike.objectives.grpo import GRPO, policy_logps

    spec = get_model_spec("llama3")
    model = spec.model_cls(spec.flavors["debugmodel_tiny"].update_from_config(vocab_size=2256, seq_len=16))
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    rows, width = 4, 16
    inputs = torch.randint(0, 2256, (rows, width), generator=g)
    labels = torch.full((rows, width), IGNORE_INDEX)
    for row, (start, stop) in enumerate([(3, 9), (5, 16), (2, 4), (7, 12)]):  # right-padded completions
        labels[row, start:stop] = torch.randint(0, 2256, (stop - start,), generator=g)
    batch = {"inputs": inputs, "labels": labels, "advantages": torch.tensor([1.0, -0.5, 0.25, -0.75]),
             "rewards": torch.tensor([1.0, 0.0, 0.5, 0.0]), "truncated": torch.tensor([0, 1, 0, 0]),
             "engine_logps": -torch.rand(rows, width, generator=g)}
    objective = GRPO(GRPOOptions(num_generations=2, beta=beta, loss_type="dapo"))
    results = []
    for select in (False, True):
        model.zero_grad()
        mb = objective.prepare(batch, BatchContext(torch.device("cpu"), select_logits=select))
        assert (mb.logits_at is not None) == select
        if beta:  # the reference's log-probabilities, as its companion adds them (here: the policy's own)
            with torch.no_grad():
                mb.targets.update(policy_logps("ref_logps", objective.options.temperature,
                                               model(mb.inputs, **mb.forward_kwargs()), mb.targets))
        output = model(mb.inputs, **mb.forward_kwargs())
        assert output.shape == ((int((labels != IGNORE_INDEX).sum()), 2256) if select else (rows, width, 2256))
        terms = objective.loss(output, mb.targets, None)
        terms.value.backward()
        results.append((terms.value.detach(), terms.reported, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (whole, whole_reported, whole_grads), (packed, packed_reported, packed_grads) = results
    torch.testing.assert_close(packed, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_reported, whole_reported, rtol=1e-5, atol=1e-6, equal_nan=True)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
