"""The Mamba-2 mixer (models/common/mamba2.py) and its chunked scan (models/common/ssd.py) against a
token-by-token recurrence written here from the equations, on CPU, forward and backward."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F

from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.init import LinearInit
from titanlike.models.common.mamba2 import Mamba2Args, Mamba2Mixer, grouped_rows, scan_implementation
from titanlike.models.common.ssd import carried_output, ssd_recurrent, ssd_scan


def scan_inputs(batch=2, seq=300, heads=6, p=8, groups=3, n=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, p, generator=g, dtype=dtype)
    dt = F.softplus(torch.randn(batch, seq, heads, generator=g, dtype=dtype) - 2)
    A = -(torch.rand(heads, generator=g, dtype=dtype) * 4 + 0.5)
    B = torch.randn(batch, seq, groups, n, generator=g, dtype=dtype)
    C = torch.randn(batch, seq, groups, n, generator=g, dtype=dtype)
    return x, dt, A, B, C


def documents(batch, seq, count, seed=0):
    """Document ids (batch, seq), non-decreasing, several documents per row."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, count, (batch, seq), generator=g).sort(dim=1).values


@pytest.mark.parametrize("chunk", [16, 64, 300])
@pytest.mark.parametrize("with_documents", [False, True])
def test_chunked_scan_equals_the_recurrence_on_a_long_sequence(chunk, with_documents):
    # 300 tokens: chunks of 16 and 64 leave a remainder (padded), 300 is one chunk.
    x, dt, A, B, C = scan_inputs()
    init = torch.randn(2, 6, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    docs = documents(2, 300, 7) if with_documents else None
    want_y, want_state = ssd_recurrent(x, dt, A, B, C, initial_state=init, documents=docs)
    y, state = ssd_scan(*(t.float() for t in (x, dt, A, B, C)), chunk_size=chunk, initial_state=init.float(),
                        documents=docs)
    assert y.dtype == torch.float32
    # fp32 against the fp64 recurrence; outputs are O(10): relative error ~1e-6.
    torch.testing.assert_close(y.double(), want_y, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(state.double(), want_state, rtol=1e-4, atol=2e-5)


def test_chunked_scan_gradients_equal_the_recurrence():
    x, dt, A, B, C = (t.requires_grad_() for t in scan_inputs(seq=70))
    docs = documents(2, 70, 3)
    grad = torch.randn(2, 70, 6, 8, dtype=torch.float64)
    y, state = ssd_recurrent(x, dt, A, B, C, documents=docs)
    (y * grad).sum().add(state.sum()).backward()
    want = [t.grad.clone() for t in (x, dt, A, B, C)]
    for t in (x, dt, A, B, C):
        t.grad = None
    y, state = ssd_scan(x, dt, A, B, C, chunk_size=16, documents=docs)  # fp64 in, fp32 math
    (y * grad.float()).sum().add(state.sum()).backward()
    for name, t, w in zip("x dt A B C".split(), (x, dt, A, B, C), want):
        torch.testing.assert_close(t.grad, w, rtol=1e-4, atol=1e-3, msg=lambda m, name=name: f"grad {name}: {m}")


def test_carried_output_is_what_an_entering_state_adds():
    x, dt, A, B, C = scan_inputs(seq=50)
    init = torch.randn(2, 6, 8, 16, dtype=torch.float64)
    from_zero, _ = ssd_scan(x, dt, A, B, C, chunk_size=16)
    with_state, _ = ssd_scan(x, dt, A, B, C, chunk_size=16, initial_state=init)
    torch.testing.assert_close(from_zero + carried_output(C, dt, A, init), with_state, rtol=1e-5, atol=1e-5)


# The mixer ----------------------------------------------------------------------------------------

ARGS = Mamba2Args(num_heads=4, head_dim=8, state_size=8, n_groups=2, conv_kernel=4, chunk_size=16,
                  dt_limit_min=0.001)
DIM = 24


def mixer(args: Mamba2Args = ARGS, seed: int = 0) -> Mamba2Mixer:
    with torch.device("meta"):
        m = Mamba2Mixer(DIM, args, norm_eps=1e-5)
    m.to_empty(device="cpu")
    m.init_weights(LinearInit(std=0.2, out_std=0.2), seed=seed, prefix="mixer.")
    with torch.no_grad():  # away from init: a norm weight or skip mapped to the wrong head shows
        for p in (m.D, m.norm.weight):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return m


def reference_mixer(m: Mamba2Mixer, u: torch.Tensor) -> torch.Tensor:
    """The mixer token by token from the usual [z, x, B, C, dt] layout (as Hugging Face and
    Megatron keep it): conv as an explicit window, the recurrence one step per token."""
    a = m.args
    h, p, g, n, k = a.num_heads, a.head_dim, a.n_groups, a.state_size, a.conv_kernel
    rows, channels = grouped_rows(a)
    w_in = m.in_proj.weight[rows.argsort()]  # back to [z, x, B, C, dt]
    conv_w, conv_b = m.conv_weight[channels.argsort()], m.conv_bias[channels.argsort()]
    norm_w = m.norm.weight
    z, xbc, dt_raw = (u @ w_in.T).split([h * p, a.conv_dim, h], dim=-1)
    batch, seq, _ = u.shape
    state = torch.zeros(batch, h, p, n)
    A = -torch.exp(m.A_log)
    outs = []
    for t in range(seq):
        window = torch.stack([xbc[:, t - k + 1 + j] if t - k + 1 + j >= 0 else torch.zeros_like(xbc[:, 0])
                              for j in range(k)], dim=-1)  # (batch, channels, K)
        conv = F.silu((window * conv_w).sum(-1) + conv_b)
        x, B, C = conv.split([h * p, g * n, g * n], dim=-1)
        x, B, C = x.view(batch, h, p), B.view(batch, g, n), C.view(batch, g, n)
        dt = F.softplus(dt_raw[:, t] + m.dt_bias).clamp(min=a.dt_limit_min)
        for head in range(h):
            grp = head // (h // g)
            state[:, head] = (torch.exp(dt[:, head] * A[head])[:, None, None] * state[:, head]
                              + dt[:, head, None, None] * x[:, head, :, None] * B[:, grp, None, :])
        y = torch.einsum("bhpn,bhn->bhp", state, C.repeat_interleave(h // g, dim=1)) + m.D[:, None] * x
        y = (y.reshape(batch, -1) * F.silu(z[:, t])).view(batch, g, -1)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).view(batch, -1) * norm_w
        outs.append(y @ m.out_proj.weight.T)
    return torch.stack(outs, dim=1)


def test_mixer_equals_a_token_by_token_reference_and_trains():
    m = mixer()
    u = torch.randn(2, 150, DIM, generator=torch.Generator().manual_seed(3), requires_grad=True)
    out = m(u)
    with torch.no_grad():
        want = reference_mixer(m, u)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    out.pow(2).sum().backward()
    assert u.grad is not None and u.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_mixer_output_does_not_depend_on_the_chunk_size():
    u = torch.randn(2, 100, DIM, generator=torch.Generator().manual_seed(4))
    outs = []
    for chunk in (8, 16, 37, 128):
        m = mixer(Mamba2Args(**{**ARGS.__dict__, "chunk_size": chunk}))
        outs.append(m(u))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_documents_of_a_packed_sequence_are_computed_apart():
    """With a document mask, each document's output equals running it alone (conv and state reset)."""
    m = mixer()
    lengths = [23, 2, 40, 31]  # a 2-token document is shorter than the conv's reach
    u = torch.randn(1, sum(lengths), DIM, generator=torch.Generator().manual_seed(5))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    mask = DocumentMask(document_ids=ids, positions=torch.zeros_like(ids))
    packed = m(u, mask)
    alone = torch.cat([m(part) for part in u.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(m(u), alone, atol=1e-4)  # without the mask the documents leak


def test_in_proj_rows_are_grouped_so_a_column_split_gives_whole_groups():
    a = Mamba2Args(num_heads=6, head_dim=2, state_size=3, n_groups=3)
    rows, channels = grouped_rows(a)
    assert sorted(rows.tolist()) == list(range(a.in_proj_dim))
    assert sorted(channels.tolist()) == list(range(a.conv_dim))
    # The rows of group 1 (a TP rank's share at tp 3): z and x of heads 2-3, B and C of group 1,
    # dt of heads 2-3, in the usual [z, x, B, C, dt] numbering.
    share = rows.view(3, -1)[1].tolist()
    inner, gn = 12, 9
    assert share == ([4, 5, 6, 7] + [inner + 4, inner + 5, inner + 6, inner + 7] + [2 * inner + 3, 2 * inner + 4, 2 * inner + 5]
                     + [2 * inner + gn + 3, 2 * inner + gn + 4, 2 * inner + gn + 5] + [2 * inner + 2 * gn + 2, 2 * inner + 2 * gn + 3])


def test_scan_kernel_choice_falls_back_to_torch_and_says_so(caplog):
    scan_implementation.cache_clear()
    with caplog.at_level(logging.INFO, logger="titanlike.models.common.mamba2"):
        assert scan_implementation("auto", "cpu") == "torch"
        try:
            import mamba_ssm  # noqa: F401
        except ImportError:  # this machine: CUDA or not, without the package the PyTorch scan runs
            assert scan_implementation("auto", "cuda") == "torch"
            assert "mamba_ssm is not installed" in caplog.text
        assert scan_implementation("torch", "cuda") == "torch"
    assert "PyTorch chunked scan" in caplog.text
    scan_implementation.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("mamba_ssm") is None,
                    reason="a GPU check: mamba_ssm's Triton kernels run on CUDA only (docs/performance.md says how "
                           "a lent GPU runs it)")
@pytest.mark.parametrize("with_documents", [False, True])
def test_mamba_ssm_kernels_give_the_pytorch_scan_on_a_gpu(with_documents):
    """The mixer with mamba_ssm's fused chunked scan (`mamba_chunk_scan_combined`, what kernel "auto"
    picks on CUDA) against the same mixer with the PyTorch scan, fp32: outputs, the input's gradient
    and every parameter's, packed documents (its seq_idx) included."""
    args = Mamba2Args(num_heads=4, head_dim=32, state_size=64, n_groups=2, conv_kernel=4, chunk_size=64,
                      dt_limit_min=0.001)
    dim = 128
    with torch.device("meta"):
        m = Mamba2Mixer(dim, args, norm_eps=1e-5)
    m.to_empty(device="cuda")
    m.init_weights(LinearInit(std=0.2, out_std=0.2), seed=0, prefix="mixer.")
    assert m.scan_impl == "mamba_ssm"
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(2, 300, dim, device="cuda", generator=g)
    mask = None
    if with_documents:
        ids = documents(2, 300, 5).cuda()
        mask = DocumentMask(document_ids=ids, positions=torch.zeros_like(ids))
    results = {}
    for impl in ("mamba_ssm", "torch"):
        m.scan_impl = impl
        m.zero_grad(set_to_none=True)
        x = u.clone().requires_grad_()
        out = m(x, mask) if mask is not None else m(x)
        out.pow(2).mean().backward()
        results[impl] = [out.detach(), x.grad] + [p.grad for p in m.parameters()]
    names = ["output", "input grad"] + [name for name, _ in m.named_parameters()]
    for name, fused, ours in zip(names, results["mamba_ssm"], results["torch"]):
        error = ((fused - ours).norm() / ours.norm()).item()
        assert error < 1e-2, (name, error)  # Triton's fp32 dots may round through TF32


def test_bad_mamba_args_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="num_heads .6. must be divisible by n_groups .4."):
        Mamba2Args(num_heads=6, n_groups=4)
    with pytest.raises(ValueError, match="kernel 'triton' is not one of"):
        Mamba2Args(kernel="triton")
