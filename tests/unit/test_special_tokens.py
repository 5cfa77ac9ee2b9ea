"""Special tokens of the masked-LM / span-corruption objectives (titanlike.data.special_tokens)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from titanlike.data import DEFAULT_TOKENIZER_PATH, DataError, build_tokenizer
from titanlike.data.special_tokens import ordinary_token_ids, sentinel_ids, special_token_ids


def test_llama3_tiktoken_slots():
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    ids = special_token_ids(tok, ("cls", "sep", "mask", "pad"))
    sp = tok.special_tokens
    assert ids == {"cls": tok.bos_id, "sep": tok.eos_id, "pad": tok.pad_id,
                   "mask": sp["<|reserved_special_token_0|>"]}
    sentinels = sentinel_ids(tok, 244)
    assert sentinels[:2] == [sp["<|reserved_special_token_2|>"], sp["<|reserved_special_token_3|>"]]
    assert len(set(sentinels) | set(ids.values())) == 248  # all distinct
    assert min(sentinels) >= tok.num_bpe_tokens and max(sentinels) < tok.vocab_size
    with pytest.raises(DataError, match="has no sentinel_244 token"):
        sentinel_ids(tok, 245)
    ordinary = ordinary_token_ids(tok)
    assert ordinary.size == tok.num_bpe_tokens and not np.isin(sentinels, ordinary).any()


def _word_level_folder(path, vocab: list[str], config: dict):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=vocab[1])
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens([w for w in vocab if w.startswith(("[", "<"))])
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return build_tokenizer(str(path))


def test_tokenizer_json_bert_and_t5_names(tmp_path):
    bert = _word_level_folder(tmp_path / "bert", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"],
                              {"eos_token": "[SEP]", "bos_token": "[CLS]"})
    assert special_token_ids(bert, ("cls", "sep", "mask", "pad")) == {"cls": 2, "sep": 3, "mask": 4, "pad": 0}
    assert ordinary_token_ids(bert).tolist() == [5, 6]  # special added tokens are never drawn
    with pytest.raises(DataError, match=r"has no sentinel_0 token \(looked for <extra_id_0>"):
        sentinel_ids(bert, 1)
    t5 = _word_level_folder(tmp_path / "t5", ["<pad>", "<unk>", "</s>", "x", "<extra_id_1>", "<extra_id_0>"],
                            {"eos_token": "</s>"})
    assert special_token_ids(t5, ("sep", "pad")) == {"sep": 2, "pad": 0}
    assert sentinel_ids(t5, 2) == [5, 4]
    with pytest.raises(DataError, match=r"has no mask token \(looked for \[MASK\] or <mask>"):
        special_token_ids(t5, ("mask",))
