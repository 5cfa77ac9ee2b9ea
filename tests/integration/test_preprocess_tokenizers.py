"""preprocess_data.py with Megatron's tokenizer types (issue 32 item 1): the bytes megatron-core's own
tokenizers and IndexedDatasetBuilder write for the same text and files, refusals in one sentence (exit 2)
for missing files and for Megatron flags not implemented, the flags whose meaning is clear, and the
vocabulary handed to train.py.

Every tokenizer file is made here in a temporary folder: a byte-level BPE trained with `tokenizers`
(GPT-2's vocab.json + merges.txt, and a tokenizer.json folder), a SentencePiece model trained with
`sentencepiece` (skipped where it is not installed), Megatron's TikTokenizer .json made from the
debug tokenizer's ranks. megatron-core 0.16.1 (installed without its dependencies by setup.sh --dev)
is imported for its tokenizers: megatron.core.tokenizers' build_tokenizer, the function Megatron-LM's
tools/preprocess_data.py calls, for every type but GPT2BPETokenizer, which it resolves by downloading
GPT-2's files; that one is compared with megatron-core's HuggingFaceTokenizer on a folder of the same
vocab.json + merges.txt (what it loads once they are downloaded) and with transformers' GPT2Tokenizer.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from titanlike.data import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_PATH
from titanlike.data.indexed import IndexedDataset

from preprocess_checks import SCRIPT, pp  # the script as a module, loaded once a session

REPO = Path(__file__).resolve().parents[2]


# Text that exercises the pre-tokenizers: contractions, digits, whitespace runs, newlines, non-ASCII,
# and special tokens' text (a special token with Megatron's types, as in megatron-core).
EXTRA = ["Héllo wörld, naïve café 😀 don't I'LL 1234567\n\n  tabs\tand   spaces ",
         "a document with <|endoftext|> and </s> and <s> inside",
         "x"]


def _corpus(n: int = 30) -> list[str]:
    texts = []
    with gzip.open(DEFAULT_CORPUS_PATH, "rt") as f:
        for line in f:
            texts.append(json.loads(line)["text"][:1500])
            if len(texts) == n:
                break
    return texts


TEXTS = _corpus() + EXTRA


def write_jsonl(path: Path, texts) -> Path:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny tokenizer files of every kind, trained here."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    # GPT-2's two files
    gpt2 = ByteLevelBPETokenizer()
    gpt2.train_from_iterator(TEXTS, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"],
                             show_progress=False)
    (root / "gpt2").mkdir()
    gpt2.save_model(str(root / "gpt2"))
    out["vocab"], out["merges"] = root / "gpt2" / "vocab.json", root / "gpt2" / "merges.txt"
    # a tokenizer.json folder whose post-processor adds BOS, Llama style
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>", "</s>", "<pad>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    (root / "hf").mkdir()
    tok.save(str(root / "hf" / "tokenizer.json"))
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    out["hf"] = root / "hf"
    # Megatron's TikTokenizer vocabulary, from the debug tokenizer's ranks
    from titanlike.data.tokenizer import load_bpe_ranks

    ranks = sorted(load_bpe_ranks(DEFAULT_TOKENIZER_PATH).items(), key=lambda kv: kv[1])
    (root / "tiktoken.json").write_text(json.dumps(
        [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
         for t, r in ranks]))
    out["tiktoken_json"], out["tiktoken_ranks"] = root / "tiktoken.json", len(ranks)
    # SentencePiece, where the trainer is installed
    try:
        import sentencepiece as spm
    except ImportError:
        out["sp"] = None
    else:
        (root / "sp.txt").write_text("\n".join(t.replace("\n", " ") for t in TEXTS))
        spm.SentencePieceTrainer.train(input=str(root / "sp.txt"), model_prefix=str(root / "sp"), vocab_size=300,
                                       model_type="bpe", minloglevel=2)
        out["sp"] = root / "sp.model"
    return out


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's tokenizer builder (what Megatron-LM's preprocess_data.py calls) and dataset builder."""
    pytest.importorskip("megatron.core", reason="megatron-core is installed by scripts/setup.sh --dev")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
        from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    def build(**kw):
        # megatron-core 0.16.1's tokenizer arguments at their defaults (megatron/training/arguments.py)
        args = dict(tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None, vocab_size=None,
                    tokenizer_special_tokens=None, tokenizer_metadata=None, tiktoken_pattern=None,
                    tiktoken_num_special_tokens=1000, tokenizer_sentencepiece_legacy=False,
                    tokenizer_hf_use_fast=False, tokenizer_hf_include_special_tokens=False, trust_remote_code=False)
        args.update(kw)
        return build_tokenizer(types.SimpleNamespace(**args))

    return types.SimpleNamespace(build=build, HuggingFaceTokenizer=HuggingFaceTokenizer,
                                 IndexedDatasetBuilder=IndexedDatasetBuilder, DType=DType)


def megatron_bytes(megatron, tmp_path: Path, tokenize, eod: int, vocab_size: int, texts) -> tuple[bytes, bytes]:
    """What Megatron's preprocess_data.py writes with --append-eod: its Encoder.encode and IndexedDatasetBuilder."""
    prefix = str(tmp_path / "megatron_text_document")
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=megatron.DType.optimal_dtype(vocab_size))
    for text in texts:
        ids = tokenize(text)
        lens = [len(ids)] if ids else []
        if ids:
            ids = ids + [eod]
            lens[-1] += 1
        builder.add_document(ids, lens)
    builder.finalize(prefix + ".idx")
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


def ours(tmp_path: Path, *flags, texts=TEXTS, name="ours", check=True):
    src = write_jsonl(tmp_path / f"{name}.jsonl", texts)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--input", str(src), "--output-prefix", str(tmp_path / name),
                           "--append-eod", *map(str, flags)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def pair(tmp_path: Path, name: str = "ours") -> tuple[bytes, bytes]:
    prefix = tmp_path / f"{name}_text_document"
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


# ---------------------------------------------------------------- the same bytes as megatron-core


def test_gpt2_bpe_matches_megatron_cores_gpt2_tokenizer(tmp_path, assets, megatron):
    proc = ours(tmp_path, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", assets["vocab"],
                "--merge-file", assets["merges"], "--workers", "2")
    # megatron-core's GPT2BPETokenizer is its HuggingFaceTokenizer on GPT-2's downloaded files: here, on a
    # folder of the same two files (the slow GPT2Tokenizer, megatron-core 0.16.1's use_fast=False).
    folder = tmp_path / "gpt2_files"
    folder.mkdir()
    for name in ("vocab", "merges"):
        (folder / assets[name].name).write_bytes(assets[name].read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    ref = megatron.HuggingFaceTokenizer(str(folder), use_fast=False)
    assert pair(tmp_path) == megatron_bytes(megatron, tmp_path, ref.text_to_ids, ref.eod, ref.vocab_size, TEXTS)
    # transformers' GPT-2 tokenizer on the same files agrees
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    docs = IndexedDataset(str(tmp_path / "ours_text_document"))
    assert [list(docs[i][:-1]) for i in range(len(TEXTS))] == [hf(t).input_ids for t in TEXTS]
    # the vocabulary train.py needs, written beside the data, and the flags that give it to training
    assert (tmp_path / "ours_tokenizer" / "tokenizer.json").is_file()
    assert f"--model.hf_assets_path {tmp_path / 'ours_tokenizer'}" in proc.stderr


@pytest.mark.parametrize("include", [False, True])
def test_hugging_face_folder_matches_megatron_core(tmp_path, assets, megatron, include):
    flags = ["--tokenizer-hf-include-special-tokens"] if include else []
    proc = ours(tmp_path, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", assets["hf"], *flags)
    ref = megatron.build(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(assets["hf"]),
                         tokenizer_hf_include_special_tokens=include)
    assert pair(tmp_path) == megatron_bytes(megatron, tmp_path, ref.tokenize, ref.eod, ref.vocab_size, TEXTS)
    first = IndexedDataset(str(tmp_path / "ours_text_document"))[0]
    assert (first[0] == 0) == include  # <s>, the post-processor's BOS, only when asked for
    assert f"--model.hf_assets_path {assets['hf']}" in proc.stderr


def test_sentencepiece_matches_megatron_core(tmp_path, assets, megatron):
    if assets["sp"] is None:
        pytest.skip("sentencepiece is not installed (pip install sentencepiece)")
    for kind in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        proc = ours(tmp_path, "--tokenizer-type", kind, "--tokenizer-model", assets["sp"], name=kind)
        ref = megatron.build(tokenizer_type=kind, tokenizer_model=str(assets["sp"]))
        assert pair(tmp_path, kind) == megatron_bytes(megatron, tmp_path, ref.tokenize, ref.eod, ref.vocab_size, TEXTS)
        # titanlike cannot train with a .model: said before tokenizing, in one sentence
        note = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
        assert len(note) == 1 and "not a SentencePiece .model" in note[0]
        assert proc.stderr.index("note:") < proc.stderr.index("wrote")


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_megatron_tiktoken_vocabulary_matches_megatron_core(tmp_path, assets, megatron, pattern):
    vocab = assets["tiktoken_ranks"] + 16
    proc = ours(tmp_path, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", assets["tiktoken_json"],
                "--tiktoken-pattern", pattern, "--vocab-size", vocab, "--tiktoken-num-special-tokens", 16)
    ref = megatron.build(tokenizer_type="TikTokenizer", tokenizer_model=str(assets["tiktoken_json"]),
                         tiktoken_pattern=pattern, vocab_size=vocab, tiktoken_num_special_tokens=16)
    assert pair(tmp_path) == megatron_bytes(megatron, tmp_path, ref.tokenize, ref.eod, ref.vocab_size, TEXTS)
    assert "note: titanlike cannot train with Megatron's TikTokenizer vocabulary" in proc.stderr


def test_null_tokenizer_matches_megatron_core(tmp_path, megatron):
    texts = ["1 2 3", "49 0 7 7", "5"]
    proc = ours(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", 50, texts=texts)
    ref = megatron.build(tokenizer_type="NullTokenizer", vocab_size=50)
    assert pair(tmp_path) == megatron_bytes(megatron, tmp_path, ref.tokenize, ref.eod, ref.vocab_size, texts)
    assert "note: titanlike has no NullTokenizer" in proc.stderr
    bad = ours(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", 50, texts=["1 2", "3 x"], name="bad",
               check=False)
    assert bad.returncode == 1 and "line 2, key 'text': NullTokenizer text must be token ids" in bad.stderr


def test_tiktoken_ranks_file_is_titanlikes_tokenizer(tmp_path):
    # A tiktoken ranks file (titanlike's own format) under Megatron's type name: titanlike's ids, trainable
    # with --model.tokenizer_path.
    proc = ours(tmp_path, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", DEFAULT_TOKENIZER_PATH)
    default = ours(tmp_path, name="default")
    assert pair(tmp_path) == pair(tmp_path, "default")
    assert f"--model.tokenizer_path {DEFAULT_TOKENIZER_PATH}" in proc.stderr
    assert "the debug tokenizer is train.py's default" in default.stderr


# ---------------------------------------------------------------- refusals: one sentence, exit 2, nothing written


@pytest.mark.parametrize("flags, fragment", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt"],
     "--vocab-file gpt2-vocab.json does not exist"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json"],
     "GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json) and --merge-file"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Llama-3.1-8B"],
     "looks like a Hugging Face Hub id, and nothing is downloaded here"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "tokenizer.model"],
     "--tokenizer-model tokenizer.model does not exist"),
    (["--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size"),
    (["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "v.txt"], "is not supported here"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "."], "is not a folder holding tokenizer.json"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", ".", "--vocab-size", "9"],
     "--vocab-size is not used with --tokenizer-type HuggingFaceTokenizer here"),
    (["--vocab-size", "9"], "--vocab-size is not used with --tokenizer-type (none: titanlike tokenizer)"),
    (["--find-optimal-num-workers"], "Megatron's --find-optimal-num-workers is not implemented"),
    (["--legacy-tokenizer"], "Megatron's --legacy-tokenizer is not implemented"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "9", "--null-tokenizer-eod-id", "3"],
     "Megatron's --null-tokenizer-eod-id is not implemented"),
    (["--vocab-extra-ids", "100"], "Megatron's --vocab-extra-ids is not implemented"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_refusals_are_one_sentence_and_write_nothing(tmp_path, flags, fragment):
    proc = ours(tmp_path, *flags, check=False)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["ours.jsonl"]


def test_sentencepiece_not_installed_says_how_to_install(tmp_path, monkeypatch, capsys):
    model = tmp_path / "sp.model"
    model.write_bytes(b"\0")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import sentencepiece raises ImportError
    src = write_jsonl(tmp_path / "in.jsonl", ["a b"])
    rc = pp.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                  "SentencePieceTokenizer", "--tokenizer-model", str(model)])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install sentencepiece" in err and err.count("\n") == 1


# ---------------------------------------------------------------- the flags whose meaning is clear


def _documents(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(str(prefix))
    return [list(map(int, ds[i])) for i in range(len(ds))]


def test_partitions_order_documents_as_megatron_and_keep_sequential_keeps_input_order(tmp_path):
    texts = [f"{i} {i}" for i in range(7)]
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    ours(tmp_path, *null, "--partitions", "3", texts=texts, name="rr")
    ours(tmp_path, *null, "--partitions", "3", "--keep-sequential-samples", texts=texts, name="seq")
    # Megatron's partitioned run: line i to partition i mod 3, the partitions' outputs concatenated
    assert [d[0] for d in _documents(tmp_path / "rr_text_document")] == [0, 3, 6, 1, 4, 2, 5]
    assert [d[0] for d in _documents(tmp_path / "seq_text_document")] == list(range(7))
    # --input is a glob with partitions (files in sorted order)
    write_jsonl(tmp_path / "part_b.jsonl", ["5", "6"])
    write_jsonl(tmp_path / "part_a.jsonl", ["1", "2", "3"])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--input", str(tmp_path / "part_*.jsonl"), "--output-prefix",
                           str(tmp_path / "glob"), *null, "--partitions", "2"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [d[0] for d in _documents(tmp_path / "glob_text_document")] == [1, 3, 6, 2, 5]


def test_max_documents_reads_the_first_ones(tmp_path):
    ours(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--max-documents", "2",
         texts=["1", "2", "3", "4"])
    assert _documents(tmp_path / "ours_text_document") == [[1, 10], [2, 10]]


def test_keep_newlines_keeps_the_newlines_after_sentences(tmp_path):
    from titanlike.data import build_tokenizer

    text = "In the beginning.\nAnd the earth. Was void!\n\nNew paragraph here."
    for keep in (False, True):
        name = "keep" if keep else "strip"
        ours(tmp_path, "--split-sentences", "--sentence-splitter", "regex", *(["--keep-newlines"] if keep else []),
             texts=[text], name=name)
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    ds = IndexedDataset(str(tmp_path / "keep_text_sentence"))
    sentences = [tok.decode([t for t in ds[i] if t != tok.eos_id]) for i in range(len(ds))]
    assert sentences == ["In the beginning.\n", "And the earth.", "Was void!\n\n", "New paragraph here."]
    ds = IndexedDataset(str(tmp_path / "strip_text_sentence"))
    assert tok.decode([t for t in ds[1]]) == "And the earth."
    assert all("\n" not in tok.decode(list(ds[i])) for i in range(len(ds)))


def test_lang_other_than_english_needs_nltk(tmp_path, monkeypatch):
    from titanlike.data import sentences

    monkeypatch.setattr(sentences, "_nltk_punkt", lambda *a, **k: None)
    with pytest.raises(ValueError, match="needs NLTK with its punkt data for german"):
        sentences.sentence_splitter("auto", lang="german")


# ---------------------------------------------------------------- train.py trains on what was written


def test_train_py_trains_on_gpt2_bpe_data_with_the_written_vocabulary(tmp_path, assets):
    proc = ours(tmp_path, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", assets["vocab"],
                "--merge-file", assets["merges"], texts=TEXTS * 4)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("train on it: python train.py ... "))
    flags = line.split("python train.py ... ", 1)[1].split()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    train = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--model.flavor", "debugmodel_tiny", "--training.steps", "2",
         "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--job.dump_folder", str(tmp_path / "run"), *flags], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "step:     2/2" in train.stdout + train.stderr
    from titanlike.data.tokenizer_json import HuggingFaceTokenizer

    written = HuggingFaceTokenizer(str(tmp_path / "ours_tokenizer"))
    assert written.vocab_size == 400 and written.eos_id == json.loads(assets["vocab"].read_text())["<|endoftext|>"]
    ids = np.concatenate([d for d in IndexedDataset(str(tmp_path / "ours_text_document"))])
    assert ids.max() < written.vocab_size
