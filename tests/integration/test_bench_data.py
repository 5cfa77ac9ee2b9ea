"""scripts/bench_data.py --compare-megatron: the Megatron-structured pipeline (megatron-core's
IndexedDatasetBuilder) and scripts/preprocess_data.py write the same bytes."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from titanlike.data import DEFAULT_TOKENIZER_PATH

REPO = Path(__file__).resolve().parents[2]


def _load(name):
    # One module object per script for the whole session: pool workers pickle task functions by
    # module name, so a second copy would break other tests' pools (test_preprocess.py loads one too).
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # pool workers find task functions by module name
    spec.loader.exec_module(mod)
    return mod


def _megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


# Megatron's tool stops at a malformed line, so only well-formed ones: plain, pre-split with an
# empty sentence, empty text, non-ASCII, long.
DOCS = [
    {"text": "In the beginning God created the heaven and the earth.", "title": "Genesis 1"},
    {"text": ["First sentence.", "", "Second one."], "title": "pre-split"},
    {"text": "", "title": "empty"},
    {"text": "Caf\u00e9 na\u00efve \u2014 \u00fcber \U0001f600", "title": "unicode"},
    {"text": "And God said, Let there be light: and there was light." * 20, "title": ""},
] * 30


@pytest.mark.parametrize("workers", [1, 2])
def test_megatron_structured_pipeline_writes_our_bytes(tmp_path, workers):
    _megatron_core()
    pp, bench = _load("preprocess_data"), _load("bench_data")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    keys = ["text", "title"]
    with open(os.devnull, "w") as quiet:
        ours = pp.preprocess(str(src), str(tmp_path / "ours"), json_keys=keys, append_eod=True,
                             workers=workers, chunk_lines=16, stream=quiet)
    theirs = bench.megatron_style_preprocess(str(src), str(tmp_path / "meg"),
                                             DEFAULT_TOKENIZER_PATH, workers, json_keys=keys)
    assert ours["documents"] == theirs["documents"] == len(DOCS)
    assert ours["tokens"] == theirs["tokens"] > 0
    for key in keys:
        for ext in (".bin", ".idx"):
            a = Path(ours["outputs"][key] + ext).read_bytes()
            b = Path(theirs["outputs"][key] + ext).read_bytes()
            assert a == b, f"{key}{ext} differs"


def test_bench_compare_megatron_runs(tmp_path):
    _megatron_core()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_data.py"), "--compare-megatron",
         "--preprocess-only", "--copies", "1", "--repeat", "1", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Megatron's pipeline structure with megatron-core's writer and our tokenizer" \
        in proc.stdout
    assert "ours byte-identical to the Megatron-structured pipeline (.bin and .idx): True" \
        in proc.stdout
