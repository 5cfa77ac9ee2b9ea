"""LoRA: low-rank adapters on a frozen model, as a model converter (`model.converters lora`, [lora]).
Everything LoRA is here: the layer, the converter and its rules, its load hooks, PEFT import and export.

The swap. A targeted nn.Linear becomes a LoRALinear in place (its class changes; `weight` and
`bias` stay the same Parameters under the same names) and gains two parameters, `lora_a` (rank x
in) and `lora_b` (out x rank): y = W x + b + (alpha / rank) B A dropout(x) (alpha / sqrt(rank) with
lora.use_rslora, as PEFT's rank-stabilized LoRA), B initialized to zero so
training starts from the base model, A as PEFT draws it (uniform, bound 1/sqrt(in)). Every other
parameter of the model is frozen (requires_grad False): the optimizer holds state for the adapters
only (train/optimizer.py keeps trainable parameters).

Why a subclass and not a wrapper: the family's tensor-parallel plan names the nn.Linear modules
(attention.wq, ...) and torch's ColwiseParallel / RowwiseParallel accept nn.Linear (subclasses
included). Their partition puts the module's direct parameters on the TP mesh: ColwiseParallel
shards every one of them on dim 0 (W and B by output rows, as the base layer; A by rank, which
DTensor's matmul gathers: r is small), RowwiseParallel shards W by input columns and replicates
what it does not know (A and B). The adapters' forward is plain DTensor arithmetic, so its result
has the base output's placement (Shard(-1) for a column-parallel layer, Partial summed with the
base's for a row-parallel one) and gradients are exact for any layout. FSDP2 then shards the
block as a whole, frozen base and trainable adapters in one unit (it reduces gradients of the
trainable ones only). Nothing generic knows about LoRA: the converter runs on the meta model
before parallelize, like float8.

DoRA (lora.use_dora, as PEFT's use_dora): the layer also learns a magnitude m per output row, its
weight being m (W + s B A) / ||W + s B A|| (row norms, detached as the paper's section 4.3 and PEFT
do), computed in forward as out + (m/n - 1) W x + (m/n) s B A x. The magnitudes start at W's row
norms once the base holds its weights (the converter's initial_state, after the initial load).

The PEFT format. `export_peft` writes adapter_config.json + adapter_model.safetensors with the
names `peft` gives the transformers model of the family (base_model.model.<HF module>.lora_A/B.
weight), the family's HF adapter mapping our names and converting B's rows as it converts the
base weight's (Llama's q/k RoPE row order), and naming modules as the transformers model holds them
(`HFAdapter.module_name`: LLaVA's checkpoint keys are renamed on load); `merged_state_dict` folds the
adapters into the base weights for a full Hugging Face export. `load_peft` reads such a folder back
into the adapters. Modules trained in full beside the adapters (lora.modules_to_save: LLaVA's projector
in its stage 2) are written under their own names and listed as peft's modules_to_save; linears that
peft would adapt by their name but ours did not (lora.exclude_modules: a vision tower's q_proj) are
listed as its exclude_modules, so that peft builds exactly our adapters.

A folder read back (lora.adapter_path, load_peft) is data from anywhere: models/peft_adapter.py checks
its config and tensors; its rank_pattern / alpha_pattern give modules their own rank and alpha (as
peft matches them, and the export writes them back); it must hold exactly the adapters of the job's
targets, checked while planning on the whole model (a pipeline stage reads only its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.load_hooks import LoadHook, register_load_hook
from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.converters import ModelConverter, fqn_matches, log_on_rank0, register_converter, short_list
from titanlike.models.peft_adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    pattern_value,
    read_adapter_config,
    read_adapter_tensors,
)

if TYPE_CHECKING:
    from titanlike.models.registry import ModelSpec

PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAOptions:
    rank: int = opt(8, "rank r of each adapter (PEFT's r)")
    alpha: float = opt(16.0, "scale numerator: the adapter's output is multiplied by alpha / rank (PEFT's lora_alpha)")
    use_rslora: bool = opt(False, "rank-stabilized LoRA (PEFT's use_rslora): the scale is alpha / sqrt(rank)")
    dropout: float = opt(0.0, "dropout on the adapter's input while training (PEFT's lora_dropout)")
    target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        "linear layers that get adapters: Hugging Face module names (q_proj, gate_proj, ...) or ours "
        "(attention.wq, feed_forward.w1, layers.3.attention.wq), matched as whole dot-separated parts; all-linear: "
        "every linear layer but the output head (as PEFT's all-linear)")
    exclude_modules: list[str] = opt(
        [], "linear layers, or modules holding them, that get no adapter even where target_modules names them "
        "(PEFT's exclude_modules), named as target_modules; e.g. vision_tower keeps a vision-language model's "
        "encoder as it is")
    modules_to_save: list[str] = opt(
        [], "modules trained in full beside the adapters and written with them (PEFT's modules_to_save), named "
        "as target_modules; e.g. LLaVA's stage 2 with LoRA trains its projector (projector, or Hugging Face's "
        "multi_modal_projector)")

    use_dora: bool = opt(
        False, "DoRA (PEFT's use_dora): each adapted layer also learns a magnitude per output row, its weight "
        "being magnitude * (W + scale B A) / ||W + scale B A|| (row norms, not differentiated, as PEFT and the paper); "
        "the magnitude starts at W's row norms, after the base's initial load; not with tensor parallelism")
    base_dtype: str = opt(
        "float32", "dtype the frozen base weights are held in: bfloat16 halves their memory (and FSDP's all-gathers) "
        "while the adapters, their gradients and optimizer state stay float32; needs training.mixed_precision_param "
        "bfloat16, the precision the base then computes in", choices=("float32", "bfloat16"))

    adapter_path: str | None = opt(
        None, "a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) whose A and B a fresh "
        "run starts from, after the base model's initial load; its rank, alpha and use_rslora must be lora.rank, "
        "lora.alpha and lora.use_rslora (its rank_pattern and alpha_pattern apply), and its adapters must be those of "
        "the layers lora.target_modules names, no more and no fewer")

    def check(self) -> None:
        if self.adapter_path:
            config = read_adapter_config(self.adapter_path, option="lora.adapter_path")
            if (config.get("r"), config.get("lora_alpha")) != (self.rank, self.alpha):
                raise ValueError(f"lora.adapter_path {self.adapter_path} holds adapters of rank {config.get('r')} and "
                                 f"alpha {config.get('lora_alpha')}, but lora.rank is {self.rank} and lora.alpha "
                                 f"{self.alpha:g}; set them to the adapter's")
            if bool(config.get("use_rslora")) != self.use_rslora:
                raise ValueError(f"lora.adapter_path {self.adapter_path} was trained with use_rslora "
                                 f"{str(bool(config.get('use_rslora'))).lower()} (scale alpha / "
                                 f"{'sqrt(r)' if config.get('use_rslora') else 'r'}), but lora.use_rslora is "
                                 f"{str(self.use_rslora).lower()}; set it to the adapter's")
            if bool(config.get("use_dora")) != self.use_dora:
                kind = "DoRA" if config.get("use_dora") else "plain LoRA"
                raise ValueError(f"lora.adapter_path {self.adapter_path} holds {kind} adapters, but lora.use_dora "
                                 f"is {str(self.use_dora).lower()}; set it to the adapter's")
        if self.rank < 1:
            raise ValueError(f"lora.rank must be at least 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.use_dora and self.dropout:
            raise ValueError("lora.use_dora with lora.dropout is not supported; set lora.dropout 0")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; name the linear layers that get adapters (e.g. q_proj,v_proj)")


register_section("lora", LoRAOptions)


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter (module docstring). Made by `add_adapter` from an
    existing nn.Linear, on any device (meta included)."""

    lora_rank: int
    lora_alpha: float
    lora_rslora: bool
    lora_scaling: float
    lora_dropout: float
    # lora_scale, a persistent scalar buffer holding lora_scaling: a checkpoint's state dict then
    # says how to merge its adapters (load_model, convert_dcp_to_hf) without the job's [lora].

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        a, b = _gradient_like_param(self.lora_a), _gradient_like_param(self.lora_b)
        lora = F.linear(F.linear(h, a), b) * self.lora_scaling
        if not self.lora_dora:
            return out + lora
        # DoRA: m / ||W + s B A|| (row norms, detached) times (W x + s B A x); W x is the base output
        # without its bias (use_dora refuses dropout, so h is x).
        scale = (self.lora_magnitude / dora_row_norms(self.weight, a, b, self.lora_scaling).detach()).to(out.dtype)
        wx = out if self.bias is None else out - self.bias
        return out + (scale - 1) * wx + scale * lora

    def init_adapter(self, *, seed: int, fqn: str) -> None:
        """A as PEFT draws it (kaiming-uniform with a = sqrt(5): bound 1/sqrt(in)), B zero; a function
        of (seed, fqn) only, on whatever shard this rank holds."""
        from titanlike.models.common.init import uniform_, zeros_

        from titanlike.models.common.init import constant_

        bound = 1 / math.sqrt(self.in_features)
        uniform_(self.lora_a, low=-bound, high=bound, seed=seed, fqn=f"{fqn}.lora_a")
        zeros_(self.lora_b)
        constant_(self.lora_scale, self.lora_scaling)
        if self.lora_dora:
            # A placeholder: the magnitude is W's row norms once the base holds its weights (the
            # converter's initial_state, after the initial load, sets it).
            constant_(self.lora_magnitude, 1.0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_rank}, lora_scaling={self.lora_scaling:g}"


def _gradient_like_param(p: torch.Tensor) -> torch.Tensor:
    """`p`, whose gradient comes back with p's own placements. Under tensor parallelism DTensor's
    matmul rules leave an adapter's gradient Partial or sharded differently from the parameter (A
    of a column-parallel layer gets a Partial gradient, B of a row-parallel one too), and the
    optimizer and the gradient norm read the local shard as if it had the parameter's layout: the
    round trip through a local tensor redistributes the gradient (a reduce-scatter or all-reduce of
    rank-sized tensors) in backward, and is free in forward."""
    from torch.distributed.tensor import DTensor  # here, not at the top: ~0.6 s of every start (docs/performance.md)

    if not isinstance(p, DTensor):
        return p
    local = p.to_local(grad_placements=p.placements)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def dora_row_norms(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """||W + scaling B A|| of each output row (DoRA's column norm in the paper's x W convention)."""
    w = weight.to(a.dtype)
    return torch.linalg.vector_norm(w + scaling * (b @ a), dim=1)


def lora_scaling(rank: int, alpha: float, *, rslora: bool = False) -> float:
    """The adapter's scale: alpha / rank, or rank-stabilized LoRA's alpha / sqrt(rank) (as peft)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def add_adapter(linear: nn.Linear, rank: int, alpha: float, dropout: float, *, dora: bool = False,
                rslora: bool = False) -> LoRALinear:
    """`linear`, now a LoRALinear (in place: the same object, parameters and names)."""
    device, dtype = linear.weight.device, linear.weight.dtype
    linear.__class__ = LoRALinear
    scaling = lora_scaling(rank, alpha, rslora=rslora)
    linear.lora_rank, linear.lora_scaling, linear.lora_dropout = rank, scaling, dropout
    linear.lora_alpha, linear.lora_rslora = alpha, rslora
    linear.lora_dora = dora
    linear.lora_a = nn.Parameter(torch.empty(rank, linear.in_features, device=device, dtype=dtype))
    linear.lora_b = nn.Parameter(torch.empty(linear.out_features, rank, device=device, dtype=dtype))
    if dora:
        linear.lora_magnitude = nn.Parameter(torch.empty(linear.out_features, device=device, dtype=dtype))
    linear.register_buffer("lora_scale", torch.full((), scaling, device=device, dtype=torch.float32))
    return linear


# ---------------------------------------------------------------------------------------------
# Which layers: our names or Hugging Face's.


def hf_module_names(model: nn.Module, spec: ModelSpec | None, args) -> dict[str, str]:
    """Our module fqn -> its module's path in the family's transformers model (the family's HF adapter
    renaming its first parameter, then module_name: the names peft sees), for the modules holding
    parameters that have one. Wrapper parts (compile, activation checkpointing) are left out."""
    from titanlike.models.common.init import canonical_fqn

    if spec is None or spec.hf is None:
        return {}
    names = {}
    for fqn, module in model.named_modules():
        name, param = next(iter(module.named_parameters(recurse=False)), (None, None))
        if param is None:
            continue
        fqn = canonical_fqn(fqn)
        try:
            hf = spec.hf.to_hf_state_dict({f"{fqn}.{name}": torch.empty(param.shape, device="meta")}, args)
        except Exception:  # no HF name for it (a tied output head, ...)
            continue
        if len(hf) == 1:
            names[fqn] = spec.hf.module_name(next(iter(hf))).removesuffix(f".{name}")
    return names


def _named(fqn: str, patterns: list[str], hf_names: Mapping[str, str]) -> str | None:
    """The first pattern naming module `fqn` (ours or its HF name, whole dot-separated parts)."""
    return next((p for p in patterns if fqn_matches(fqn, p) or (fqn in hf_names and fqn_matches(hf_names[fqn], p))),
                None)


ALL_LINEAR = "all-linear"


def select_targets(model: nn.Module, patterns: list[str], hf_names: Mapping[str, str], *,
                   exclude: list[str] = (), saved: list[str] = ()) -> dict[str, list[str]]:
    """pattern -> the linear fqns it names (ours or their HF names, whole dot-separated parts), less
    those `exclude` or `saved` (modules trained in full, as peft never adapts them) name. ALL_LINEAR
    names every linear but the output head, as peft's all-linear leaves out the transformers model's
    output embeddings (its lm_head; without HF names, a linear with vocab_size outputs).

    A mixture of experts' router gate is never a target: the router reads its weight in fp32 rather
    than calling the linear (models/common/moe.py), and transformers' routers are no nn.Linear, so
    peft adapts none either. Experts (stacked tensors) and attention sinks are no linear at all."""
    from titanlike.models.common.moe import Router

    found: dict[str, list[str]] = {p: [] for p in patterns}
    vocab = getattr(getattr(model, "model_args", None), "vocab_size", None)
    routers = {f"{fqn}.{name}" if fqn else name for fqn, module in model.named_modules() if isinstance(module, Router)
               for name, _ in module.named_children()}
    for fqn, module in model.named_modules():
        if (type(module) is not nn.Linear or fqn in routers
                or _named(fqn, [*exclude, *saved], hf_names) is not None):
            continue
        head = hf_names[fqn].rsplit(".", 1)[-1] == "lm_head" if fqn in hf_names else module.out_features == vocab
        for pattern in patterns:
            if (not head) if pattern == ALL_LINEAR else _named(fqn, [pattern], hf_names) is not None:
                found[pattern].append(fqn)
    return found


def saved_parameters(model: nn.Module, options: LoRAOptions, hf_names: Mapping[str, str]) -> set[str]:
    """The parameters (names without wrapper parts) of the modules lora.modules_to_save names."""
    from titanlike.models.common.init import canonical_fqn

    if not options.modules_to_save:
        return set()
    found = set()
    for fqn, module in model.named_modules():
        fqn = canonical_fqn(fqn)
        if _named(fqn, options.modules_to_save, hf_names) is not None:
            found.update(f"{fqn}.{name}" for name, _ in module.named_parameters(recurse=False))
    return found


def check_saved(model: nn.Module, options: LoRAOptions, hf_names: Mapping[str, str], *, name: str) -> None:
    """ValueError (one sentence) for a lora.modules_to_save entry that names no module with parameters."""
    held = {_named(f, options.modules_to_save, hf_names) for f, m in model.named_modules()
            if next(m.parameters(recurse=False), None) is not None}
    missing = [p for p in options.modules_to_save if p not in held]
    if missing:
        raise ValueError(f"lora.modules_to_save {', '.join(missing)} names no module of {name}; name ours "
                         "(projector, layers.0.attention_norm) or Hugging Face's (multi_modal_projector)")


def check_targets(found: dict[str, list[str]], *, model: str) -> None:
    empty = [p for p, fqns in found.items() if not fqns]
    if empty:
        raise ValueError(f"lora.target_modules {', '.join(empty)} matches no linear layer of {model}; name Hugging "
                         "Face modules (q_proj, v_proj, gate_proj, ...) or ours (attention.wq, feed_forward.w1)")


def spec_of(model: nn.Module) -> ModelSpec | None:
    from titanlike.models.registry import get_model_spec, model_names

    return next((get_model_spec(n) for n in model_names() if isinstance(model, get_model_spec(n).model_cls)), None)


def apply_lora(model: nn.Module, options: LoRAOptions, *, spec: ModelSpec | None = None) -> list[str]:
    """Adapters on the targeted linears of `model`, every other parameter frozen; returns their fqns.
    ValueError (one sentence) for a target that names nothing."""
    spec = spec or spec_of(model)
    args = getattr(model, "model_args", None)
    hf_names = hf_module_names(model, spec, args)
    found = select_targets(model, options.target_modules, hf_names, exclude=options.exclude_modules,
                           saved=options.modules_to_save)
    check_targets(found, model=type(model).__name__)
    targets = sorted({fqn for fqns in found.values() for fqn in fqns})
    shape = adapter_shapes(options)
    for fqn in targets:
        rank, alpha = shape(hf_names.get(fqn, fqn))
        add_adapter(model.get_submodule(fqn), rank, alpha, options.dropout, dora=options.use_dora,
                    rslora=options.use_rslora)
    freeze_base(model, keep=saved_parameters(model, options, hf_names))
    if options.base_dtype != "float32":
        hold_base_in(model, getattr(torch, options.base_dtype))
    return targets


def adapter_shapes(options: LoRAOptions, config: dict | None = None):
    """name -> (rank, alpha) of the adapter of the module of that name in the transformers model:
    lora.rank and lora.alpha, or what the rank_pattern and alpha_pattern of lora.adapter_path (its
    `config`, read if not given) give it, as peft does."""
    if not options.adapter_path:
        return lambda name: (options.rank, options.alpha)
    config = config or read_adapter_config(options.adapter_path, option="lora.adapter_path")
    where = os.path.join(options.adapter_path, ADAPTER_CONFIG)
    return lambda name: (
        pattern_value(config.get("rank_pattern"), name, options.rank, path=where, field="rank_pattern"),
        pattern_value(config.get("alpha_pattern"), name, options.alpha, path=where, field="alpha_pattern"))


def hold_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Every frozen parameter of `model` (meta or not) becomes `dtype`, under the same name and
    requires_grad False; the adapters keep theirs. Buffers (RoPE tables, LoRA's scale) are left as
    they are: the model computes them in their own precision."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and p.dtype != dtype and p.is_floating_point():
                module._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=False)


def freeze_base(model: nn.Module, keep: set[str] = frozenset()) -> None:
    """Only the adapters train, and the parameters in `keep` (lora.modules_to_save's, names without
    wrapper parts). Applied at the swap, and again after parallelization: a tensor-parallel style may
    register a parameter anew as trainable (torch's SequenceParallel does)."""
    from titanlike.models.common.init import canonical_fqn

    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(_TRAINED) or canonical_fqn(name) in keep)


_TRAINED = (".lora_a", ".lora_b", ".lora_magnitude")


def dora_magnitudes(model: nn.Module) -> dict[str, torch.Tensor]:
    """{fqn.lora_magnitude: W's row norms (full, float32)} of every DoRA adapter of `model` (a model part,
    sharded or not: a sharded weight is gathered one layer at a time, on every rank alike)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for fqn, module in adapters(model).items():
        if module.lora_dora:
            w = module.weight.full_tensor() if isinstance(module.weight, DTensor) else module.weight
            out[f"{fqn}.lora_magnitude"] = torch.linalg.vector_norm(w.detach().float(), dim=1)
    return out


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, LoRALinear)}


# ---------------------------------------------------------------------------------------------
# State dicts: merged weights, PEFT folders.


def _module_of(key: str, suffix: str) -> str | None:
    return key[: -len(suffix)] if key.endswith(suffix) else None


_ADAPTER_KEYS = (".lora_a", ".lora_b", ".lora_scale", ".lora_magnitude")


def is_adapter_key(key: str) -> bool:
    """A state-dict entry of an adapter (A, B, scale, DoRA magnitude)."""
    return key.endswith(_ADAPTER_KEYS)


def has_adapters(sd: Mapping[str, torch.Tensor]) -> bool:
    return any(map(is_adapter_key, sd))


def split_state_dict(sd: Mapping[str, torch.Tensor]) -> tuple[dict, dict[str, tuple]]:
    """(the base state dict, {module fqn: (A, B, scaling, DoRA magnitude or None)}) of a full state dict
    holding adapters."""
    base, parts = {}, {}
    for key, value in sd.items():
        for i, suffix in enumerate(_ADAPTER_KEYS):
            module = _module_of(key, suffix)
            if module is not None:
                parts.setdefault(module, [None, None, None, None])[i] = value
                break
        else:
            base[key] = value
    out = {}
    for module, (a, b, scale, magnitude) in parts.items():
        if a is None or b is None or scale is None:
            raise ValueError(f"the state dict holds part of the adapter of {module} (lora_a, lora_b, lora_scale)")
        out[module] = (a, b, float(scale), magnitude)
    return base, out


def merged_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base state dict with every adapter folded in: W + scaling B A, or DoRA's
    m (W + scaling B A) / ||W + scaling B A|| (full tensors)."""
    base, parts = split_state_dict(sd)
    for module, (a, b, scaling, magnitude) in parts.items():
        w = base[f"{module}.weight"]
        merged = w.float() + scaling * (b.float() @ a.float())
        if magnitude is not None:
            merged = merged * (magnitude.float() / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1)
        base[f"{module}.weight"] = merged.to(w.dtype)
    return base


def _hf_rows(spec: ModelSpec, args, fqn: str, rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[(HF module name, its part of `rows` (out x anything) in HF's row order)]: the family's conversion
    of the base weight applied to the adapter's B. One module, or several where transformers keeps apart
    what one of our linears computes (Qwen3.5's in_proj_qkv and in_proj_z for our in_proj_qkvz): each
    then gets the same A and its rows of B, which computes exactly the same."""
    return [(spec.hf.module_name(key).removesuffix(".weight"), value)
            for key, value in spec.hf.to_hf_state_dict({f"{fqn}.weight": rows}, args).items()]


def _hf_tensor(spec: ModelSpec, args, name: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(the parameter's path in the family's transformers model, as peft names it; `value` as HF holds it)."""
    (key, value), = spec.hf.to_hf_state_dict({name: value}, args).items()
    return spec.hf.module_name(key), value


def _hf_name(spec: ModelSpec, args, key: str, shape) -> str | None:
    """The path peft gives our parameter `key` in the family's transformers model; None for one that is
    not a tensor of its own there (a tied output head; a tensor the conversion writes others beside)."""
    try:
        hf = spec.hf.to_hf_state_dict({key: torch.empty(shape, device="meta")}, args)
    except Exception:
        return None
    return spec.hf.module_name(next(iter(hf))) if len(hf) == 1 else None


def _saved_in_hf(spec: ModelSpec, args, base: Mapping[str, torch.Tensor],
                 options: LoRAOptions) -> dict[str, tuple[str, torch.Tensor]]:
    """{our name: (HF parameter path, HF value)} of the parameters lora.modules_to_save names."""
    out = {}
    for key, value in base.items():
        module, hf_name = key.rpartition(".")[0], _hf_name(spec, args, key, value.shape)
        hf_module = {module: hf_name.rpartition(".")[0]} if hf_name else {}
        if _named(module, options.modules_to_save, hf_module) is not None:
            out[key] = _hf_tensor(spec, args, key, value)
    return out


def export_peft(sd: Mapping[str, torch.Tensor], spec: ModelSpec, args, folder: str, options: LoRAOptions, *,
                base_model: str | None = None) -> list[str]:
    """Write `folder` as a PEFT LoRA adapter of the family's transformers model: adapter_config.json
    and adapter_model.safetensors. Returns the HF module names written. ValueError when the family's
    HF conversion of a targeted weight is not a reordering of its rows (B's rows then cannot follow).

    base_model: the Hugging Face folder of the base model, written as base_model_name_or_path so that
    peft's AutoPeftModelForCausalLM.from_pretrained(folder) finds it without the Hub. The path is
    absolute: peft hands it to transformers as it is, which resolves a relative path against the
    working directory, not against the adapter folder."""
    from safetensors.torch import save_file

    base, parts = split_state_dict(sd)
    tensors, modules = {}, set()
    rank_pattern, alpha_pattern = {}, {}
    for fqn, (a, b, scaling, magnitude) in sorted(parts.items()):
        # The conversion must act on rows only (reorder them, or split them among modules): then
        # conv(B A) = conv(B) A.
        deltas = dict(_hf_rows(spec, args, fqn, b.float() @ a.float()))
        magnitudes = dict(_hf_rows(spec, args, fqn, magnitude.float().view(-1, 1))) if magnitude is not None else {}
        for name, b_hf in _hf_rows(spec, args, fqn, b.float()):
            # A module whose rank or alpha is not [lora]'s (an adapter read with its rank_pattern /
            # alpha_pattern) is named in the same patterns, by its whole name.
            rank = a.shape[0]
            alpha = scaling * (math.sqrt(rank) if options.use_rslora else rank)
            if rank != options.rank:
                rank_pattern[re.escape(name)] = rank
            if not math.isclose(alpha, options.alpha, rel_tol=1e-6):
                alpha_pattern[re.escape(name)] = float(f"{alpha:.6g}")
            if name not in deltas or not torch.allclose(deltas[name], b_hf @ a.float(), atol=1e-6, rtol=1e-5):
                raise ValueError(f"{spec.name}'s Hugging Face conversion of {fqn}.weight is not a row reordering, so "
                                 "its adapter cannot be written in the PEFT format; export the merged model instead")
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.float().clone()  # safetensors refuses shared storage
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b_hf.contiguous()
            if magnitude is not None:
                tensors[f"{PEFT_PREFIX}{name}.lora_magnitude_vector"] = magnitudes[name].view(-1).contiguous()
            modules.add(name.rsplit(".", 1)[-1])
    # Modules trained in full: their weights under their own names (peft restores them as it loads).
    saved = _saved_in_hf(spec, args, base, options)
    for hf_name, value in saved.values():
        tensors[f"{PEFT_PREFIX}{hf_name}"] = value.contiguous()
    saved_modules = sorted({hf_name.rpartition(".")[0] for hf_name, _ in saved.values()})
    # peft adapts every linear whose name ends in a target: name the ones ours left alone (exclude_modules).
    adapted = {name for fqn, (_, b, _, _) in parts.items()
               for name, _ in _hf_rows(spec, args, fqn, torch.empty(b.shape[0], 1, device="meta"))}
    excluded = []
    for key, value in base.items():
        if not key.endswith(".weight") or value.dim() != 2 or key in saved:
            continue
        name = (_hf_name(spec, args, key, value.shape) or "").removesuffix(".weight")
        if name and name.rsplit(".", 1)[-1] in modules and name not in adapted:
            excluded.append(name)
    excluded.sort()
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": options.rank, "lora_alpha": options.alpha,
        "lora_dropout": options.dropout, "target_modules": sorted(modules), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": options.use_rslora, "use_dora": options.use_dora,
        "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": saved_modules or None, "exclude_modules": excluded or None,
        "base_model_name_or_path": os.path.abspath(base_model) if base_model else None,
        "revision": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return sorted(modules)


def peft_state_dict(model: nn.Module, folder: str, *, spec: ModelSpec | None = None,
                    options: LoRAOptions | None = None) -> dict[str, torch.Tensor]:
    """See _read_peft; the state dict only (a pipeline stage reads the tensors of its own layers)."""
    return _read_peft(model, folder, spec=spec, options=options)[0]


def _read_peft(model: nn.Module, folder: str, *, spec: ModelSpec | None = None,
               options: LoRAOptions | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A PEFT adapter folder's A and B under our names ({fqn.lora_a, fqn.lora_b}: full tensors, our row
    order) for the adapters `model` (a whole model or a pipeline stage, sharded or not) holds, and the
    weights of the modules options.modules_to_save trains in full. ValueError (one sentence) for a
    folder of another rank, scale or set of modules, or holding a tensor that is not floating point
    and finite (peft_adapter.py: the folder is data, checked before it is used)."""
    spec = spec or spec_of(model)
    args = model.model_args
    config = read_adapter_config(folder)
    path = os.path.join(folder, ADAPTER_CONFIG)
    tensors = _Reads(read_adapter_tensors(folder))
    ours = adapters(model)
    if not ours:
        raise ValueError("the model has no LoRA adapters to load into (model.converters lora)")
    some = next(iter(ours.values()))
    if bool(config.get("use_dora")) != some.lora_dora:
        raise ValueError(f"{path} is {'a DoRA' if config.get('use_dora') else 'a plain LoRA'} adapter; this job's "
                         f"are {'DoRA' if some.lora_dora else 'plain LoRA'} (lora.use_dora)")
    rslora = bool(config.get("use_rslora"))
    shape = adapter_shapes(LoRAOptions(rank=config["r"], alpha=config["lora_alpha"], adapter_path=folder), config)
    sd = {}
    for fqn, module in ours.items():
        index = torch.arange(module.out_features, dtype=torch.float32).view(-1, 1)
        pieces = _hf_rows(spec, args, fqn, index)
        names = " and ".join(name for name, _ in pieces)
        for name, _ in pieces:
            rank, alpha = shape(name)
            if rank != module.lora_rank or not math.isclose(lora_scaling(rank, alpha, rslora=rslora),
                                                            module.lora_scaling, rel_tol=1e-6):
                patterned = "" if (rank, alpha) == (config["r"], config["lora_alpha"]) else f" for {name}"
                raise ValueError(f"{path} is an adapter of rank {rank} and alpha {alpha:g}"
                                 f"{' (rslora)' if rslora else ''}{patterned}; this job's adapters have rank "
                                 f"{module.lora_rank} and alpha {module.lora_alpha:g}"
                                 f"{' (rslora)' if module.lora_rslora else ''} "
                                 "(lora.rank, lora.alpha, lora.use_rslora)")
        got = [tuple(tensors.get(f"{PEFT_PREFIX}{name}.lora_{x}.weight") for x in "AB") for name, _ in pieces]
        missing = [name for (name, _), (a, b) in zip(pieces, got) if a is None or b is None]
        if missing:
            raise ValueError(f"{folder} has no adapter for {missing[0]} ({fqn}): it was trained for other modules or "
                             "another base model (lora.target_modules)")
        a, b = got[0][0], torch.cat([b for _, b in got])
        if tuple(a.shape) != tuple(module.lora_a.shape) or tuple(b.shape) != tuple(module.lora_b.shape):
            raise ValueError(f"{folder}: the adapter of {names} has shapes {tuple(a.shape)} and {tuple(b.shape)}, "
                             f"this model's {tuple(module.lora_a.shape)} and {tuple(module.lora_b.shape)} "
                             "(another base model?)")
        if any(not torch.equal(other, a) for other, _ in got[1:]):
            raise ValueError(f"{folder} holds different lora_A matrices for {names}, which this model computes as one "
                             f"projection ({fqn}) with one adapter; merge the adapter into the base model instead")
        back = torch.argsort(torch.cat([order for _, order in pieces]).view(-1).long())
        sd[f"{fqn}.lora_a"] = a.to(module.lora_a.dtype)
        sd[f"{fqn}.lora_b"] = b[back].to(module.lora_b.dtype)
        if module.lora_dora:
            ms = [tensors.get(f"{PEFT_PREFIX}{name}.lora_magnitude_vector") for name, _ in pieces]
            m = None if any(x is None for x in ms) else torch.cat(ms)
            if m is None or tuple(m.shape) != (module.out_features,):
                raise ValueError(f"{folder}: the DoRA adapter of {names} has no magnitude of "
                                 f"{module.out_features} rows")
            sd[f"{fqn}.lora_magnitude"] = m[back].to(module.lora_magnitude.dtype)
    sd.update(_saved_from_peft(model, folder, tensors, config, spec, options))
    return sd, sorted(set(tensors) - tensors.read)


class _Reads(dict):
    """A dict that remembers which keys were asked for: the adapter's tensors no module read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def _saved_from_peft(model: nn.Module, folder: str, tensors: Mapping[str, torch.Tensor], config: dict, spec: ModelSpec,
                     options: LoRAOptions | None) -> dict[str, torch.Tensor]:
    """{our parameter name: full tensor} of the modules trained in full, read from a PEFT folder."""
    from titanlike.models.common.init import canonical_fqn

    wanted = options is not None and bool(options.modules_to_save)
    if not wanted:
        if config.get("modules_to_save"):
            raise ValueError(f"{folder} also holds modules trained in full ({', '.join(config['modules_to_save'])}); "
                             "name them in lora.modules_to_save to load them")
        return {}
    args = model.model_args
    params = {canonical_fqn(name): (name, p) for name, p in model.named_parameters()}
    out = {}
    for name in sorted(saved_parameters(model, options, hf_module_names(model, spec, args))):
        raw, param = params[name]
        (key, _), = spec.hf.to_hf_state_dict({name: torch.empty(param.shape, device="meta")}, args).items()
        path = spec.hf.module_name(key)
        value = tensors.get(f"{PEFT_PREFIX}{path}")
        if value is None or tuple(value.shape) != tuple(param.shape):
            found = "nothing" if value is None else f"a tensor of shape {tuple(value.shape)}"
            raise ValueError(f"{folder} holds {found} for {path} ({name}, of shape "
                             f"{tuple(param.shape)}), which lora.modules_to_save trains in full")
        out[raw] = spec.hf.from_hf_state_dict({key: value}, args)[name].to(param.dtype)
    return out


def load_peft(model: nn.Module, folder: str, *, spec: ModelSpec | None = None) -> None:
    """Copy a PEFT adapter folder's A and B into `model`'s adapters (one process, unsharded)."""
    sd = read_whole_peft(model, folder, spec=spec)
    model.load_state_dict(sd, strict=False)


def read_whole_peft(model: nn.Module, folder: str, *, spec: ModelSpec | None = None,
                    options: LoRAOptions | None = None) -> dict[str, torch.Tensor]:
    """peft_state_dict for a whole model (not a pipeline stage), which must read every tensor of the
    folder: ValueError (one sentence) for an adapter of modules this job does not adapt, or a tensor
    no adapter has. The job does not take its targets from the adapter: an adapter it would load only
    in part is refused rather than changed silently."""
    sd, unused = _read_peft(model, folder, spec=spec, options=options)
    extra = [k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") for k in unused if k.endswith(".lora_A.weight")]
    if extra:
        held = sum(k.endswith(".lora_A.weight") for k in safetensors_keys(folder))
        raise ValueError(f"{folder} holds adapters of {len(extra)} modules this job does not adapt (e.g. {extra[0]}): "
                         f"it adapts {held} modules, this job {len(adapters(model))}; name them in lora.target_modules "
                         "(all-linear names every linear layer) or use an adapter of this job's modules")
    if unused:
        raise ValueError(f"{folder}/{ADAPTER_WEIGHTS} holds {unused[0]}, which is no tensor of this job's adapters "
                         f"(nor of lora.modules_to_save){f' ({len(unused)} such tensors)' if len(unused) > 1 else ''}")
    return sd


def safetensors_keys(folder: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, ADAPTER_WEIGHTS), framework="pt") as f:
        return list(f.keys())


# ---------------------------------------------------------------------------------------------
# The converter, its rules and its load hooks.


@register_converter
class LoRAConverter(ModelConverter):
    """Low-rank adapters on the linears lora.target_modules names, the rest frozen ([lora])."""

    name = "lora"
    section = "lora"
    options: LoRAOptions

    @classmethod
    def validate_unnamed(cls, options: LoRAOptions) -> None:
        default = LoRAOptions()
        for field in dataclasses.fields(options):
            if getattr(options, field.name) != getattr(default, field.name):
                raise ValueError(f"lora.{field.name} is set, but model.converters does not name lora; add it "
                                 f"(--model.converters lora) or remove lora.{field.name}")

    @classmethod
    def validate_model(cls, options: LoRAOptions, cfg, spec, args, *, model: str) -> None:
        """Its targets must name linears of the model (built on meta); DoRA and a bfloat16 base need what
        the parallelism and training sections give them; lora.adapter_path's tensors must be exactly those
        of the adapters it targets, each of their shape, floating point and finite (read here, before any
        process group: an adapter is small)."""
        if options.use_dora and cfg.parallelism.tensor_parallel_degree > 1:
            # The row norms of a row-parallel weight would need a reduction over the tp ranks in forward.
            raise ValueError("lora.use_dora is not supported with tensor parallelism; use FSDP (or plain LoRA)")
        if options.base_dtype != "float32" and cfg.training.mixed_precision_param != options.base_dtype:
            # The base would otherwise meet float32 activations (one process) or be cast back up (FSDP's
            # param_dtype): bfloat16 compute is what a bfloat16 base is for.
            raise ValueError(f"lora.base_dtype {options.base_dtype} needs training.mixed_precision_param "
                             f"{options.base_dtype} (it is {cfg.training.mixed_precision_param})")
        with torch.device("meta"):
            meta = spec.model_cls(args)
        hf_names = hf_module_names(meta, spec, args)
        check_targets(select_targets(meta, options.target_modules, hf_names, exclude=options.exclude_modules,
                                     saved=options.modules_to_save), model=model)
        check_saved(meta, options, hf_names, name=model)
        if options.adapter_path:
            apply_lora(meta, options, spec=spec)
            read_whole_peft(meta, options.adapter_path, spec=spec, options=options)

    def convert(self, model: nn.Module) -> None:
        o = self.options
        targets = apply_lora(model, o)
        kind = "dora" if o.use_dora else "lora"
        log_on_rank0(f"{kind}: rank {o.rank}, alpha {o.alpha:g} on {len(targets)} linear layers "
                     f"({short_list(targets)}); every other parameter frozen"
                     + (f" but those of {', '.join(o.modules_to_save)} (lora.modules_to_save)" if o.modules_to_save
                        else "")
                     + (f", held in {o.base_dtype} (the adapters in float32)" if o.base_dtype != "float32" else ""))

    def init_weights(self, model: nn.Module, seed: int) -> None:
        for fqn, module in adapters(model).items():
            module.init_adapter(seed=seed, fqn=fqn)
        hf_names = hf_module_names(model, spec_of(model), model.model_args) if self.options.modules_to_save else {}
        freeze_base(model, keep=saved_parameters(model, self.options, hf_names))

    def initial_state(self, model: nn.Module) -> dict:
        """lora.adapter_path's A and B (a PEFT folder) for the adapters of this model part, and DoRA's
        initial magnitudes."""
        # DoRA's magnitudes start at the row norms of the weights the base now holds (loaded or drawn).
        state = dora_magnitudes(model) if self.options.use_dora else {}
        if self.options.adapter_path:
            state.update(peft_state_dict(model, self.options.adapter_path, options=self.options))
        return state

    def load_hooks(self) -> tuple[LoadHook, ...]:
        return (LoRAHooks(self.options),)

    @contextlib.contextmanager
    def disabled(self, parts: list[nn.Module]):
        """The adapters off: every LoRA layer of `parts` computes its base alone (scaling 0, so the
        adapter's term is exactly zero), e.g. DPO's reference."""
        modules = [m for part in parts for m in adapters(part).values()]
        saved = [m.lora_scaling for m in modules]
        for m in modules:
            m.lora_scaling = 0.0
        try:
            yield
        finally:
            for m, s in zip(modules, saved):
                m.lora_scaling = s


class LoRAMerge(LoadHook):
    """A LoRA job's checkpoint read without the job (load_model, convert_dcp_to_hf, a teacher): its
    adapters folded into the weights, as its lora_scale buffers say."""

    def merges(self, keys) -> bool:
        return any(map(is_adapter_key, keys))

    def merged(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return merged_state_dict(state_dict)


register_load_hook(LoRAMerge())


class LoRAHooks(LoadHook):
    """A LoRA job's own: its adapters, which a checkpoint of the model before the swap (a pre-training
    run's, as checkpoint.initial_load_path) lacks, keep their initialization; a Hugging Face export
    writes the PEFT adapter beside the merged model."""

    def __init__(self, options: LoRAOptions):
        self.options = options

    def fresh(self, key: str, saved_args) -> bool:
        return is_adapter_key(key)

    def hf_export(self, state_dict: dict, spec, args, folder: str, *, base_model: str | None = None) -> dict:
        """The PEFT adapter into folder/adapter (naming the Hugging Face folder the job started from as
        its base), and the merged weights for the full export."""
        export_peft(state_dict, spec, args, os.path.join(folder, "adapter"), self.options, base_model=base_model)
        return merged_state_dict(state_dict)


__all__ = ["LoRAConverter", "LoRAHooks", "LoRALinear", "LoRAMerge", "LoRAOptions", "adapters", "add_adapter", "apply_lora", "dora_magnitudes", "dora_row_norms", "export_peft", "freeze_base",
           "has_adapters", "hold_base_in", "load_peft", "lora_scaling", "merged_state_dict", "peft_state_dict",
           "read_adapter_config", "read_whole_peft", "split_state_dict"]
