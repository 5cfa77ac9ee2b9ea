"""GPT-2 family (GPT-2 124M to 1.5B, GPT-3 175B, and a CPU-sized debug model).

Sizes are the published ones (Radford et al. 2019; Brown et al. 2020, Table 2.1): context 1024
for GPT-2, 2048 for GPT-3, vocabulary 50257 (the GPT-2 BPE). Every flavor ties the output
projection to the token embeddings. vocab_size is a placeholder the trainer replaces with the
tokenizer's (update_from_config); max_seq_len is the real context and stays, because the
learned position table has that many rows.

This package is the whole family: the registry discovers it, and no generic file names it.
"""

from titanlike.models.gpt2.hf_adapter import GPT2HF
from titanlike.models.gpt2.megatron_adapter import MEGATRON
from titanlike.models.gpt2.model import GPT2, GPT2Args
from titanlike.models.common.sharding import decoder_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec

GPT2_VOCAB = 50257

gpt2_flavors: dict[str, GPT2Args] = {
    # CPU-sized: 8 heads so TP 2, 4 and 8 divide them; 4 layers so PP 2 with two stages per rank
    # still has a layer per stage. vocab 2048 is the debug tokenizer's.
    "debugmodel": GPT2Args(dim=256, n_layers=4, n_heads=8, vocab_size=2048, max_seq_len=1024,
                           tie_word_embeddings=True),
    "124M": GPT2Args(dim=768, n_layers=12, n_heads=12, vocab_size=GPT2_VOCAB, max_seq_len=1024,
                     tie_word_embeddings=True),
    "355M": GPT2Args(dim=1024, n_layers=24, n_heads=16, vocab_size=GPT2_VOCAB, max_seq_len=1024,
                     tie_word_embeddings=True),
    "774M": GPT2Args(dim=1280, n_layers=36, n_heads=20, vocab_size=GPT2_VOCAB, max_seq_len=1024,
                     tie_word_embeddings=True),
    # 25 heads: only tensor_parallel_degree 1, 5 or 25 divide them (validate refuses others).
    "1.5B": GPT2Args(dim=1600, n_layers=48, n_heads=25, vocab_size=GPT2_VOCAB, max_seq_len=1024,
                     tie_word_embeddings=True),
    # GPT-3 175B; init std 0.006 as Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh.
    "175B": GPT2Args(dim=12288, n_layers=96, n_heads=96, vocab_size=GPT2_VOCAB, max_seq_len=2048,
                     tie_word_embeddings=True, init_std=0.006),
}

register_model_spec(
    ModelSpec(
        name="gpt2",
        model_cls=GPT2,
        flavors=gpt2_flavors,
        shard=decoder_sharding(mlp_inputs=("w1",), position_embeddings=("pos_embeddings",)),
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings", "pos_embeddings"), outputs=("norm", "output")),
        hf=GPT2HF(),
        megatron=MEGATRON,
    )
)

__all__ = ["GPT2", "GPT2Args", "GPT2_VOCAB", "gpt2_flavors"]
