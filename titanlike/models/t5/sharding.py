"""T5's tensor + sequence parallelism: heads split in self- and cross-attention (wq, wk, wv by output
features, wo by input features), the MLP by hidden units, norms sequence parallel, the vocabulary
split in the token table and the output projection, and each relative-bias table split by heads
(its `head_split_parameters`). Cross-attention all-gathers both of its sequence inputs (its own
stream and the encoder's output; CrossAttention.sequence_inputs). Encoder blocks have no
cross-attention entries (skipped)."""

from titanlike.models.common.sharding import (
    ShardingPlan,
    colwise,
    gather_input,
    rowwise,
    sequence_norm,
    split_heads,
    vocab_embedding,
    vocab_output,
)


def _block() -> dict:
    block = {}
    for attention in ("attention", "cross_attention"):
        block.update({f"{attention}_norm": sequence_norm, attention: gather_input("wq", "wk", "wv"),
                      f"{attention}.wq": colwise, f"{attention}.wk": colwise, f"{attention}.wv": colwise,
                      f"{attention}.wo": rowwise})
    block.update({"ffn_norm": sequence_norm, "feed_forward": gather_input("w1", "w3"), "feed_forward.w1": colwise,
                  "feed_forward.w3": colwise, "feed_forward.w2": rowwise})
    return block


t5_sharding = ShardingPlan(
    top={"tok_embeddings": vocab_embedding, "encoder_relative_bias": split_heads,
         "decoder_relative_bias": split_heads, "encoder_norm": sequence_norm, "norm": sequence_norm,
         "output": vocab_output},
    block=_block(),
)

__all__ = ["t5_sharding"]
