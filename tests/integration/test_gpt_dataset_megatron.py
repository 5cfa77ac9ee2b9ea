"""GPTDataset and BlendedDataset against Megatron-LM itself, in a subprocess (optional: needs megatron-core):
the same .bin/.idx bytes, the same samples, the same document masks. The rest of their semantics:
tests/unit/test_gpt_dataset.py."""

import os

import pytest

# -- against Megatron-LM itself (optional: needs megatron-core) ----------------------------------

MEGATRON_PARITY = r'''
import sys, tempfile, warnings
warnings.filterwarnings("ignore")
import numpy as np, torch, torch.distributed as dist
from megatron.core.datasets import indexed_dataset as mid
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, GPTDataset as MegatronGPT
from titanlike.data.blend import build_megatron_dataset
from titanlike.data.indexed import IndexedDataset, IndexedDatasetWriter

d = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
rng = np.random.default_rng(0)
for name, dtype, vocab in (("a", np.uint16, 2048), ("b", np.int32, 100000)):
    docs = [[rng.integers(0, vocab, rng.integers(1, 80)).tolist()
             for _ in range(1 if i % 7 else 2)] for i in range(600)] + [[]]
    theirs = mid.IndexedDatasetBuilder(f"{d}/m{name}.bin", dtype=dtype)
    with IndexedDatasetWriter(f"{d}/t{name}", dtype) as ours:
        for doc in docs:
            flat = [t for s in doc for t in s]
            theirs.add_document(torch.tensor(flat, dtype=torch.int64), [len(s) for s in doc])
            ours.add_document(np.array(flat, dtype=np.int64), [len(s) for s in doc])
    theirs.finalize(f"{d}/m{name}.idx")
    for ext in ("bin", "idx"):
        assert open(f"{d}/m{name}.{ext}", "rb").read() == open(f"{d}/t{name}.{ext}", "rb").read()
    m, t = mid.IndexedDataset(f"{d}/t{name}"), IndexedDataset(f"{d}/m{name}")
    assert len(m) == len(t) and all(np.array_equal(m[i], t[i]) for i in range(len(t)))

# Megatron loops forever on a split with no tokens (its epoch count never reaches the request):
# 600 documents keep all three splits of "969,30,1" non-empty.
class Tok:
    eod, pad, vocab_size = 0, -1, 100000
    unique_identifiers = {"class": "Tok"}

def theirs(blend, sizes, seq, seed):
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=blend,
                           split="969,30,1", path_to_cache=f"{d}/mcache", tokenizer=Tok(),
                           reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(MegatronGPT, sizes, lambda: True, cfg).build()

def same(m, t):
    assert len(m) == len(t), (len(m), len(t))
    for i in range(0, len(t), max(1, len(t) // 1500)):
        s = m[i]
        window = np.concatenate([s["tokens"].numpy(), s["labels"].numpy()[-1:]])
        assert np.array_equal(window, t[i]), i

cases = [(([f"{d}/ma"], None), f"{d}/ma", 16, 1000, 1234),  # one epoch is enough
         (([f"{d}/ma"], None), f"{d}/ma", 64, 5000, 7),     # several epochs, separate last
         (([f"{d}/ma", f"{d}/mb"], [0.7, 0.3]), f"0.7 {d}/ma 0.3 {d}/mb", 16, 20000, 3)]
for blend, spec, seq, n, seed in cases:
    m = theirs(blend, [n, 20, 5], seq, seed)
    for k, split in enumerate(("train", "valid")):
        t = build_megatron_dataset(spec, seq_len=seq, num_samples=[n, 20][k], seed=seed,
                                   split="969,30,1", split_name=split, cache_dir=f"{d}/tcache")
        same(m[k], t)

# Document masking: our mask, positions and EOD loss masking against Megatron's
# reset_attention_mask / reset_position_ids / eod_mask_loss for the same samples.
from titanlike.models.common.attention import DocumentMask
builder = mid.IndexedDatasetBuilder(f"{d}/mc.bin", dtype=np.uint16)
for i in range(600):  # documents ending in EOD, as preprocess_data.py --append-eod writes them
    doc = rng.integers(1, 2048, rng.integers(1, 40)).tolist() + [Tok.eod]
    builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
builder.finalize(f"{d}/mc.idx")
cfg = GPTDatasetConfig(random_seed=5, sequence_length=64, blend=([f"{d}/mc"], None), split="969,30,1",
                       path_to_cache=f"{d}/mcache", tokenizer=Tok(), reset_position_ids=True,
                       reset_attention_mask=True, eod_mask_loss=True, create_attention_mask=True)
m = BlendedMegatronDatasetBuilder(MegatronGPT, [200, 5, 5], lambda: True, cfg).build()[0]
boundaries = 0
for i in range(0, 200, 7):
    s = m[i]
    mask = DocumentMask.from_tokens(s["tokens"][None], Tok.eod, "sdpa")
    assert torch.equal(mask.positions[0], s["position_ids"]), i
    assert torch.equal(mask.dense[0], ~s["attention_mask"]), i  # Megatron: True = masked out
    assert torch.equal(s["loss_mask"] == 0, s["tokens"] == Tok.eod), i
    boundaries += int((s["tokens"][:-1] == Tok.eod).sum())
assert boundaries > 50, boundaries  # ~3 per sample
print("MEGATRON PARITY OK")
'''


def test_files_and_samples_identical_to_megatron_lm(tmp_path):
    import importlib.util
    import subprocess
    import sys

    extra = os.environ.get("TITANLIKE_MEGATRON_PATH", "")
    path = os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p)
    probe = subprocess.run([sys.executable, "-c", "import megatron.core.datasets.helpers_cpp"],
                           env=dict(os.environ, PYTHONPATH=path), capture_output=True)
    if probe.returncode != 0 and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core not installed (pip install --no-deps megatron-core, or set "
                    "TITANLIKE_MEGATRON_PATH to a directory holding it)")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", MEGATRON_PARITY], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([repo, path])))
    assert proc.returncode == 0 and "MEGATRON PARITY OK" in proc.stdout, proc.stderr[-3000:]
