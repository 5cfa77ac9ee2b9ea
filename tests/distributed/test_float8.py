"""Float8 training through train.py with torchao's emulated float8 matmuls (CPU, gloo).

Emulation computes exactly what the float8 kernels compute (the same casts, scales and
rounding to e4m3/e5m2), in high precision; only speed and the GPU kernels are not covered.

Tolerances, from measurement on the 8-layer debug model, 64 tokens x 8 samples, 10 steps:
- One process, bf16: float8 moves the loss by at most 5e-3 from the bf16 run without it
  (loss ~7-8). FLOAT8_VS_BF16 = 3e-2 leaves 6x headroom; float8 silently not applied would give
  a difference of exactly 0 at every step, which the lower bound catches.
- FSDP2 and TP2 against one process, both float8, fp32 master weights: losses agree to 5e-5
  relative, grad norms to 8e-4. Not to rounding error as without float8 (test_fsdp_parity.py):
  a float8 cast rounds to 3 mantissa bits, so a last-bit difference in a sum can move a value
  by a whole float8 step, and under FSDP each rank scales its activations by the amax of its
  own 4 samples rather than all 8. RTOL = 3e-4 and GRAD_RTOL = 3e-3 leave ~4-6x headroom.
- FSDP2 with float8 all-gather and precomputed scales against FSDP2 casting after a
  high-precision all-gather: identical to the last printed digit in fp32 (the same weights are
  cast with the same global amax, only elsewhere), so they must agree to EXACT.
- The parity runs take conftest.TINY_JOB's 4 steps, as every other layout parity run (they took 6;
  the tolerances above were measured over 10, where float8's drift is larger).
- MXFP8 (model.converters mx, torchao's emulated path) under FSDP2 against one process: the same
  tolerances, for the same reason (a last-bit difference moves an e4m3 value by a step). Its scales
  are per block of 32 values along the features and, in the weight gradients, along the tokens, whose
  blocks lie within one 64-token sample, so each rank's casts are those of one process.
"""

import pytest

from conftest import train_metrics

pytestmark = pytest.mark.distributed
pytest.importorskip("torchao")

FLOAT8 = ["--model.converters", "float8", "--float8.emulate"]
MX = ["--model.converters", "mx", "--mx.emulate"]
FLOAT8_VS_BF16 = 3e-2
RTOL = 3e-4
GRAD_RTOL = 3e-3
EXACT = 1e-6


def losses(records):
    return [r["loss"] for r in records]


def assert_close_curve(got, ref, rtol, grad_rtol):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=rtol), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=grad_rtol), (g, r)


@pytest.fixture(scope="module")
def float8_fp32_reference(tmp_path_factory):
    """One process, float8 emulated, fp32 master weights and compute around the float8 matmuls."""
    return train_metrics(tmp_path_factory.mktemp("f8"), "one", "--training.local_batch_size", "8", *FLOAT8)


@pytest.fixture(scope="module")
def mx_fp32_reference(tmp_path_factory):
    """One process, MXFP8 emulated, fp32 master weights and compute around the MXFP8 matmuls."""
    return train_metrics(tmp_path_factory.mktemp("mx"), "one", "--training.local_batch_size", "8", *MX)


@pytest.fixture(scope="module")
def fp32_reference_without_float8(tmp_path_factory):
    """The same one-process run with no float8: a layout run must differ from it, or float8 was not applied."""
    return train_metrics(tmp_path_factory.mktemp("fp32"), "one", "--training.local_batch_size", "8")


def assert_float8_applied(got, without_float8):
    # The parity tolerances above are wider than float8's own effect over a few fp32 steps, so a
    # layout run that silently dropped the float8 swap would still pass them; float8's casts move
    # the loss by ~1e-3 relative from the first step, far above fp32 layout noise (~1e-7).
    gaps = [abs(g["loss"] - r["loss"]) / abs(r["loss"]) for g, r in zip(got, without_float8)]
    assert max(gaps) > 1e-5, f"the run equals the one without float8 (gaps {gaps}): was the swap applied?"


BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "8", "--training.steps", "10"]


@pytest.mark.train_run(*BF16, name="bf16")
@pytest.mark.train_run(*BF16, *FLOAT8, name="float8")
def test_emulated_float8_bf16_run_learns_and_stays_close_to_bf16(train_runs):
    plain, float8 = losses(train_runs["bf16"].metrics), losses(train_runs["float8"].metrics)
    assert len(float8) == 10 and float8[-1] < float8[0] - 0.5
    gaps = [abs(a - b) for a, b in zip(float8, plain)]
    assert max(gaps) < FLOAT8_VS_BF16, gaps
    assert max(gaps) > 1e-4, "float8 changed nothing: were the linears swapped?"


FSDP2 = ["--training.local_batch_size", "4", *FLOAT8]


@pytest.mark.train_run(*FSDP2, "--float8.enable_fsdp_float8_all_gather",
                       "--float8.precompute_float8_dynamic_scale_for_fsdp", nproc=2, name="gathered")
@pytest.mark.train_run(*FSDP2, nproc=2, name="plain")
def test_fsdp2_float8_all_gather_with_precomputed_scales(train_runs, float8_fp32_reference,
                                                        fp32_reference_without_float8):
    gathered, plain = train_runs["gathered"].metrics, train_runs["plain"].metrics
    assert_close_curve(gathered, plain, EXACT, EXACT)
    assert_close_curve(gathered, float8_fp32_reference, RTOL, GRAD_RTOL)
    assert_float8_applied(gathered, fp32_reference_without_float8)


@pytest.mark.train_run("--training.local_batch_size", "8", *FLOAT8,
                       "--parallelism.tensor_parallel_degree", "2", nproc=2)
def test_tp2_float8_styles(train_run, float8_fp32_reference, fp32_reference_without_float8):
    # The plan all-gathers activations in float8 (Float8ColwiseParallel, ...); gloo has no
    # float8 dtypes, so the converter sends those bytes as uint8, as NCCL does.
    assert_close_curve(train_run.metrics, float8_fp32_reference, RTOL, GRAD_RTOL)
    assert_float8_applied(train_run.metrics, fp32_reference_without_float8)


@pytest.mark.train_run("--training.local_batch_size", "4", *MX, nproc=2)
def test_fsdp2_mxfp8(train_run, mx_fp32_reference, fp32_reference_without_float8):
    # torchao's MXFP8Linear holds plain parameters: FSDP2 all-gathers them in their own precision and
    # every rank casts the gathered weights to MXFP8 as one process does.
    assert_close_curve(train_run.metrics, mx_fp32_reference, RTOL, GRAD_RTOL)
    assert_float8_applied(train_run.metrics, fp32_reference_without_float8)
