"""Every registered family against the module-hook protocol (titanlike/models/protocol.py).

- The model contract: `layers` keyed "0".."total_layers - 1", init_weights(seed=, buffer_device=),
  forward(tokens, positions=None, mask=None, ...), tied weights that exist and are one Parameter,
  pipeline ends that exist and can be set to None.
- Every hook a module carries has the declared type and means what the protocol says (the
  parameters head_split_parameters names exist, sequence_inputs fits the forward, a reported loss is
  one its args report and has its buffer, ...); every declared hook is carried by some family.
- The family's shard function shards the whole model and each pipeline stage of it (a stage lacks
  the other ends and layers), on meta over a fake 2-rank TP mesh.
- Generic code reads no module attribute behind the protocol's back: an AST scan of getattr /
  hasattr / setattr with a literal name.
A deliberately broken family shows that the checks fail.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import REPO
from titanlike.models import protocol
from titanlike.models.registry import ModelSpec, PipelineEnds, get_model_spec, model_names



def _flavors() -> list[tuple[str, str]]:
    """Every family's smallest flavor and its other debug-sized ones (their structure differs:
    DeepSeek's query without LoRA, the hybrid's MoE and pure Mamba-2 patterns)."""
    out = []
    for name in model_names():
        spec = get_model_spec(name)
        smallest = min(spec.flavors, key=lambda f: spec.flavors[f].num_params())
        out += [(name, f) for f in spec.flavors if f == smallest or f.startswith("debug")]
    return out


def _meta(spec: ModelSpec, args) -> nn.Module:
    with torch.device("meta"):
        return spec.model_cls(args)


def _positional_inputs(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def contract_violations(spec: ModelSpec, args, model: nn.Module) -> list[str]:
    """What the model breaks of the model contract (protocol.py's docstring)."""
    bad = []
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        return [f"layers is a {type(layers).__name__}, not an nn.ModuleDict"]
    if list(layers.keys()) != [str(i) for i in range(args.total_layers)]:
        bad.append(f"layers are keyed {list(layers.keys())}, not 0..{args.total_layers - 1} (args.total_layers)")
    init = inspect.signature(model.init_weights).parameters
    if "seed" not in init or init.get("buffer_device") is None or init["buffer_device"].default is not None:
        bad.append(f"init_weights takes {list(init)}, not (seed=..., buffer_device=None)")
    forward = inspect.signature(model.forward).parameters
    names = list(forward)
    if names[:1] != ["tokens"] or any(forward.get(n) is None or forward[n].default is not None
                                       for n in ("positions", "mask")):
        bad.append(f"forward takes {names}, not (tokens, positions=None, mask=None, **fields)")
    tied = protocol.tied_weights(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    for alias, owner in tied.items():
        if alias not in params or owner not in params:
            bad.append(f"tied_weights names {alias} -> {owner}, which the model does not hold")
        elif params[alias] is not params[owner]:
            bad.append(f"tied_weights {alias} is not the same Parameter as {owner}")
    if tied and not callable(getattr(model, "tie_weights", None)):
        bad.append("tied_weights is set but the model has no tie_weights()")
    from titanlike.parallel.pipeline import end_module

    ends = spec.pipeline_ends
    for name in (ends.inputs + ends.outputs) if ends is not None else ():
        # None: a flavor without that end (BERT's post-norm models have no final norm).
        try:
            end = end_module(model, name)
        except AttributeError:
            end = "absent"
        if not isinstance(end, (nn.Module, type(None))):
            bad.append(f"pipeline end {name} is not a module of the model")
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, None)
        if end_module(model, name) is not None:
            bad.append(f"pipeline end {name} cannot be set to None")
    return bad


def hook_violations(args, model: nn.Module) -> tuple[list[str], set[str]]:
    """(what the model's modules break of the declared hooks, the hooks they carry)."""
    bad, carried, missing = [], set(), object()
    reported = set()
    for path, module in model.named_modules():
        where = f"{path or 'the model'} ({type(module).__name__})"
        for name, hook in protocol.HOOKS.items():
            value = getattr(module, name, missing)
            if value is missing or (hook.carrier == "model" and module is not model):
                continue
            carried.add(name)
            if not isinstance(value, hook.kind):
                bad.append(f"{where}: {name} is a {type(value).__name__}, declared {hook.kind}")
                continue
            bad += [f"{where}: {problem}" for problem in _meaning(name, value, module, args, reported)]
    for name in set(args.reported_losses()) - reported:
        bad.append(f"args.reported_losses() names {name}, which no module reports")
    return bad, carried


def _meaning(name: str, value, module: nn.Module, args, reported: set[str]) -> list[str]:
    """What the value of hook `name` on `module` breaks of its declared meaning."""
    if name in ("core_attention", "sequence_carry") and name not in vars(module):
        return [f"{name} is not an instance attribute (context parallelism replaces it per instance)"]
    if name == "loss_weight" and (name not in vars(module) or value is not None):
        return ["loss_weight is not an instance attribute set None by the module (the step wires it)"]
    if name == "sequence_carry" and value is not None:
        return ["sequence_carry is set on a model no context parallelism touched"]
    if name == "head_split_parameters":
        held = {n for n, _ in module.named_parameters()}
        unknown = [n for n in value if n not in held and not _optional(module, n)]
        return [f"head_split_parameters names {unknown}, which are not its parameters"] if unknown else []
    if name == "sequence_inputs" and not 1 <= value <= _positional_inputs(module):
        return [f"sequence_inputs {value} is not between 1 and its forward's positional inputs"]
    if name == "reported_loss":
        reported.add(value)
        buffer = dict(module.named_buffers(recurse=False)).get("reported_loss_sum")
        problems = ([] if value in args.reported_losses()
                    else [f"reported_loss {value!r} is not in args.reported_losses()"])
        if buffer is None or buffer.dtype != torch.float32 or buffer.dim() != 0:
            problems.append("reported_loss without a float32 scalar buffer reported_loss_sum")
        return problems
    if name == "keep_high_precision" and not isinstance(module, nn.Linear):
        return ["keep_high_precision on a module that is not a linear"]
    if name == "fsdp_mesh" and value not in ("token_fsdp", "expert_fsdp"):
        return [f"fsdp_mesh {value!r} is no mesh ParallelDims names for FSDP units"]
    return []


def _optional(module: nn.Module, name: str) -> bool:
    """A parameter name whose owner exists and holds None there (an optional bias)."""
    path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return False
    return attr in owner._parameters and owner._parameters[attr] is None


@pytest.mark.parametrize("family,flavor", _flavors())
def test_family_keeps_the_model_contract_and_the_declared_hooks(family, flavor):
    from titanlike.parallel.expert_parallel import apply_expert_parallel

    spec = get_model_spec(family)
    args = spec.flavors[flavor]
    model = _meta(spec, args)
    # The hooks expert parallelism sets (FSDP's mesh per unit, eager MoE layers), without meshes.
    apply_expert_parallel(model, ep_mesh=None, sequence_mesh=None)
    bad, _ = hook_violations(args, model)
    bad += contract_violations(spec, args, model)
    assert not bad, "\n".join(bad)


def test_every_declared_hook_is_carried_by_some_family():
    """A declared hook no family carries is a dead declaration (or a family lost it)."""
    from titanlike.parallel.expert_parallel import apply_expert_parallel

    carried = set()
    for family, flavor in _flavors():
        spec = get_model_spec(family)
        model = _meta(spec, spec.flavors[flavor])
        apply_expert_parallel(model, ep_mesh=None, sequence_mesh=None)
        carried |= hook_violations(spec.flavors[flavor], model)[1]
    assert carried == set(protocol.HOOKS)


@pytest.mark.parametrize("family", model_names())
def test_family_shards_the_whole_model_and_every_pipeline_stage(family):
    """spec.shard on meta over a fake 2-rank TP mesh: the whole model, then (with pipeline ends) a
    first and a last stage, each lacking the other end and the other stage's layers; tied weights
    stay one Parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from estimation.fake import fake_world
    from titanlike.parallel.pipeline import pipeline_stage
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    spec = get_model_spec(family)
    if spec.shard is None:
        pytest.skip(f"{family} has no tensor parallelism")
    args = spec.flavors[min(spec.flavors, key=lambda f: spec.flavors[f].num_params())]
    model = _meta(spec, args)
    parts = [_meta(spec, args)]
    if spec.pipeline_ends is not None:
        keys = list(model.layers.keys())
        half = args.num_layers // 2
        parts += [pipeline_stage(model, spec.pipeline_ends, keys[:half], first=True, last=False),
                  pipeline_stage(model, spec.pipeline_ends, keys[half:], first=False, last=True)]
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        for part in parts:
            apply_tensor_parallel(part, mesh, spec.shard, loss_parallel=True)
            assert any(isinstance(p, DTensor) for p in part.parameters()), family
            params = dict(part.named_parameters(remove_duplicate=False))
            for alias, owner in protocol.tied_weights(part).items():
                if alias in params and owner in params:
                    assert params[alias] is params[owner], (family, alias)


# ---------------------------------------------------------------- a deliberately broken family


class _BrokenMixer(nn.Module):
    head_split_parameters = ("weight", "no_such_parameter")
    sequence_inputs = 3  # its forward takes one positional input

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.keep_high_precision = True  # on a module that is not a linear
        self.record_statistics = "yes"  # declared bool

    def forward(self, x):
        return x


class _BrokenHead(nn.Module):
    reported_loss = "undeclared_loss"  # not in args.reported_losses(), and no buffer

    def forward(self, x):
        return x


class _BrokenModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _BrokenMixer(), "2": _BrokenMixer()})  # keys skip "1"
        self.head = _BrokenHead()
        self.tied_weights = {"head.weight": "layers.0.weight"}  # head holds no weight

    def init_weights(self, seed=0):  # no buffer_device
        pass

    def forward(self, tokens, positions=None, mask=None):
        return tokens


def test_a_broken_family_is_caught():
    args = get_model_spec("llama3").flavors["debugmodel_tiny"]  # total_layers 8; reports no losses
    spec = ModelSpec(name="broken", model_cls=_BrokenModel, flavors={"debug": args},
                     pipeline_ends=PipelineEnds(inputs=("embeddings",), outputs=("head",)))
    model = _meta(spec, args)
    bad, _ = hook_violations(args, model)
    bad += contract_violations(spec, args, model)
    text = "\n".join(bad)
    for expected in ("head_split_parameters names ['no_such_parameter']", "sequence_inputs 3",
                     "keep_high_precision on a module that is not a linear", "record_statistics is a str",
                     "reported_loss 'undeclared_loss' is not in args.reported_losses()",
                     "without a float32 scalar buffer", "layers are keyed ['0', '2']", "init_weights takes",
                     "tied_weights names head.weight", "pipeline end embeddings is not a module"):
        assert expected in text, f"{expected!r} not reported in:\n{text}"


# ---------------------------------------------------------------- generic code reads through the protocol


GENERIC = ["titanlike/parallel", "titanlike/train", "titanlike/checkpoint", "titanlike/inference", "estimation",
           "titanlike/models/converters.py", "titanlike/models/outputs.py", "titanlike/models/registry.py"]

# (file, attribute): why a literal getattr/hasattr/setattr there is not a module hook.
NOT_HOOKS = {
    ("titanlike/parallel/utils.py", "all_gather_single_autograd"): "a torch function newer releases have",
    ("titanlike/parallel/utils.py", "reduce_scatter_single_autograd"): "a torch function newer releases have",
    ("titanlike/parallel/timeouts.py", "_dump_fr_trace"): "a torch C++ binding older releases lack",
    ("titanlike/parallel/timeouts.py", "_world"): "torch's process-group registry",
    ("titanlike/parallel/timeouts.py", "pg_map"): "torch's process-group registry",
    ("titanlike/checkpoint/saving.py", "upload_completion"): "DCP's async-save response",
    ("titanlike/checkpoint/saving.py", "_CHECKPOINT_PROCESS"): "DCP's async process executor",
    ("titanlike/checkpoint/saving.py", "finished"): "the manager's own record of a pending save",
    ("titanlike/checkpoint/format.py", "storage_meta"): "DCP's checkpoint metadata",
    ("titanlike/checkpoint/loading.py", "size"): "DCP's tensor metadata (bytes entries have none)",
    ("titanlike/checkpoint/format.py", "failures"): "DCP's exceptions",
    ("titanlike/models/converters.py", "_titanlike_gloo"): "our marker on a torchao handler function",
    ("titanlike/models/converters.py", "fp8_autocast"): "Transformer Engine's module API",
    ("estimation/probe.py", "pipeline_order"): "torch's pipeline schedule",
}


def _literal_attribute_reads() -> list[tuple[str, int, str]]:
    """(file, line, name) of every getattr/hasattr/setattr(<x>, "<literal>", ...) in generic code."""
    files = []
    for entry in GENERIC:
        path = REPO / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                found.append((str(path.relative_to(REPO)), node.lineno, node.args[1].value))
    return found


def test_generic_code_reads_module_attributes_through_the_protocol():
    reads = _literal_attribute_reads()
    assert reads, "the scan found nothing: it scans the wrong files"
    through_getattr = [f"{f}:{line}: {name} is a declared hook: call titanlike.models.protocol's accessor"
                       for f, line, name in reads if name in protocol.HOOKS]
    undeclared = [f"{f}:{line}: {name} is read with getattr/hasattr but declared nowhere: declare it in "
                  "titanlike/models/protocol.py, or add it to NOT_HOOKS with the reason it is no module hook"
                  for f, line, name in reads if name not in protocol.HOOKS and (f, name) not in NOT_HOOKS]
    assert not through_getattr + undeclared, "\n".join(through_getattr + undeclared)
    stale = set(NOT_HOOKS) - {(f, name) for f, _, name in reads}
    assert not stale, f"NOT_HOOKS entries the code no longer has: {sorted(stale)}"


def test_generic_code_imports_no_family_and_models_import_no_parallel():
    families = [n for n in model_names()]
    pattern = tuple(f"titanlike.models.{n}" for n in families)
    offenders = []
    for entry in ("titanlike/parallel", "titanlike/train", "titanlike/checkpoint", "titanlike/inference", "estimation"):
        for path in sorted((REPO / entry).rglob("*.py")):
            offenders += [f"{path.relative_to(REPO)} imports {name}" for name in _imports(path)
                          if name.startswith(pattern)]
    for path in sorted((REPO / "titanlike/models").rglob("*.py")):
        offenders += [f"{path.relative_to(REPO)} imports {name}" for name in _imports(path)
                      if name.startswith("titanlike.parallel")]
    assert not offenders, "\n".join(offenders)


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names
