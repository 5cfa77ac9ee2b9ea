"""T5 family: encoder-decoder with relative position buckets (Raffel et al. 2020).

Flavors are T5 v1.1's sizes (google/t5-v1_1-*: gated-GELU MLP, untied output projection that is
not scaled): small, base, large, and xl / xxl under the names 3B and 11B. vocab_size 32128 is
T5's SentencePiece vocabulary padded; a placeholder the trainer replaces with the tokenizer's. The
original T5's variant (ReLU MLP, tied and scaled output) is the args' feed_forward="relu",
tie_word_embeddings=True, scale_decoder_outputs=True (T5Args), read from and written to Hugging
Face folders like v1.1.

Parallelism: FSDP/HSDP and tensor (+ sequence) parallelism; pipeline and context parallelism are
refused by T5Args.validate. This package is the whole family: the registry discovers it.
"""

from titanlike.models.registry import ModelSpec, register_model_spec
from titanlike.models.t5.hf_adapter import T5HF
from titanlike.models.t5.model import T5, T5Args
from titanlike.models.t5.sharding import t5_sharding


def _v1_1(dim: int, layers: int, heads: int, ffn: int, vocab: int = 32128) -> T5Args:
    return T5Args(dim=dim, n_encoder_layers=layers, n_decoder_layers=layers, n_heads=heads, head_dim=64,
                  ffn_hidden_dim=ffn, vocab_size=vocab, feed_forward="gated-gelu", tie_word_embeddings=False,
                  scale_decoder_outputs=False)


t5_flavors: dict[str, T5Args] = {
    # CPU-sized: 8 heads so TP 2, 4 and 8 divide them; vocab 2048 is the debug tokenizer's.
    "debugmodel": T5Args(dim=256, n_encoder_layers=2, n_decoder_layers=2, n_heads=8, head_dim=32,
                         ffn_hidden_dim=512, vocab_size=2048, max_seq_len=512),
    "small": _v1_1(512, 8, 6, 1024),  # 6 heads: TP 2, 3 or 6
    "base": _v1_1(768, 12, 12, 2048),
    "large": _v1_1(1024, 24, 16, 2816),
    "3B": _v1_1(2048, 24, 32, 5120),  # t5-v1_1-xl
    "11B": _v1_1(4096, 24, 64, 10240),  # t5-v1_1-xxl
}


register_model_spec(
    ModelSpec(
        name="t5",
        model_cls=T5,
        flavors=t5_flavors,
        shard=t5_sharding,
        pipeline_ends=None,  # no pipeline parallelism (T5Args.validate says why)
        hf=T5HF(),
        objective="span_corruption",
    )
)

__all__ = ["T5", "T5Args", "t5_flavors", "t5_sharding"]
