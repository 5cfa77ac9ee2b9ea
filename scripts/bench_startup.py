"""Start-up cost of tokenizing the embedded corpus, without and with the token cache, in fresh processes.

    python scripts/bench_startup.py [--rounds 3] [--train]

Each round runs, alternately, a fresh process whose cache folder cannot be written (so every start
tokenizes, as before the cache existed; the cache key is still computed) and one whose cache folder
already holds the corpus. Each process times, after its imports, the tokenizer load and the two
in-memory corpora a job can ask for: the packed one (causal LM: the default dataset) and the
sentence-split one (BERT / T5). With --train each round also times a whole
`train.py --training.steps 1` run of the debug job both ways (wall time, start to exit).
Medians are printed with every round's figure and the load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CORPUS_TIMES = """
import json, time
t0 = time.perf_counter()
from titanlike.data import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_PATH, Tokenizer
from titanlike.data.sentence_samples import sentence_split_corpus
from titanlike.data.text_datasets import packed_text_corpus
t1 = time.perf_counter()
tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
t2 = time.perf_counter()
packed_text_corpus(DEFAULT_CORPUS_PATH, tokenizer, 256)
t3 = time.perf_counter()
sentence_split_corpus(DEFAULT_CORPUS_PATH, tokenizer)
t4 = time.perf_counter()
print(json.dumps({"tokenizer": t2 - t1, "packed": t3 - t2, "sentences": t4 - t3}))
"""


def _env(cache_dir: str) -> dict:
    return dict(os.environ, TITANLIKE_CACHE_DIR=cache_dir,
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def corpus_times(cache_dir: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _CORPUS_TIMES], env=_env(cache_dir), cwd=REPO, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_seconds(cache_dir: str, dump: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "train.py"), "--job.config_file",
                    str(REPO / "train_configs" / "debug_model.toml"), "--training.steps", "1",
                    "--job.dump_folder", dump, "--metrics.no_enable_tensorboard"],
                   env=_env(cache_dir), cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - start


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both kinds (default 3)")
    parser.add_argument("--train", action="store_true",
                        help="also time a whole train.py run of one step, without and with the cache")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    uncached = str(scratch / "not-a-folder")
    Path(uncached).write_text("")  # a file where the cache folder would be: no cache can be written
    cached = str(scratch / "cache")
    corpus_times(cached)  # fill the cache
    print(f"load average before: {load()}")
    kinds = {"no cache": uncached, "cache": cached}
    rows: dict[str, dict[str, list[float]]] = {kind: {} for kind in kinds}
    for r in range(args.rounds):
        for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
            for name, seconds in corpus_times(kinds[kind]).items():
                rows[kind].setdefault(name, []).append(seconds)
            if args.train:
                rows[kind].setdefault("train.py, 1 step", []).append(train_seconds(kinds[kind], str(scratch / "run")))
    for kind, times in rows.items():
        for name, samples in times.items():
            print(f"{kind:9s} {name:17s} {1000 * statistics.median(samples):9.0f} ms  "
                  f"(rounds: {', '.join(f'{1000 * s:.0f}' for s in samples)})")
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
