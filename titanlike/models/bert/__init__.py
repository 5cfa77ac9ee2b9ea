"""BERT family (BERT base and large, Megatron-LM's BERT 3.9B, and CPU-sized debug models).

Sizes are the published ones: Devlin et al. 2019 (base: 12 layers, 768 wide, 12 heads; large: 24,
1024, 16), 512 positions, two token types, the 30522-token WordPiece vocabulary; Shoeybi et al.
2019, Table 4 (3.9B: 48 layers, 2560 wide, 40 heads, pre-norm blocks). vocab_size is a placeholder
the trainer replaces with the tokenizer's (update_from_config); max_seq_len is the position
table's rows and stays.

This package is the whole family: the registry discovers it, and no generic file names it.
"""

from titanlike.models.bert.hf_adapter import BertHF
from titanlike.models.bert.model import BINARY_LOSS, Bert, BertArgs
from titanlike.models.bert.sharding import bert_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec

BERT_VOCAB = 30522

bert_flavors: dict[str, BertArgs] = {
    # CPU-sized: 8 heads so TP 2, 4 and 8 divide them; 4 layers so PP 2 with two stages per rank
    # still has a layer per stage. vocab 2048 is the debug tokenizer's.
    "debugmodel": BertArgs(dim=256, n_layers=4, n_heads=8, vocab_size=2048, max_seq_len=512),
    # For tests: seconds on a CPU.
    "debugmodel_tiny": BertArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=128),
    "base": BertArgs(dim=768, n_layers=12, n_heads=12, vocab_size=BERT_VOCAB, max_seq_len=512),
    "large": BertArgs(dim=1024, n_layers=24, n_heads=16, vocab_size=BERT_VOCAB, max_seq_len=512),
    "3.9B": BertArgs(dim=2560, n_layers=48, n_heads=40, vocab_size=BERT_VOCAB, max_seq_len=512, pre_norm=True),
}


def bert_objective_options(cfg, args: BertArgs) -> dict:
    """Masked LM; with the binary head, on sentence pairs whose order the head predicts (Megatron's
    BERT; a flavor without it trains on single segments, as --bert-no-binary-head)."""
    return {"sentence_pairs": args.binary_head}


register_model_spec(
    ModelSpec(
        name="bert",
        model_cls=Bert,
        flavors=bert_flavors,
        shard=bert_sharding,
        pipeline_ends=PipelineEnds(
            inputs=("tok_embeddings", "pos_embeddings", "type_embeddings", "embedding_norm"),
            outputs=("norm", "lm_head", "output", "binary_head")),
        hf=BertHF(),
        objective="masked_lm",
        objective_options=bert_objective_options,
    )
)

__all__ = ["BERT_VOCAB", "BINARY_LOSS", "Bert", "BertArgs", "bert_flavors", "bert_sharding"]
