"""What tests/unit/test_preprocess.py and tests/integration/test_preprocess_workers.py both use, written once
(imported like tests/family_checks.py): scripts/preprocess_data.py loaded as a module, a JSONL input with
good and malformed lines, and a stand-in tokenizer."""

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "scripts" / "preprocess_data.py"

# One module object per session (other tests load the script too): the worker pool pickles its
# task function by module name.
pp = sys.modules.get("preprocess_data")
if pp is None:
    _spec = importlib.util.spec_from_file_location("preprocess_data", SCRIPT)
    pp = importlib.util.module_from_spec(_spec)
    sys.modules["preprocess_data"] = pp
    _spec.loader.exec_module(pp)

LINES = [
    {"text": "In the beginning God created the heaven and the earth.", "title": "Genesis 1"},
    "{not json",
    {"title": "no text key"},
    {"text": 42, "title": "a number"},
    {"text": ["First sentence.", "", "Second one."], "title": "pre-split"},
    {"text": "", "title": "empty"},
    [1, 2, 3],
    {"text": "Caf\u00e9 na\u00efve \u2014 \u00fcber \U0001f600", "title": "unicode"},
    {"text": "And God said, Let there be light: and there was light." * 20, "title": "long"},
]
GOOD = [0, 4, 5, 7, 8]


def write_jsonl(path, lines, extra=()):
    raw = [json.dumps(x) if not isinstance(x, str) else x for x in lines] + list(extra)
    data = ("\n".join(raw) + "\n").encode()
    if str(path).endswith(".gz"):
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(data)
    else:
        Path(path).write_bytes(data)
    return path


def run(tmp_path, name="out", workers=1, **kw):
    kw.setdefault("stream", open(os.devnull, "w"))
    src = kw.pop("src", None) or write_jsonl(tmp_path / "in.jsonl", LINES)
    return pp.preprocess(str(src), str(tmp_path / name), workers=workers, **kw)


def read_pair(prefix):
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


class StandIn:
    """Byte-level stand-in tokenizer; `vocab_size` is what picks the token dtype."""

    def __init__(self, path):
        self.vocab_size = 70_000
        self.eos_id = 69_999
        self.bos_id = 69_998

    def encode(self, text, *, bos, eos):
        if "BOOM" in text:
            raise RuntimeError("tokenizer exploded")
        return list(text.encode("utf-8"))
