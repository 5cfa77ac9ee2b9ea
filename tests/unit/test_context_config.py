"""Validation of context parallelism: accepted layouts resolve, bad ones fail with one sentence."""

import pytest

from titanlike.config import ConfigError, load_job_config
from titanlike.train.plan import plan_job


def check(argv, world):
    return plan_job(load_job_config(argv), world_size=world).dims


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_context_parallel_is_accepted(method):
    dims = check(["--parallelism.context_parallel_degree", "2",
                  "--parallelism.context_parallel_rotate_method", method], world=2)
    assert (dims.cp, dims.dp_shard, dims.dp_degree) == (2, 1, 1)


def test_cp_composes_with_fsdp_and_tp():
    dims = check(["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"], world=8)
    assert (dims.dp_shard, dims.cp, dims.tp, dims.dp_degree) == (2, 2, 2, 2)


@pytest.mark.parametrize(
    "argv, world, fragment",
    [
        # 2 x cp = 4 chunks of a 6-token sequence are not equal.
        (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "6"], 2,
         "training.seq_len 6 must be divisible by 2 x context_parallel_degree 2 x tensor_parallel_degree 1 = 4"),
        # 36 passes the tp rule (divisible by 2) and cuts into 2 x cp = 4 chunks of 9, which tp cannot split.
        (["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
          "--training.seq_len", "36"], 4, "= 8, so that context parallelism can cut it into 2 x 2 equal chunks"),
        (["--parallelism.context_parallel_degree", "3"], 2, "not divisible by replicate 1 x cp 3"),
        (["--parallelism.context_parallel_degree", "0"], 1, "context_parallel_degree must be at least 1"),
    ],
)
def test_bad_context_parallel_layouts(argv, world, fragment):
    with pytest.raises(ConfigError) as err:
        check(argv, world)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_rotate_method_is_refused():
    with pytest.raises(ConfigError) as err:
        load_job_config(["--parallelism.context_parallel_rotate_method", "ring"])
    assert "allgather" in str(err.value) and "alltoall" in str(err.value)


def test_a_model_without_sequence_hooks_is_refused_whole():
    """CP needs an attention (core_attention) or state-carrying mixer (sequence_carry) hook somewhere
    in the model; a model with none would attend within each rank's slice only."""
    import torch.nn as nn

    from titanlike.models.common.attention import Attention
    from titanlike.parallel.context import require_context_parallel_hooks

    with pytest.raises(ValueError, match="Sequential has no attention module with a core_attention hook"):
        require_context_parallel_hooks(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    require_context_parallel_hooks(nn.Sequential(nn.Linear(4, 4), Attention(16, 2, 2, 8)))
