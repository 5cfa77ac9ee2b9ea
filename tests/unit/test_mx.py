"""MXFP8 training (titanlike/models/mx.py, `model.converters mx`): which linears and experts the swap
touches, the emulated path against high precision and against torchao's own MXFP8 conversion, a few
training steps through train.py (dense and MoE), a checkpoint that saves and resumes, and every
validation rule. All on CPU with mx.emulate (torchao's emulated path: the same MXFP8 casts, the
matmuls in bf16); the real kernels need a Blackwell GPU. The estimator's probe of an mx job:
tests/unit/test_estimation.py; FSDP2 against one process: tests/distributed/test_float8.py."""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import TINY_JOB, read_metrics, train_in_process
from titanlike.config import ConfigError, load_job_config
from titanlike.models.common import moe
from titanlike.models.converters import build_model_converters
from titanlike.models.mx import MXGroupedMM
from titanlike.models.registry import get_model_spec
from titanlike.train.plan import plan_job

pytest.importorskip("torchao")

REPO = Path(__file__).resolve().parents[2]
MX = ["--model.converters", "mx", "--mx.emulate"]
MOE_JOB = ["--job.config_file", str(REPO / "train_configs" / "qwen3_debug_moe.toml"), "--training.seq_len", "64",
           "--training.local_batch_size", "4", "--training.steps", "4", "--lr_scheduler.warmup_steps", "1",
           "--metrics.log_freq", "1", "--metrics.enable_jsonl", "--metrics.no_enable_tensorboard",
           "--checkpoint.no_enable"]
NO_MX_GPU = not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10)


def mx_converters(*argv: str):
    cfg = load_job_config([*MX, *argv])
    return build_model_converters(cfg.model.converters, cfg)


def model(name: str, flavor: str, *, device: str = "meta") -> nn.Module:
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=64)
    with torch.device(device):
        m = spec.model_cls(args)
    if device != "meta":
        m.init_weights(seed=0)
    return m


def linear_types(m: nn.Module) -> dict[str, str]:
    return {fqn: type(x).__name__ for fqn, x in m.named_modules() if isinstance(x, nn.Linear)}


def experts(m: nn.Module) -> dict[str, moe.GroupedExperts]:
    return {fqn: x for fqn, x in m.named_modules() if isinstance(x, moe.GroupedExperts)}


def torchao_mx(m: nn.Module, kind: type) -> nn.Module:
    """torchao's own MXFP8 training conversion of every `kind` module of m (its weights wrapped in
    MXFP8TrainingWeightWrapperTensor, which sends their linears and grouped GEMMs to MXFP8), emulated."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantize_(m, config, filter_fn=lambda module, fqn: isinstance(module, kind))
    return m


# --- what the swap touches ----------------------------------------------------------------------


def test_mx_swaps_every_block_linear_but_the_output(caplog):
    m = model("llama3", "debugmodel")
    with caplog.at_level(logging.INFO, logger="titanlike"):
        mx_converters().convert(m)
    types_ = linear_types(m)
    assert types_.pop("output") == "Linear"
    assert len(types_) == 8 * 7 and set(types_.values()) == {"MXFP8Linear"}
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("mx")] == [
        "mx (mxfp8_rceil, emulated): converted 56 of 57 linear layers; left in high precision: output (mx.filter_fqns)"]
    # Same parameters under the same names: checkpoints and FSDP see the model before the swap.
    assert {n for n, _ in m.named_parameters()} == {n for n, _ in model("llama3", "debugmodel").named_parameters()}


def test_mx_leaves_linears_not_multiples_of_32_and_linear_subclasses():
    class Sub(nn.Linear):
        pass

    m = nn.ModuleDict({"a": nn.Linear(64, 96), "b": nn.Linear(48, 64), "c": Sub(64, 64), "output": nn.Linear(64, 64)})
    converter = mx_converters().converters[0]
    converter.convert(m)
    assert linear_types(m) == {"a": "MXFP8Linear", "b": "Linear", "c": "Sub", "output": "Linear"}
    assert converter.selection.describe() == ("converted 1 of 3 linear layers; left in high precision: output "
                                              "(mx.filter_fqns), b (features not multiples of 32)")


def test_mx_experts_only_where_grouped_mm_fqns_names_them():
    m = model("qwen3", "debugmodel_moe")
    mx_converters().convert(m)
    assert all(e.grouped_mm is moe.grouped_mm for e in experts(m).values())
    m = model("qwen3", "debugmodel_moe")
    mx_converters("--mx.grouped_mm_fqns", "layers.2").convert(m)
    assert {fqn for fqn, e in experts(m).items() if e.grouped_mm is not moe.grouped_mm} == {"layers.2.moe.experts"}
    m = model("qwen3", "debugmodel_moe")
    mx_converters("--mx.grouped_mm_fqns", "experts").convert(m)
    swapped = experts(m)
    assert len(swapped) == 7 and all(type(e.grouped_mm).__name__ == "MXGroupedMM" for e in swapped.values())
    # The routers stay in high precision (the model marks them), every other block linear is MXFP8.
    types_ = linear_types(m)
    assert {fqn for fqn, t in types_.items() if t == "Linear"} == {"output"} | {
        f"layers.{i}.moe.router.gate" for i in range(1, 8)}


# --- the emulated path ----------------------------------------------------------------------------


def test_mx_linears_equal_torchaos_own_mxfp8_conversion():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    ours = copy.deepcopy(ref)
    mx_converters("--mx.filter_fqns", "").convert(ours)
    theirs = torchao_mx(copy.deepcopy(ref), nn.Linear)
    x = torch.randn(2, 32, 64)
    for m in (ours, theirs):
        m(x).square().mean().backward()
    assert torch.equal(ours(x), theirs(x))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_mx_experts_equal_torchaos_own_mxfp8_grouped_gemm():
    # In bf16, the precision MXFP8 trains in (torchao's grouped GEMM returns bf16 whatever its inputs).
    torch.manual_seed(0)
    ref = moe.GroupedExperts(dim=64, hidden_dim=96, num_experts=4).to(torch.bfloat16)
    for w in ref.parameters():
        nn.init.normal_(w, std=0.05)
    ours = copy.deepcopy(ref)
    ours.use_grouped_mm(MXGroupedMM(mx_converters().converters[0].op_config))
    theirs = torchao_mx(copy.deepcopy(ref), moe.GroupedExperts)
    # Token groups of whole blocks (32 rows): torchao's own path does not pad them, ours does.
    counts = torch.tensor([32, 64, 0, 32])
    x = torch.randn(int(counts.sum()), 64, dtype=torch.bfloat16)
    outs = []
    for m in (ours, theirs):
        xi = x.clone().requires_grad_()
        out = m(xi, counts)
        out.float().square().mean().backward()
        outs.append((out, xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_mx_grouped_gemm_of_float32_experts_is_torchaos_in_float32():
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    torch.manual_seed(0)
    op = mx_converters().converters[0].op_config
    w, x = torch.randn(4, 96, 64) * 0.05, torch.randn(128, 64)
    offsets = torch.tensor([32, 96, 96, 128], dtype=torch.int32)
    ours = MXGroupedMM(op)(x, w, offsets)
    theirs = torch._grouped_mm(x, MXFP8TrainingWeightWrapperTensor(w, op).transpose(-2, -1), offs=offsets)
    assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs.float())


def test_mx_experts_pad_token_groups_that_are_not_whole_blocks():
    # Groups of any size: each is padded to 32 rows inside torchao's grouped GEMM and the padding dropped.
    torch.manual_seed(0)
    ref = moe.GroupedExperts(dim=64, hidden_dim=96, num_experts=3)
    for w in ref.parameters():
        nn.init.normal_(w, std=0.05)
    ours = copy.deepcopy(ref)
    ours.use_grouped_mm(MXGroupedMM(mx_converters().converters[0].op_config))
    counts = torch.tensor([5, 0, 17])
    x = torch.randn(22, 64)
    y_ref, y = ref(x, counts), ours(x, counts)
    assert y.shape == y_ref.shape and 1e-4 < ((y - y_ref).norm() / y_ref.norm()) < 0.1


@pytest.mark.parametrize("name, flavor, grouped", [
    ("llama3", "debugmodel_tiny", []),
    ("qwen3", "debugmodel_moe", ["--mx.grouped_mm_fqns", "experts"]),
    ("gpt_oss", "debugmodel", ["--mx.grouped_mm_fqns", "experts"]),  # linears and experts with biases
])
def test_emulated_mx_model_is_close_to_high_precision_and_not_equal(name, flavor, grouped):
    """The converted debug model's forward and backward against the same model unconverted (fp32).

    Tolerance: e4m3 keeps 3 mantissa bits, so each cast operand is within 2^-4 (6%) of its value, about
    3.6% RMS; a matmul of two cast operands is off by ~5% RMS, and backward chains such matmuls (each
    input gradient is cast again), with the emulated experts also rounding to bf16. Measured: logits
    within 0.3%, gradients of each parameter within 8% (llama3), 10% (gpt-oss) and 20% (qwen3 MoE, whose
    q/k norms sum the errors of every head); bound 1% and 30%."""
    torch.manual_seed(0)
    ref = model(name, flavor, device="cpu")
    ours = copy.deepcopy(ref)
    mx_converters(*grouped).convert(ours)
    tokens = torch.randint(0, 2000, (2, 64))
    logits = []
    for m in (ref, ours):
        out = m(tokens)
        out = out if isinstance(out, torch.Tensor) else out.logits
        out.logsumexp(-1).mean().backward()
        logits.append(out.detach())
    assert (logits[1] - logits[0]).norm() / logits[0].norm() < 0.01
    total = []
    for (fqn, a), b in zip(ref.named_parameters(), ours.parameters()):
        if a.grad is not None and a.grad.norm() > 0:
            assert (b.grad - a.grad).norm() / a.grad.norm() < 0.3, fqn
            total.append((b.grad - a.grad).norm() / a.grad.norm())
    assert max(total) > 1e-3  # the casts did happen


# --- through train.py -----------------------------------------------------------------------------


def losses(dump: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(dump) if "loss" in r]


def test_train_py_mx_lowers_the_loss_dense_and_moe(tmp_path):
    train_in_process([*TINY_JOB, "--training.local_batch_size", "4", "--optimizer.lr", "3e-3",
                      "--job.dump_folder", str(tmp_path / "dense"), *MX])
    train_in_process([*MOE_JOB, "--optimizer.lr", "3e-3", "--job.dump_folder", str(tmp_path / "moe"), *MX,
                      "--mx.grouped_mm_fqns", "experts"])
    for name in ("dense", "moe"):
        loss = losses(tmp_path / name)
        assert len(loss) == 4 and loss[-1] < loss[0] - 0.2, (name, loss)


def test_mx_checkpoint_saves_high_precision_parameters_and_resumes_exactly(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    job = [*TINY_JOB, "--training.local_batch_size", "4", "--model.flavor", "debugmodel_tiny", *MX,
           "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]
    train_in_process([*job, "--job.dump_folder", str(tmp_path / "whole")])
    train_in_process([*job, "--job.dump_folder", str(tmp_path / "cut"), "--training.steps", "2"])
    train_in_process([*job, "--job.dump_folder", str(tmp_path / "cut")])
    assert losses(tmp_path / "cut") [-2:] == losses(tmp_path / "whole")[-2:]
    saved = FileSystemReader(str(tmp_path / "cut" / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    # The model's own names and float32 values: MXFP8 exists only inside the matmuls.
    weights = {k: v.properties.dtype for k, v in saved.items() if k.startswith("model.")}
    assert "model.layers.0.attention.wq.weight" in weights and set(weights.values()) == {torch.float32}


# --- validation ---------------------------------------------------------------------------------------


def refusal(argv: list[str], world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        plan_job(load_job_config(argv), world_size=world)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.skipif(not NO_MX_GPU, reason="the refusal is for machines without a Blackwell GPU")
def test_mx_without_emulate_needs_a_blackwell_gpu():
    assert refusal(["--model.converters", "mx"]).startswith(
        "mx needs a Blackwell GPU (CUDA compute capability 10.x: B200, GB200), but ")
    # torchao's emulated recipe is mx.emulate by another name.
    plan_job(load_job_config(["--model.converters", "mx", "--mx.recipe_name", "mxfp8_emulated_rceil"]), world_size=1)


@pytest.mark.skipif(not NO_MX_GPU, reason="the refusal is for machines without a Blackwell GPU")
def test_train_py_refuses_mx_on_this_machine_in_one_sentence():
    from conftest import train_here

    proc = train_here(["--model.converters", "mx", "--training.steps", "1"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("config error: mx needs a Blackwell GPU") and line.endswith(
        "; set mx.emulate to run its casts with emulated matmuls")


MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]


@pytest.mark.parametrize("argv, world, message", [
    (["--mx.recipe_name", "mxfp8_cublas"], 1,
     "mx.recipe_name must be one of torchao's MXFP8 recipes (mxfp8_rceil, mxfp8_rceil_wgrad_with_hp, "
     "mxfp8_emulated_rceil), got 'mxfp8_cublas'"),
    (["--model.converters", "float8,mx", "--float8.emulate"], 1,
     "model.converters float8 and mx both replace the linear layers; name one of them"),
    (["--model.converters", "mx,te"], 1, "model.converters mx and te both replace the linear layers; name one of them"),
    (["--model.converters", "mx,lora"], 1,
     "model.converters mx with lora is not supported (each swaps the plain linear layers the other would need); "
     "name one of them"),
    (["--parallelism.tensor_parallel_degree", "2"], 2,
     "model.converters mx does not work with tensor parallelism here, so tensor_parallel_degree must be 1"),
    (["--training.seq_len", "48"], 1,
     "mx needs training.seq_len per context-parallel rank to be a multiple of 32 (MXFP8 scales blocks of 32 tokens "
     "in the weight gradients), got 48"),
    (["--mx.grouped_mm_fqns", "experts"], 1, "mx.grouped_mm_fqns experts names no MoE experts of llama3 debugmodel"),
    ([*MOE, "--mx.grouped_mm_fqns", "experts", "--moe.experts_impl", "loop"], 1,
     "mx.grouped_mm_fqns needs moe.experts_impl grouped_mm (the loop of per-expert matmuls stays in high precision)"),
    ([*MOE, "--mx.grouped_mm_fqns", "experts", "--compile.enable", "--training.mixed_precision_param", "float32"], 1,
     "mx.grouped_mm_fqns with compile.enable needs training.mixed_precision_param bfloat16 (compiled experts in "
     "another precision run one matmul per expert, not the MXFP8 grouped GEMM)"),
])
def test_mx_rules(argv, world, message):
    assert refusal([*MX, *argv], world) == message


def test_mx_without_torchao_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    assert refusal(MX) == "model.converters mx needs torchao, which is not installed: pip install torchao"


def test_valid_mx_configs_pass():
    plan_job(load_job_config([*MX, *MOE, "--mx.grouped_mm_fqns", "experts", "--parallelism.expert_parallel_degree",
                              "2"]), world_size=2)
    plan_job(load_job_config([*MX, "--mx.recipe_name", "mxfp8_rceil_wgrad_with_hp",
                              "--parallelism.context_parallel_degree", "2", "--training.seq_len", "128"]), world_size=2)
