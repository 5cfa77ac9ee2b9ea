"""Validation of pipeline parallelism: accepted layouts resolve, bad ones fail with one sentence,
and the microbatch rules agree with what torch's schedule classes accept."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from titanlike.config import ConfigError, load_job_config
from titanlike.train.plan import plan_job
from titanlike.parallel.pipeline import SCHEDULES, is_single_stage, microbatch_problem, plan_layout

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


def check(argv, world):
    return plan_job(load_job_config(argv), world_size=world).dims


def schedule(name):
    return ["--parallelism.pipeline_parallel_schedule", name]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_is_accepted_at_pp2(name):
    dims = check([*PP2, *schedule(name)], world=2)
    assert (dims.pp, dims.dp_degree) == (2, 1)


def test_schedule_names_are_case_insensitive():
    check([*PP2, *schedule("interleaved1f1b")], world=2)


def test_pipeline_composes_with_fsdp_tp_and_cp():
    dims = check([*PP2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
                  "--training.local_batch_size", "4"], world=16)
    assert (dims.pp, dims.dp_shard, dims.cp, dims.tp) == (2, 2, 2, 2)


@pytest.mark.parametrize(
    "argv, world, fragment",
    [
        (schedule("Interleaved1F1"), 2, "'Interleaved1F1' is unknown; this torch has GPipe, 1F1B"),
        (schedule("Interleaved1F1"), 2, "did you mean 'Interleaved1F1B'?"),
        (["--parallelism.pipeline_parallel_microbatch_size", "3"], 2,
         "training.local_batch_size 8 must be divisible by parallelism.pipeline_parallel_microbatch_size 3"),
        (["--parallelism.pipeline_parallel_microbatch_size", "0"], 2, "pipeline_parallel_microbatch_size must be at least 1"),
        # 8 samples in microbatches of 8: one microbatch for two stages.
        (["--parallelism.pipeline_parallel_microbatch_size", "8"], 2,
         "1F1B needs at least as many microbatches as stages (2), but local_batch_size 8 / "
         "pipeline_parallel_microbatch_size 8 gives 1"),
        ([*schedule("DualPipeV"), "--training.local_batch_size", "3"], 2,
         "DualPipeV needs at least as many microbatches as stages (4)"),
        # torch runs 5 microbatches in 5 // 2 = 2 rounds, which do not divide them.
        ([*schedule("Interleaved1F1B"), "--training.local_batch_size", "5"], 2,
         "so n must be below 2 x 2 or divisible by n // 2 = 2 (e.g. 4 or 6), but local_batch_size 5"),
        ([*schedule("InterleavedZeroBubble"), "--training.local_batch_size", "7"], 2, "(e.g. 6 or 8)"),
        # 8 layers cannot fill 2 x 8 stages.
        ([*schedule("Interleaved1F1B"), "--parallelism.pipeline_parallel_degree", "8"], 8,
         "llama3 debugmodel: Interleaved1F1B at pipeline_parallel_degree 8 needs 16 stages of at least one layer "
         "each, but the model has 8 layers"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "3"], 2,
         "8 layers at pipeline_parallel_layers_per_stage 3 make 3 stages, not a multiple of pipeline_parallel_degree 2"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"], 2,
         "1F1B runs one stage per rank, but pipeline_parallel_layers_per_stage 2 gives 4 stages"),
        ([*schedule("LoopedBFS"), "--parallelism.pipeline_parallel_layers_per_stage", "4"], 2,
         "LoopedBFS needs at least 2 stages per rank, but pipeline_parallel_layers_per_stage 4 gives 2 stages"),
        ([*schedule("ZBVZeroBubble"), "--parallelism.pipeline_parallel_layers_per_stage", "1"], 2,
         "ZBVZeroBubble needs exactly 2 stages per rank, but pipeline_parallel_layers_per_stage 1 gives 4; "
         "use 2 layers per stage"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "0"], 2, "must be at least 1, got 0"),
        ([*schedule("ZBVZeroBubble"), "--parallelism.fsdp_reshard_after_forward", "always"], 4,
         "so it needs fsdp_reshard_after_forward default or never"),
        ([*schedule("DualPipeV"), "--compile.enable"], 2, "DualPipeV splits the backward of each stage"),
        ([*schedule("InterleavedZeroBubble"), "--activation_checkpoint.mode", "selective",
          "--activation_checkpoint.selective_ac_option", "op"], 2, "which op-level selective activation"),
        (["--parallelism.pipeline_parallel_degree", "3"], 2, "pp 3"),
    ],
)
def test_bad_pipeline_configs(argv, world, fragment):
    with pytest.raises(ConfigError) as err:
        check([*PP2, *argv], world)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_reshard_always_is_fine_for_schedules_with_a_whole_backward():
    check([*PP2, *schedule("1F1B"), "--parallelism.fsdp_reshard_after_forward", "always"], world=4)


def test_compile_without_the_model_is_fine_for_split_backward_schedules():
    check([*PP2, *schedule("ZBVZeroBubble"), "--compile.enable", "--compile.components", "loss"], world=2)


def test_block_activation_checkpointing_is_fine_for_split_backward_schedules():
    check([*PP2, *schedule("ZBVZeroBubble"), "--activation_checkpoint.mode", "full"], world=2)
    check([*PP2, *schedule("DualPipeV"), "--activation_checkpoint.mode", "selective"], world=2)


@pytest.mark.parametrize("pp", [2, 4])
def test_microbatch_rules_match_torch(pp):
    """Every microbatch count our validation accepts, torch's schedule accepts, and vice versa.

    Schedules are only constructed (which is where torch checks the count), on a fake
    process group: nothing is communicated.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        disagreements = []
        for name, cls in SCHEDULES.items():
            layout = plan_layout(2 * pp, pp, name, None)
            for n in range(1, 3 * layout.num_stages):
                stages = [PipelineStage(nn.Linear(2, 2), s, layout.num_stages, torch.device("cpu"))
                          for s in layout.stages_of_rank(0)]
                try:
                    cls(stages[0] if is_single_stage(name) else stages, n_microbatches=n,
                        loss_fn=lambda out, target: out.sum(), scale_grads=False)
                    torch_ok = True
                except ValueError:
                    torch_ok = False
                if torch_ok != (microbatch_problem(name, n, layout) is None):
                    disagreements.append((name, n, torch_ok))
        assert not disagreements
    finally:
        dist.destroy_process_group()

