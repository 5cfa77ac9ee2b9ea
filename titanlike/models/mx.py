"""MXFP8 training through torchao: `model.converters mx`, built from its own [mx] section.

MXFP8 (the OCP microscaling format) casts each block of 32 consecutive values to float8 e4m3 with
one shared power-of-two (e8m0) scale, and Blackwell GPUs (compute capability 10.x: B200, GB200) run
the matmuls of such blocks in their tensor cores. The converter swaps, on the meta model before
parallelize (models/converters.py):

- every plain nn.Linear whose features are multiples of 32 (the block size) and whose name is not in
  `mx.filter_fqns` for torchao's MXFP8Linear: the same parameters, cast to MXFP8 in each of its three
  matmuls (forward, input gradient, weight gradient);
- where `mx.grouped_mm_fqns` names them, the MoE experts' grouped GEMM (GroupedExperts.use_grouped_mm
  in models/common/moe.py) for torchao's MXFP8 grouped GEMM, each expert's token group padded to
  32 rows inside it.

Parameters, gradients, optimizer state and checkpoints stay in high precision; FSDP all-gathers in
the parameters' precision. `mx.emulate` (or the recipe mxfp8_emulated_rceil) runs torchao's emulated
path: the same casts, the matmul done in bf16 on any device, for tests; it is not a performance figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.common.moe import GroupedExperts
from titanlike.models.converters import (
    LinearSelection,
    ModelConverter,
    gpu_description,
    importable,
    fqn_matches,
    linear_filter,
    log_on_rank0,
    quiet_torchao,
    register_converter,
    short_list,
)

BLOCK = 32  # values sharing one scale: MXFP8's block, the multiple every converted dimension needs
EMULATED_RECIPE = "mxfp8_emulated_rceil"


@dataclass
class MXOptions:
    recipe_name: str = opt(
        "mxfp8_rceil", "torchao's MXFP8 training recipe (torchao.prototype.moe_training.config.MXFP8TrainingRecipe): "
        "mxfp8_rceil (scales rounded up, as cuBLAS computes them), mxfp8_rceil_wgrad_with_hp (weight gradients in "
        "high precision) or mxfp8_emulated_rceil (mxfp8_rceil emulated, as mx.emulate)")
    filter_fqns: list[str] = opt(
        ["output"], "linear layers, or modules holding them, left in high precision, matched as whole dot-separated "
        "parts as float8.filter_fqns (the output projection by default); linears whose features are not multiples "
        "of 32 are always left")
    grouped_mm_fqns: list[str] = opt(
        [], "MoE modules whose routed experts' grouped GEMMs run in MXFP8 (torchtitan's quantize.grouped_mm.mx.fqns), "
        "matched as filter_fqns: experts names every MoE layer's; empty: the experts stay in high precision")
    emulate: bool = opt(
        False, "emulate the MXFP8 matmuls (the same casts, the product in bf16) on any device, for tests without a "
               "Blackwell GPU; slow, and no performance figure")


register_section("mx", MXOptions)


def import_moe_training():
    """torchao.prototype.moe_training, imported quietly (converters.quiet_torchao)."""
    with quiet_torchao():
        import torchao.prototype.moe_training.config as config
        import torchao.prototype.moe_training.mxfp8_linear  # noqa: F401
        import torchao.prototype.moe_training.utils  # noqa: F401
    return config


def mx_recipes() -> tuple[str, ...]:
    """The MXFP8 recipe names the installed torchao has."""
    return tuple(r.value for r in import_moe_training().MXFP8TrainingRecipe)


def mx_op_config(o: MXOptions):
    """torchao's MXFP8TrainingOpConfig for [mx]: its recipe, emulated where asked, its grouped GEMMs
    padding every expert's token group to a whole number of blocks."""
    config = import_moe_training()
    op = config.MXFP8TrainingOpConfig.from_recipe(config.MXFP8TrainingRecipe(o.recipe_name))
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    # The recipe mxfp8_emulated_rceil is emulated already; mx.emulate emulates any recipe.
    kernels = KernelPreference.EMULATED if o.emulate else op.kernel_preference
    return dataclasses.replace(op, kernel_preference=kernels, pad_token_groups_for_grouped_mm=True)


def _has_mx_gpu() -> bool:
    """A CUDA GPU with MXFP8 tensor cores torchao's kernels are built for (compute capability 10.x)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


class MXGroupedMM:
    """The experts' grouped GEMM (GroupedExperts.grouped_mm's signature) through torchao's MXFP8 one."""

    def __init__(self, op_config):
        self.op_config = op_config

    def __call__(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

        # torchao returns the recipe's out_dtype (bf16); the experts compute in x's dtype.
        out = _quantize_then_scaled_grouped_mm(x, w.transpose(-2, -1), config=self.op_config, offs=offsets)
        return out.to(x.dtype)


@register_converter
class MXConverter(ModelConverter):
    """nn.Linear -> torchao's MXFP8Linear, and the named experts' grouped GEMMs in MXFP8 ([mx])."""

    name = "mx"
    section = "mx"
    replaces_linears = True
    options: MXOptions

    def __init__(self, options: MXOptions):
        super().__init__(options)
        self.op_config = mx_op_config(options)
        self.selection = LinearSelection(option="mx.filter_fqns", multiple=BLOCK)
        self.experts: list[str] = []

    @classmethod
    def validate(cls, o: MXOptions, *, tp: int) -> None:
        if not importable("torchao"):
            raise ValueError("model.converters mx needs torchao, which is not installed: pip install torchao")
        if o.recipe_name not in mx_recipes():
            raise ValueError(f"mx.recipe_name must be one of torchao's MXFP8 recipes ({', '.join(mx_recipes())}), "
                             f"got {o.recipe_name!r}")
        if not (o.emulate or o.recipe_name == EMULATED_RECIPE or _has_mx_gpu()):
            raise ValueError(f"mx needs a Blackwell GPU (CUDA compute capability 10.x: B200, GB200), but "
                             f"{gpu_description()}; set mx.emulate to run its casts with emulated matmuls")
        if tp != 1:
            # torchao's MXFP8Linear casts whole local tensors; no tensor-parallel styles for it exist here.
            raise ValueError("model.converters mx does not work with tensor parallelism here, so "
                             "tensor_parallel_degree must be 1")

    @classmethod
    def validate_model(cls, o: MXOptions, cfg, spec, args, *, model: str) -> None:
        if "lora" in cfg.model.converters:
            # LoRA adapts plain nn.Linear layers and mx swaps only those: one of them would miss the other.
            raise ValueError("model.converters mx with lora is not supported (each swaps the plain linear layers "
                             "the other would need); name one of them")
        cp = cfg.parallelism.context_parallel_degree
        local_seq = cfg.training.seq_len // max(cp, 1)
        if local_seq % BLOCK:
            # The weight gradient casts along the tokens: each matmul's token count must fill whole blocks.
            raise ValueError(f"mx needs training.seq_len per context-parallel rank to be a multiple of {BLOCK} "
                             f"(MXFP8 scales blocks of {BLOCK} tokens in the weight gradients), got {local_seq}")
        if not o.grouped_mm_fqns:
            return
        if cfg.moe.experts_impl != "grouped_mm":
            raise ValueError("mx.grouped_mm_fqns needs moe.experts_impl grouped_mm (the loop of per-expert matmuls "
                             "stays in high precision)")
        if cfg.compile.enable and cfg.training.mixed_precision_param != "bfloat16":
            # Compiled outside bf16 the experts take their per-expert loop (models/common/moe.py).
            raise ValueError("mx.grouped_mm_fqns with compile.enable needs training.mixed_precision_param bfloat16 "
                             "(compiled experts in another precision run one matmul per expert, not the MXFP8 "
                             "grouped GEMM)")
        moe, etp = args.moe_args(), cfg.parallelism.expert_tensor_parallel_degree
        if etp > 1 and moe is not None and (moe.hidden_dim // etp) % BLOCK:
            raise ValueError(f"mx.grouped_mm_fqns under expert_tensor_parallel_degree {etp} needs each rank's slice of "
                             f"the experts' hidden size ({moe.hidden_dim} / {etp}) to be a multiple of {BLOCK}")
        with torch.device("meta"):
            meta = spec.model_cls(args)
        found = _experts(meta, o.grouped_mm_fqns)
        if not found:
            raise ValueError(f"mx.grouped_mm_fqns {','.join(o.grouped_mm_fqns)} names no MoE experts of {model}")

    def convert(self, model: nn.Module) -> None:
        selection = LinearSelection(option="mx.filter_fqns", multiple=BLOCK)
        keep = linear_filter(self.options.filter_fqns, selection)
        for fqn, module in list(model.named_modules()):
            # Plain linears only: a subclass (LoRA's) computes more than its weight's matmul.
            if type(module) is nn.Linear and keep(module, fqn):
                parent_name, _, attr = fqn.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, self._swap(module))
        experts, misaligned = [], []
        for fqn, module in _experts(model, self.options.grouped_mm_fqns).items():
            _, hidden, dim = module.w1.shape
            if hidden % BLOCK or dim % BLOCK:
                misaligned.append(fqn)
                continue
            module.use_grouped_mm(MXGroupedMM(self.op_config))
            experts.append(fqn)
        self.selection, self.experts = selection, experts
        details = [self.options.recipe_name] + (["emulated"] if self._emulated else [])
        text = f"mx ({', '.join(details)}): {selection.describe()}"
        if experts:
            text += f"; experts' grouped GEMMs in MXFP8: {short_list(experts)}"
        if misaligned:
            text += f"; experts left in high precision: {short_list(misaligned)} (sizes not multiples of {BLOCK})"
        log_on_rank0(text)

    @property
    def _emulated(self) -> bool:
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        return self.op_config.kernel_preference == KernelPreference.EMULATED

    def _swap(self, linear: nn.Linear) -> nn.Module:
        """torchao's MXFP8Linear holding the linear's own parameters (their names, values and device)."""
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

        c = self.op_config
        new = MXFP8Linear(linear.in_features, linear.out_features, bias=False, device="meta",
                          kernel_preference=c.kernel_preference, scale_calculation_mode=c.scale_calculation_mode,
                          wgrad_with_hp=c.wgrad_with_hp)
        new.weight = linear.weight
        new.bias = linear.bias
        return new


def _experts(model: nn.Module, patterns: list[str]) -> dict[str, GroupedExperts]:
    """The routed experts of `model` that `patterns` name (or a module holding them), by name."""
    return {fqn: m for fqn, m in model.named_modules()
            if isinstance(m, GroupedExperts) and any(fqn_matches(fqn, p) for p in patterns)}
