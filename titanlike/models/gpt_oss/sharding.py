"""gpt-oss's tensor + sequence parallelism: the shared decoder plan (attention split by heads, its q/k/v
biases with their rows and o's bias whole; the MoE routes this rank's sequence slice, its experts and
their biases split by expert parallelism), with the attention's sink logits split with its heads. That
is the head-split style of the Mamba-2 mixer (models/common/mamba2.py): the parameters a module names in
head_split_parameters split on dim 0, and its input all-gathered from sequence slices on entry."""

from titanlike.models.common.mamba2 import mamba2_head_split
from titanlike.models.common.sharding import decoder_sharding

gpt_oss_sharding = decoder_sharding(mlp_inputs=("w1", "w3")).with_changes(block={"attention": mamba2_head_split})

__all__ = ["gpt_oss_sharding"]
