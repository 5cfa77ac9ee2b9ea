"""BERT's tensor + sequence parallelism: the decoder's plan (attention by heads, MLP by hidden units,
vocabulary-split word table and output projection) with BERT's differences:
  - every LayerNorm is `sequence_replicated` (plain tensors in and out): a post-norm block's norms
    write the residual stream itself, which stays a plain sequence slice between modules;
  - the position and token-type tables are replicated and cut to the sequence slice;
  - the MLM transform runs token by token on the slice (replicated weights);
  - the binary head all-gathers the final hidden states (position 0 is on the first TP rank only)
    and its pooler and classifier are computed whole on every rank (replicated weights, whose
    gradients are then whole on every rank, as the binary loss is).
"""

from titanlike.models.common.sharding import decoder_sharding, gather_input, replicated, sequence_replicated

bert_sharding = decoder_sharding(mlp_inputs=("w1",), position_embeddings=("pos_embeddings", "type_embeddings")
                                 ).with_changes(
    top={"embedding_norm": sequence_replicated, "norm": sequence_replicated, "lm_head.dense": sequence_replicated,
         "lm_head.norm": sequence_replicated, "binary_head": gather_input(), "binary_head.pooler": replicated,
         "binary_head.classifier": replicated},
    block={"attention_norm": sequence_replicated, "ffn_norm": sequence_replicated},
    drop=("moe",),
)

__all__ = ["bert_sharding"]
