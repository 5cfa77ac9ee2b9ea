"""GRPO on every layout reproduces one process step by step on the same rollouts (issue 42, item 4):
FSDP2, HSDP (2 replicas), TP2 and FSDP2 x TP2 against one process that accumulates as many microbatches
as the layout has data-parallel ranks, so each rank's prompts are one microbatch of the one process's;
a LoRA policy under FSDP2 and TP2 against one LoRA process (the reference is the policy with its
adapters off); a mixture-of-experts policy (qwen3 debugmodel_moe) under EP2 against one MoE process,
the experts split over the ranks and gathered whole for generation. fp32, seed 2 (one whose rollouts
drop and refill groups at both generating steps, which the refill checks need), three steps of the
tiny debug model: a generation, a second step on the same rollouts (num_iterations 2, the old
policy's log-probabilities), a generation from the updated policy (a second gather of its weights);
beta 0.1 builds the reference (a frozen copy sharded like the policy); advantages are scaled by the
std of the whole generation's rewards (scale_rewards batch: every microbatch, every rank, as TRL's
global batch), one all-reduce. Dynamic sampling drops the
groups whose rewards are all equal and refills them (two rounds at steps 1 and 3): the data-parallel
ranks agree on the rounds, and a refill draws the prompts and seeds one process draws.

The rollouts are equal because a microbatch's sampling seed is a function of its place in the global
batch (train/companions.py rollout_seed), never of the layout, and the policy's gathered copy is the
whole model every rank generates from. The reward, a format check for a digit, varies among the
untrained model's completions, so the gradients are real. Tolerances: test_fsdp_parity.py's (the
layouts differ in the order of sums only); the first step's loss is a sum of advantages that cancel
(~1e-7), compared absolutely.

Cost of the HSDP, LoRA and MoE tests: the file took 139 s against 110 s without them, back to back on the
shared 2-core machine (load ~14): ~30 s more, their jobs joining the pool's 2-rank batch (the MoE model
has two layers); their two one-process references run in the test process.
"""

from __future__ import annotations

import pytest

from conftest import REPO, train_metrics

RTOL, GRAD_RTOL = 2e-5, 5e-4
GRPO_JOB = ("--job.config_file", str(REPO / "train_configs" / "grpo_debug.toml"), "--model.flavor", "debugmodel_tiny",
            "--training.dataset_path", str(REPO / "tests" / "assets" / "grpo" / "addition.jsonl"),
            "--training.steps", "3", "--grpo.reward_funcs", "format", "--grpo.format_pattern", "(?s).*[0-9].*",
            "--grpo.beta", "0.1", "--grpo.num_iterations", "2", "--optimizer.lr", "1e-3",
            "--training.local_batch_size", "2", "--training.global_batch_size", "4", "--grpo.dynamic_sampling",
            "--grpo.scale_rewards", "batch", "--debug.seed", "2")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Two microbatches of two prompts (x 4 completions) per step in one process."""
    return train_metrics(tmp_path_factory.mktemp("grpo"), "one", *GRPO_JOB)


def assert_same_steps(got: list[dict], ref: list[dict], *, sharded: bool = True) -> None:
    """sharded: the layout splits the parameters, so each update's weights are gathered for generation
    (HSDP's replicas alone hold whole parameters: a gather brings in nothing)."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3]
    assert ref[-1]["kl"] > 0 and all(r["grad_norm"] > 0 for r in ref) and 0 < ref[0]["reward/mean"] < 1
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL, abs=1e-6), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GRAD_RTOL), (g, r)
        for name in ("reward/trained_mean", "kl", "completion_length/trained_mean", "clip_ratio"):
            assert g[name] == pytest.approx(r[name], rel=RTOL, abs=1e-7), (name, g, r)
        assert g["mismatch"] < 1e-5
    for g, r in zip(got[::2], ref[::2]):  # the generating steps: every rank's rollouts, reduced
        assert g["reward/format/mean"] == pytest.approx(r["reward/format/mean"], rel=1e-6), (g, r)
        assert g["completion_length/max"] == r["completion_length/max"]
        for name in ("rollout/rounds", "rollout/missing_prompts", "rollout/dropped_prompts"):
            assert g[name] == r[name], (name, g, r)
        assert "policy_gather_bytes" not in r  # one process generates from the module itself
        assert g["policy_gather_bytes"] > 0 if sharded else g["policy_gather_bytes"] == 0  # one gather per update


def test_the_one_process_run_refills(one_process):
    """What the layouts reproduce: each generating step drops groups and refills them in a second round."""
    for r in one_process[::2]:
        assert r["rollout/rounds"] == 2 and r["rollout/missing_prompts"] == 0 and r["rollout/dropped_prompts"] > 0


@pytest.mark.distributed
@pytest.mark.train_run(*GRPO_JOB, "--parallelism.data_parallel_shard_degree", "2", nproc=2)
def test_grpo_fsdp2(train_run, one_process):
    assert_same_steps(train_run.metrics, one_process)


@pytest.mark.distributed
@pytest.mark.train_run(*GRPO_JOB, "--parallelism.data_parallel_replicate_degree", "2", nproc=2)
def test_grpo_hsdp(train_run, one_process):
    assert_same_steps(train_run.metrics, one_process, sharded=False)


@pytest.mark.distributed
@pytest.mark.train_run(*GRPO_JOB, "--parallelism.tensor_parallel_degree", "2", nproc=2)
def test_grpo_tp2(train_run, one_process):
    assert_same_steps(train_run.metrics, one_process)


@pytest.mark.distributed
@pytest.mark.train_run(*GRPO_JOB, "--parallelism.data_parallel_shard_degree", "2",
                       "--parallelism.tensor_parallel_degree", "2", nproc=4)
def test_grpo_fsdp2_tp2(train_run, one_process):
    assert_same_steps(train_run.metrics, one_process)


LORA = ("--model.converters", "lora")


@pytest.fixture(scope="module")
def lora_one_process(tmp_path_factory):
    return train_metrics(tmp_path_factory.mktemp("grpo_lora"), "one", *GRPO_JOB, *LORA)


def assert_lora_steps(got: list[dict], ref: list[dict], full: list[dict]) -> None:
    """A LoRA run equals its one-process run; that one trains adapters only: its first step (B = 0, so
    the policy is the base) generates and scores what the full model's does, with a far smaller gradient."""
    assert_same_steps(got, ref)
    assert ref[0]["reward/mean"] == full[0]["reward/mean"] and ref[0]["loss"] == pytest.approx(full[0]["loss"], abs=1e-6)
    assert ref[0]["grad_norm"] < full[0]["grad_norm"] / 5


@pytest.mark.distributed
@pytest.mark.train_run(*GRPO_JOB, *LORA, "--parallelism.data_parallel_shard_degree", "2", nproc=2)
def test_grpo_lora_fsdp2(train_run, lora_one_process, one_process):
    assert_lora_steps(train_run.metrics, lora_one_process, one_process)


@pytest.mark.distributed
@pytest.mark.train_run(*GRPO_JOB, *LORA, "--parallelism.tensor_parallel_degree", "2", nproc=2)
def test_grpo_lora_tp2(train_run, lora_one_process, one_process):
    assert_lora_steps(train_run.metrics, lora_one_process, one_process)


# Two layers (the dense first one, one MoE layer) keep the job short. Aux-loss-free balancing moves the
# router's expert_bias (a buffer) every step: the generating copy must follow it as it follows the weights.
MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.args.n_layers", "2",
       "--moe.bias_update_rate", "0.001")


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory):
    return train_metrics(tmp_path_factory.mktemp("grpo_moe"), "one", *GRPO_JOB, *MOE)


@pytest.mark.distributed
@pytest.mark.train_run(*GRPO_JOB, *MOE, "--parallelism.expert_parallel_degree", "2", nproc=2)
def test_grpo_moe_ep2(train_run, moe_one_process):
    assert_same_steps(train_run.metrics, moe_one_process)
    for g, r in zip(train_run.metrics, moe_one_process):
        assert g["moe/aux_loss"] == pytest.approx(r["moe/aux_loss"], rel=1e-4), (g, r)
