"""The hybrid's tensor + sequence parallelism: attention, MLP and MoE as every decoder (one norm per
block, sequence parallel); a Mamba-2 mixer split by groups of heads (models/common/mamba2.py): in_proj
colwise, out_proj rowwise, its conv filters, per-head vectors and gated norm split with the heads,
its input gathered on entry."""

from titanlike.models.common.mamba2 import mamba2_sharding
from titanlike.models.common.sharding import decoder_sharding, sequence_norm

hybrid_sharding = decoder_sharding(mlp_inputs=("w1", "w3")).with_changes(
    block={"norm": sequence_norm, **mamba2_sharding("mamba")},
    drop=("attention_norm", "ffn_norm"),
)

__all__ = ["hybrid_sharding"]
