"""Progress bars where a user waits (issue 45, item 11): tokenizing conversations and preference pairs,
reading a checkpoint (training's loads, titanlike-convert), lm-eval's requests. Drawn on rank 0 at a
terminal only: a log file, a pipe and pytest's capture get none."""

from __future__ import annotations

import io
import types

import pytest
import torch

from sft_assets import TAGGED, tokenizer_folder
from titanlike.data import build_tokenizer
from titanlike.data.chat_template import load_chat_template
from titanlike.observe.progress import progress, progress_enabled


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def at_terminal(monkeypatch) -> Terminal:
    """stderr a terminal (what a user at a shell has), rank 0; called in the test's body, since pytest
    sets its own sys.stderr back after the fixtures."""
    stream = Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.delenv("RANK", raising=False)
    return stream


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    tok = build_tokenizer(str(tokenizer_folder(tmp_path_factory.mktemp("tok"), TAGGED["chatml"])))
    return tok, load_chat_template("auto", tok)


def test_no_bar_without_a_terminal_or_off_rank_0(monkeypatch):
    at_terminal(monkeypatch)
    assert progress_enabled()
    monkeypatch.setenv("RANK", "1")
    assert not progress_enabled() and progress(range(3), desc="x").disable
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a file or a pipe
    bar = progress(range(3), desc="x")
    assert bar.disable and list(bar) == [0, 1, 2]
    bar.update(1)  # a no-op, not an error


def test_tokenizing_conversations_and_pairs_shows_a_bar(chatml, monkeypatch):
    from titanlike.data.conversations import tokenize_conversations
    from titanlike.data.preferences import tokenize_pairs

    tok, template = chatml
    terminal = at_terminal(monkeypatch)
    rows = [(f"line {i}", {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})
            for i in range(5)]
    tokenize_conversations(rows, template, tok, seq_len=64)
    assert "sft: tokenizing conversations" in terminal.getvalue() and "/5 " in terminal.getvalue()
    pairs = [(f"line {i}", {"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) for i in range(3)]
    tokenize_pairs(pairs, template, tok, seq_len=64)
    assert "dpo: tokenizing pairs" in terminal.getvalue() and "/3 " in terminal.getvalue()


def test_reading_a_checkpoint_shows_a_bar(tmp_path, monkeypatch):
    from titanlike.checkpoint.format import dcp_load, dcp_save

    terminal = at_terminal(monkeypatch)
    state = {f"w{i}": torch.full((4,), float(i)) for i in range(6)}
    dcp_save(state, str(tmp_path / "step-1"), no_dist=True)
    assert terminal.getvalue() == ""  # saving (training's, in the background) draws none
    loaded = {k: torch.zeros(4) for k in state}
    dcp_load(loaded, str(tmp_path / "step-1"), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert f"loading {tmp_path / 'step-1'}" in terminal.getvalue() and "/6 " in terminal.getvalue()


def test_lm_eval_requests_show_a_bar(monkeypatch):
    harness = pytest.importorskip("titanlike.inference.harness")
    terminal = at_terminal(monkeypatch)
    vocab = 7
    fake = types.SimpleNamespace(batch_size=2, max_length=16,
                                 _logits=lambda rows: torch.log_softmax(torch.zeros(len(rows), 16, vocab), -1))
    requests = [(None, [1, 2], [3]), (None, [1], [2, 3]), (None, [4], [5])]
    scores = harness.TitanlikeLM._loglikelihood_tokens(fake, requests)
    assert len(scores) == 3 and scores[0][0] == pytest.approx(-torch.log(torch.tensor(7.0)).item())
    assert "lm-eval: loglikelihood" in terminal.getvalue() and "/3 " in terminal.getvalue()
    before = terminal.getvalue()
    harness.TitanlikeLM._loglikelihood_tokens(fake, requests, disable_tqdm=True)  # lm-eval's own switch
    assert terminal.getvalue() == before
