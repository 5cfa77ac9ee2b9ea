"""Model converters: module swaps applied to the model on meta, after construction and before
parallelize (the build order of README.md's "How a job runs": model on meta -> converters -> parallelize).

`model.converters` names them, in order. A converter is registered with the config section it is
built from (its own: float8 and te read [float8], lora reads [lora], titanlike/models/lora.py), swaps
modules of the whole meta model in place (before any pipeline split, so every stage inherits the
swap), and may act after each optimizer step, bring load hooks (models/load_hooks.py) and switch
itself off for a reference forward (`ModelConverters.disabled`). `validate_converters` refuses a
converter this machine cannot run before any process group exists.

- `float8`: torchao's Float8Linear for every nn.Linear whose in and out features are multiples of
  16 (what float8 matmuls need) and whose name is not in `float8.filter_fqns` (the output
  projection by default). The tensorwise recipe can all-gather FSDP parameters in float8
  (`enable_fsdp_float8_all_gather`), with their scales computed for all parameters at once after
  each optimizer step (`precompute_float8_dynamic_scale_for_fsdp`), and makes the tensor-parallel
  styles cast activations to float8 before their all-gathers (models/common/sharding.py).
- `te`: NVIDIA Transformer Engine's Linear for the same layers, run under its fp8 autocast.
- `mx`: torchao's MXFP8 linears and, where asked, the MoE experts' grouped GEMMs in MXFP8
  (titanlike/models/mx.py, its own [mx] section).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import sys
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.nn as nn

from titanlike.config.schema import Float8
from titanlike.models import protocol

if TYPE_CHECKING:
    from titanlike.models.load_hooks import LoadHook
    from titanlike.config.schema import JobConfig

logger = logging.getLogger("titanlike")

FLOAT8_RECIPES = ("tensorwise", "rowwise")


class ModelConverter:
    """One named swap, built from its own config section and nothing else: `section` names it
    ([float8], [lora]) and the converter gets it as `options`. Subclasses set `name` and `section` and
    implement convert(); the rest is optional."""

    name = ""
    section = ""
    # It replaces the model's nn.Linear layers by its own: a job names at most one such converter.
    replaces_linears = False

    def __init__(self, options):
        self.options = options

    @classmethod
    def validate(cls, options, *, tp: int) -> None:
        """Its rules that need no model, before any process group: ValueError, one sentence. tp: the
        job's tensor-parallel degree."""

    @classmethod
    def validate_model(cls, options, cfg, spec, args, *, model: str) -> None:
        """Its rules that need the model (spec and args; build it on meta) or the job's other sections
        (`cfg`); ValueError, one sentence, before any process group."""

    @classmethod
    def validate_unnamed(cls, options) -> None:
        """When model.converters does not name it: ValueError if its section asks for something (an
        option set for a converter that is not applied)."""

    def convert(self, model: nn.Module) -> None:
        raise NotImplementedError

    def init_weights(self, model: nn.Module, seed: int) -> None:
        """After parallelize and the model's own init_weights, on this rank's shards: initialize what
        the swap added (a function of (seed, parameter name) only), and restore what parallelization
        reset (torch's SequenceParallel registers the norms' weights anew, trainable)."""

    def post_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        """Called after every optimizer step with this rank's model parts."""

    def initial_state(self, model: nn.Module) -> dict:
        """For a fresh run, after the model's initial load (checkpoint.initial_load_path) or init: what
        the swap loads into this model part, full tensors by name (rank 0's are broadcast; {} none)."""
        return {}

    def load_hooks(self) -> tuple[LoadHook, ...]:
        """What the swap adds when a checkpoint loads into, or is exported from, the model
        (models/load_hooks.py: LoRA's adapters, which a checkpoint of the model before the swap lacks)."""
        return ()

    def disabled(self, parts: list[nn.Module]) -> contextlib.AbstractContextManager:
        """A context in which `parts` compute as the model before the swap, where the swap can say so
        (LoRA: its adapters off, a DPO reference for free); else a context that changes nothing."""
        return contextlib.nullcontext()


_CONVERTERS: dict[str, type[ModelConverter]] = {}


def register_converter(cls: type[ModelConverter]) -> type[ModelConverter]:
    """Make `cls.name` a value of model.converters, built from the job's `[cls.section]` (a class
    decorator; its module registers it when imported: config/sections.py's discovery imports it)."""
    if cls.name in _CONVERTERS:
        raise ValueError(f"model converter {cls.name!r} is already registered")
    if not cls.section:
        raise ValueError(f"model converter {cls.name!r} names no config section")
    _CONVERTERS[cls.name] = cls
    return cls


def _registered() -> dict[str, type[ModelConverter]]:
    from titanlike.config.sections import registered_sections

    registered_sections()  # runs the discovery once: it imports every converter's module
    return _CONVERTERS


def converter_names() -> list[str]:
    return sorted(_registered())


class ModelConverters:
    """The converters of one job, applied in the order model.converters names them."""

    def __init__(self, converters: list[ModelConverter]):
        self.converters = converters

    def convert(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.convert(model)

    def init_weights(self, model: nn.Module, seed: int) -> None:
        for converter in self.converters:
            converter.init_weights(model, seed)

    def initial_state(self, model: nn.Module) -> dict:
        state: dict = {}
        for converter in self.converters:
            state.update(converter.initial_state(model))
        return state

    def post_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        for converter in self.converters:
            converter.post_optimizer_step(model_parts)

    def load_hooks(self) -> tuple[LoadHook, ...]:
        return tuple(hook for converter in self.converters for hook in converter.load_hooks())

    @contextlib.contextmanager
    def disabled(self, parts: list[nn.Module]):
        """Every converter's `disabled` context at once: `parts` as the model before the swaps, as far
        as they can say."""
        with contextlib.ExitStack() as stack:
            for converter in self.converters:
                stack.enter_context(converter.disabled(parts))
            yield


def build_model_converters(names: list[str], cfg: JobConfig) -> ModelConverters:
    """The converters model.converters names, each built from its own section of the job (`cfg`)."""
    registered = _registered()
    return ModelConverters([registered[name](getattr(cfg, registered[name].section)) for name in names])


def validate_converters(names: list[str], cfg: JobConfig, *, tp: int) -> None:
    """Refuse converters this job cannot run, in one sentence (ValueError), before any process group:
    names model.converters may not give, then each named converter's own rules on its section."""
    registered = _registered()
    for name in names:
        if name not in registered:
            raise ValueError(f"model.converters names an unknown converter {name!r}; known converters: "
                             f"{', '.join(sorted(registered))}")
    if len(set(names)) != len(names):
        raise ValueError(f"model.converters names a converter twice: {', '.join(names)}")
    linears = [name for name in names if registered[name].replaces_linears]
    if len(linears) > 1:
        raise ValueError(f"model.converters {' and '.join(linears)} {'both' if len(linears) == 2 else 'all'} "
                         "replace the linear layers; name one of them")
    for name in names:
        registered[name].validate(getattr(cfg, registered[name].section), tp=tp)


def validate_converter_targets(names: list[str], cfg: JobConfig, spec, args, *, model: str) -> None:
    """The converters' rules that need the model (LoRA's targets must name linears of it), and those of
    the converters the job does not name (LoRA's options left unset). ValueError, one sentence, before
    any process group."""
    for name, cls in sorted(_registered().items()):
        options = getattr(cfg, cls.section)
        if name in names:
            cls.validate_model(options, cfg, spec, args, model=model)
        else:
            cls.validate_unnamed(options)


def importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _has_float8_gpu() -> bool:
    """A CUDA GPU with float8 tensor cores (compute capability 8.9+: Ada, Hopper and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def gpu_description() -> str:
    if not torch.cuda.is_available():
        return "this machine has none"
    major, minor = torch.cuda.get_device_capability()
    return f"this machine's {torch.cuda.get_device_name()} has compute capability {major}.{minor}"


# ---------------------------------------------------------------------------------------------
# Which linear layers a converter swaps.


def fqn_matches(fqn: str, pattern: str) -> bool:
    """True when `pattern` names `fqn` or a module containing it, or appears in it as whole
    dot-separated parts: "output" matches "output", "attention.wq" matches every block's wq,
    "layers.1" matches layer 1 but not layer 10."""
    return f".{pattern}." in f".{fqn}."


@dataclasses.dataclass
class LinearSelection:
    """The outcome of a filter over a model's nn.Linear layers, by fully qualified name. `option` names
    the filter's option and `multiple` what both features must be a multiple of (16 for float8 matmuls,
    32 for MXFP8's blocks)."""

    converted: list[str] = dataclasses.field(default_factory=list)
    filtered: list[str] = dataclasses.field(default_factory=list)  # named by filter_fqns
    model_kept: list[str] = dataclasses.field(default_factory=list)  # marked keep_high_precision (MoE routers)
    misaligned: list[str] = dataclasses.field(default_factory=list)  # a dim not a multiple of `multiple`
    option: str = "float8.filter_fqns"
    multiple: int = 16

    def describe(self) -> str:
        total = len(self.converted) + len(self.filtered) + len(self.model_kept) + len(self.misaligned)
        text = f"converted {len(self.converted)} of {total} linear layers"
        kept = []
        if self.filtered:
            kept.append(f"{short_list(self.filtered)} ({self.option})")
        if self.model_kept:
            kept.append(f"{short_list(self.model_kept)} (kept in high precision by the model)")
        if self.misaligned:
            kept.append(f"{short_list(self.misaligned)} (features not multiples of {self.multiple})")
        if kept:
            text += "; left in high precision: " + ", ".join(kept)
        return text


def log_on_rank0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.info(message)


def short_list(fqns: list[str], limit: int = 4) -> str:
    shown = ", ".join(fqns[:limit])
    return shown if len(fqns) <= limit else f"{shown} and {len(fqns) - limit} more"


def linear_filter(filter_fqns: Iterable[str], selection: LinearSelection) -> Callable[[nn.Module, str], bool]:
    """A module_filter_fn(module, fqn) for torchao that records its decisions in `selection`."""
    filter_fqns = list(filter_fqns)

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        # A model marks linears that must keep their precision (an MoE router, computed in fp32).
        if protocol.keeps_high_precision(module):
            selection.model_kept.append(fqn)
            return False
        if any(fqn_matches(fqn, pattern) for pattern in filter_fqns):
            selection.filtered.append(fqn)
            return False
        if module.in_features % selection.multiple or module.out_features % selection.multiple:
            selection.misaligned.append(fqn)
            return False
        selection.converted.append(fqn)
        return True

    return keep


# ---------------------------------------------------------------------------------------------
# float8 through torchao.


@contextlib.contextmanager
def quiet_torchao():
    """Imports of torchao without the warnings it logs on machines that lack its CUDA kernels (which
    float8 training and emulated MXFP8 do not use)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def import_torchao_float8():
    """torchao.float8, imported quietly (quiet_torchao)."""
    with quiet_torchao():
        import torchao.float8 as float8
    return float8


def float8_linear_config(f: Float8):
    """torchao's Float8LinearConfig for the job's [float8] section."""
    float8 = import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(f.recipe_name or "tensorwise")
    return dataclasses.replace(config, emulate=f.emulate,
                               enable_fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather)


@register_converter
class Float8Converter(ModelConverter):
    name = "float8"
    section = "float8"
    replaces_linears = True

    def __init__(self, options: Float8):
        super().__init__(options)
        self.config = float8_linear_config(options)
        self.recipe = options.recipe_name or "tensorwise"
        self.precompute_scales = options.precompute_float8_dynamic_scale_for_fsdp
        self.selection = LinearSelection()

    @classmethod
    def validate(cls, f: Float8, *, tp: int) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(not f.recipe_name or f.recipe_name in FLOAT8_RECIPES,
              f"float8.recipe_name must be {' or '.join(FLOAT8_RECIPES)} (empty means tensorwise), "
              f"got {f.recipe_name!r}")
        check(importable("torchao"),
              "model.converters float8 needs torchao, which is not installed: pip install torchao "
              "(or pip install -e '.[float8]')")
        check(f.emulate or _has_float8_gpu(),
              f"float8 needs a CUDA GPU with compute capability 8.9+ (H100/L40/4090), but "
              f"{gpu_description()}; set float8.emulate to test the swap on CPU")
        check(not (f.enable_fsdp_float8_all_gather and f.recipe_name == "rowwise"),
              "float8.enable_fsdp_float8_all_gather works with the tensorwise recipe only, not rowwise; "
              "unset it or set float8.recipe_name tensorwise")
        check(not f.precompute_float8_dynamic_scale_for_fsdp or f.enable_fsdp_float8_all_gather,
              "float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of the float8 "
              "all-gather, so it needs float8.enable_fsdp_float8_all_gather")

    def convert(self, model: nn.Module) -> None:
        float8 = import_torchao_float8()
        selection = LinearSelection()
        float8.convert_to_float8_training(
            model, module_filter_fn=linear_filter(self.options.filter_fqns, selection), config=self.config)
        self.selection = selection
        details = [self.recipe]
        if self.config.emulate:
            details.append("emulated")
        if self.config.enable_fsdp_float8_all_gather:
            details.append("FSDP all-gather in float8")
        if self.precompute_scales:
            details.append("scales precomputed after each step")
        log_on_rank0(f"float8 ({', '.join(details)}): {selection.describe()}")

    def post_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        if self.precompute_scales:
            # One all-reduce of every float8 weight's amax, instead of one per weight in forward.
            float8 = import_torchao_float8()
            for part in model_parts:
                float8.precompute_float8_dynamic_scale_for_fsdp(part)


def is_float8_tensorwise_linear(module: nn.Module) -> bool:
    """A torchao Float8Linear with tensorwise scaling: the tensor-parallel styles that cast to
    float8 before communicating (Float8ColwiseParallel, ...) apply to it. False without torchao."""
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.config import ScalingGranularity

    casts = (module.config.cast_config_input, module.config.cast_config_weight,
             module.config.cast_config_grad_output)
    return all(c.scaling_granularity == ScalingGranularity.TENSORWISE for c in casts)


def _allow_float8_all_gather_on_gloo() -> None:
    """Let torchao's float8 tensor-parallel all-gathers run on gloo (CPU tests).

    gloo has no float8 dtypes ("Invalid scalar type"); NCCL moves float8 as bytes, and so does this:
    for CPU tensors only, torchao's all-gather of a Float8TrainingTensor sends its data viewed as
    uint8 and views the result back. CUDA tensors keep torchao's own handler untouched.
    """
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    table = float8_ops.FLOAT8_OPS_TABLE
    ops = [torch.ops._c10d_functional.all_gather_into_tensor.default]
    original = table[ops[0]]
    if getattr(original, "_titanlike_gloo", False):
        return

    def all_gather(aten_op, args, kwargs=None):
        fp8 = args[0]
        if fp8._data.device.type != "cpu":
            return original(aten_op, args, kwargs)
        data = fp8._data.contiguous()
        out = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {})).view(data.dtype)
        return Float8TrainingTensor(out, fp8._scale, fp8._orig_dtype, fp8._linear_mm_config, fp8._gemm_input_role)

    all_gather._titanlike_gloo = True
    for op in ops:
        table[op] = all_gather


def float8_tensor_parallel_styles():
    """(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput) from torchao."""
    import_torchao_float8()
    _allow_float8_all_gather_on_gloo()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


# ---------------------------------------------------------------------------------------------
# NVIDIA Transformer Engine.


@register_converter
class TransformerEngineConverter(ModelConverter):
    """nn.Linear -> transformer_engine.pytorch.Linear (same filter as float8), forward under TE's
    fp8 autocast with its default recipe.

    Unverified on hardware: Transformer Engine cannot be installed on the CPU machines this was
    written on, so only the swap logic is tested (against a stand-in module). Validation refuses it
    with tensor parallelism (TE shards its own layers; the DTensor plan expects nn.Linear) and on
    machines without an SM 8.9+ GPU. te.Linear adds an `_extra_state` entry (its fp8 metadata) to
    each layer's state dict.
    """

    name = "te"
    section = "float8"  # its filter_fqns
    replaces_linears = True

    def __init__(self, options: Float8):
        super().__init__(options)
        import transformer_engine.pytorch as te

        self.te = te
        self.selection = LinearSelection()

    @classmethod
    def validate(cls, f: Float8, *, tp: int) -> None:
        if not importable("transformer_engine"):
            raise ValueError("model.converters te needs NVIDIA Transformer Engine, which is not installed "
                             "(pip install transformer-engine[pytorch] on a CUDA machine), or use the float8 converter")
        if not _has_float8_gpu():
            raise ValueError(f"model.converters te needs a CUDA GPU with compute capability 8.9+ (H100/L40/4090), "
                             f"but {gpu_description()}; the float8 converter with float8.emulate tests float8 on CPU")
        if tp != 1:
            raise ValueError("model.converters te does not work with tensor parallelism (the tensor-parallel plan "
                             "shards nn.Linear layers), so tensor_parallel_degree must be 1")

    def convert(self, model: nn.Module) -> None:
        selection = LinearSelection()
        keep = linear_filter(self.options.filter_fqns, selection)
        for fqn, module in list(model.named_modules()):
            if not keep(module, fqn):
                continue
            parent_name, _, attr = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, self._swap(module))
        self.selection = selection
        _register_forward_context(model, self._autocast)
        log_on_rank0(f"Transformer Engine: {selection.describe()}")

    def _swap(self, linear: nn.Linear) -> nn.Module:
        weight = linear.weight
        new = self.te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                             params_dtype=weight.dtype, device=weight.device)
        if weight.device.type != "meta":
            with torch.no_grad():
                new.weight.copy_(weight)
                if linear.bias is not None:
                    new.bias.copy_(linear.bias)
        return new

    def _autocast(self):
        autocast = getattr(self.te, "fp8_autocast", None)
        if autocast is not None:
            return autocast(enabled=True)
        return self.te.autocast(enabled=True)  # the newer name


def _register_forward_context(model: nn.Module, make_context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run every forward of `model` inside make_context(). Hooks, not a wrapper, so that parameter
    names do not change and pipeline stages (deep copies of the model) keep them."""
    active: list[contextlib.AbstractContextManager] = []

    def enter(module, args):
        context = make_context()
        context.__enter__()
        active.append(context)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
