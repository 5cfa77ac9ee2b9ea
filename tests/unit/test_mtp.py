"""Multi-token prediction's generic pieces: the rolled inputs and targets (objectives/causal_lm.py), the way its
loss joins the objective (models/outputs.py attach_loss) and the per-step report."""

import torch

from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX, LossReports, attach_loss
from titanlike.objectives.causal_lm import lookahead_targets

EOD = 0


def test_lookahead_reads_later_tokens_and_ignores_past_the_window():
    stream = torch.arange(1, 12).unsqueeze(0)  # t0..t10, no document boundary
    inputs, labels = stream[:, :-1], stream[:, 1:]
    seq = inputs.shape[1]
    got = lookahead_targets(labels, labels, depth=3)
    assert got.shape == (1, seq, 3, 2)
    for k in (1, 2, 3):
        for i in range(seq):
            # embeds t(i+k), predicts t(i+k+1) (the main labels shifted by k)
            want_in = int(stream[0, i + k]) if i + k <= seq else 0
            want_out = int(stream[0, i + k + 1]) if i + k < seq else IGNORE_INDEX
            assert got[0, i, k - 1, 0] == want_in and got[0, i, k - 1, 1] == want_out, (k, i)


def test_lookahead_never_crosses_a_document_and_keeps_tokens_eod_masking_hides():
    # two documents: [5 6 7 EOD] [8 9 10 11 ...]
    stream = torch.tensor([[5, 6, 7, EOD, 8, 9, 10, 11, 12]])
    inputs, raw = stream[:, :-1], stream[:, 1:]
    masked = raw.masked_fill(inputs == EOD, IGNORE_INDEX)  # eod_mask_loss: no target after an EOD
    docs = DocumentMask.from_tokens(inputs, EOD, None).document_ids
    got = lookahead_targets(raw, masked, depth=2, document_ids=docs)
    targets, embedded = got[0, :, :, 1], got[0, :, :, 0]
    # depth 1 at position 2 (token 7) embeds EOD (t3, same document) and predicts t4 = 8: that is
    # masked in the main labels (after an EOD), so ignored here too
    assert embedded[2, 0] == EOD and targets[2, 0] == IGNORE_INDEX
    # depth 1 at position 3 (EOD, document 0) would embed t4 = 8 of document 1: ignored
    assert targets[3, 0] == IGNORE_INDEX
    # the embedded token the eod mask hid from the labels is still the real one
    assert embedded[3, 0] == 8
    # depth 2 at position 1 embeds t3 = EOD (same document), predicts t4 (masked): ignored;
    # at position 0 predicts t3 = EOD itself: kept
    assert targets[0, 1] == EOD and targets[1, 1] == IGNORE_INDEX
    # inside document 1 everything is kept
    assert targets[4, 0] == 10 and targets[4, 1] == 11
    # without document masking only the window and the label mask count
    plain = lookahead_targets(raw, masked, depth=2)[0, :, :, 1]
    assert plain[1, 1] == IGNORE_INDEX and plain[2, 1] == 9


def test_attached_loss_gets_gradient_one_and_forward_is_unchanged():
    x = torch.randn(3, requires_grad=True)
    aux = (x.detach() * 2).requires_grad_()
    extra = (aux**2).sum()
    y = attach_loss(x * 3, extra)
    assert torch.equal(y, x.detach() * 3)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.full((3,), 3.0))
    assert torch.allclose(aux.grad, 2 * aux.detach())


def test_reported_sums_are_read_once_per_name():
    class Term(torch.nn.Module):
        def __init__(self, name, value):
            super().__init__()
            self.reported_loss = name
            self.register_buffer("reported_loss_sum", torch.tensor(value))

    model = torch.nn.Sequential(Term("mtp_loss", 2.0), Term("mtp_loss", 3.0), Term("other_loss", 1.0))
    reports = LossReports([model], ("other_loss", "mtp_loss"), torch.device("cpu"))
    assert reports.collect().tolist() == [1.0, 5.0]
    assert reports.collect().tolist() == [0.0, 0.0]
