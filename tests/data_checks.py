"""What tests/unit/test_data.py and tests/integration/test_data_workers.py both use, written once (imported
like tests/family_checks.py): the default loader at a small size, its microbatches, and the check that a
loader resumed mid-stream gives what the uninterrupted one gives."""

from __future__ import annotations

import pickle

import torch

from titanlike.data import build_dataloader

SEQ = 16
G = 8


def take(loader, n):
    """The next n microbatches of token windows, as (inputs, labels) (the loader yields them by name)."""
    it = iter(loader)
    batches = [next(it) for _ in range(n)]
    assert all(set(batch) == {"inputs", "labels"} for batch in batches)
    return [(batch["inputs"], batch["labels"]) for batch in batches]


def default_loader(tok, *, rank=0, dp=1, local=G, seed=0, seq_len=SEQ, num_workers=0):
    return build_dataloader(
        dataset="default", dataset_path=None, tokenizer=tok, seq_len=seq_len, local_batch_size=local,
        global_batch_size=G, dp_rank=rank, dp_degree=dp, seed=seed, num_workers=num_workers,
    )


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def check_resume_mid_stream(make) -> None:
    """A loader from make() stopped mid-step (microbatch 1 of step 2), its state pickled after it moved on,
    then loaded into a fresh one: the next 7 microbatches are the original's, and a fresh loader's."""
    original = make()
    it = iter(original)
    for _ in range(5):  # mid-step: microbatch 1 of step 2
        next(it)
    state = original.state_dict()
    expected = [(batch["inputs"], batch["labels"]) for batch in (next(it) for _ in range(7))]
    # Serialized after the original moved on: the snapshot must not alias live state.
    state = pickle.loads(pickle.dumps(state))

    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 7), expected)
    fresh = take(make(), 12)[5:]
    assert_same_batches(fresh, expected)
