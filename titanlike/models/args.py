"""The model-args contract: everything generic code may ask a model family about its sizes.

The trainer, validation, the checkpoint and Hugging Face code, and the estimator never read a
family's fields (n_heads, ffn_hidden_dim, ...): they call these methods. A family's args are a
dataclass deriving from BaseModelArgs; each answer is one formula, written once, in the family.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from titanlike.models.common.moe import MoEArgs


class LayoutDegrees(Protocol):
    """The parallel degrees a family's rules may look at (ParallelDims satisfies this)."""

    tp: int
    cp: int
    pp: int
    ep: int
    etp: int


@dataclass(frozen=True)
class AttentionShape:
    """Heads of a model's attention, for the kernel report and the CP/TP cost models."""

    heads: int  # query heads
    kv_heads: int  # key/value heads (fewer than heads: grouped-query attention)
    head_dim: int
    causal: bool = True


@dataclass
class BaseModelArgs:
    """Base class of every family's model args (a dataclass of plain values, JSON-serialisable).

    Subclasses implement the methods that raise NotImplementedError. The Hugging Face side
    (config.json, weights) is the family's adapter, ModelSpec.hf (models/common/hf.py).
    """

    # Other names a job may give the fields in [model.args] (Megatron's flags, --hidden-size being the
    # key hidden_size, and Hugging Face's config.json keys): other name -> the fields it may mean, the
    # first one the class has is taken; a name none of whose fields the class has is not offered. Each
    # family's args declare their own (models/common/decoder.py for the decoders).
    ARG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {}
    # Fields a job's objective sets, never [model.args] (field -> the option that does): a value given
    # there would change what the model outputs under an objective that expects the other.
    OBJECTIVE_FIELDS: ClassVar[dict[str, str]] = {}

    # Sizes set from the job ----------------------------------------------------------------------

    def update_from_config(self, *, vocab_size: int, seq_len: int, decoder_seq_len: int | None = None) -> BaseModelArgs:
        """A copy sized for a job: the tokenizer's vocabulary and the training sequence length, plus
        the lengths the job's objective adds (its model_args: decoder_seq_len, an encoder-decoder's
        decoder tokens per sample, from span_corruption.decoder_seq_len; models without a decoder
        stack ignore it).

        The default replaces `vocab_size` and `max_seq_len`; a family whose vocabulary is fixed
        by its weights or whose context is not a field overrides it.
        """
        return dataclasses.replace(self, vocab_size=vocab_size, max_seq_len=seq_len)

    @property
    def context_len(self) -> int:
        """The longest sequence this model can take (positions it has embeddings or angles for)."""
        return self.max_seq_len  # type: ignore[attr-defined]

    def with_context_len(self, context_len: int) -> BaseModelArgs:
        """A copy whose context is `context_len` (sidecars record the flavor's real context)."""
        return dataclasses.replace(self, max_seq_len=context_len)

    # Counting ------------------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream (what flows between blocks and pipeline stages)."""
        return self.dim  # type: ignore[attr-defined]

    @property
    def num_layers(self) -> int:
        """Entries of the model's `layers` (the unit of pipeline splitting and per-block wrapping)."""
        return self.n_layers  # type: ignore[attr-defined]

    @property
    def total_layers(self) -> int:
        """Every entry of the model's `layers`: the num_layers of the trunk first, then any the
        family keeps after them with the output end (multi-token-prediction modules, numbered as
        DeepSeek's checkpoints do). Pipeline splitting cuts the trunk and puts the rest on the last
        stage; per-layer bookkeeping (MoE statistics) spans all of them."""
        return self.num_layers

    @property
    def lookahead_tokens(self) -> int:
        """How many tokens past its next-token label each position's training forward reads (the
        depth of multi-token prediction). When > 0 the trainer passes `lookahead`, built from the
        whole sequence before any context-parallel cut (titanlike/objectives/causal_lm.py)."""
        return 0

    def reported_losses(self) -> tuple[str, ...]:
        """Names of the loss terms the model adds to the objective itself and that are logged apart
        from the loss (e.g. "mtp_loss"), as declared by its modules (titanlike/models/outputs.py)."""
        return ()

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameters of the whole model, tied weights once. exclude_embedding leaves out lookup
        tables that do no matmul work (token and position embeddings; a table tied to the output
        projection stays counted). active counts what one token uses: of a mixture of experts'
        routed experts only top_k (the same as the total for a dense model)."""
        raise NotImplementedError

    @property
    def has_score_head(self) -> bool:
        """Whether the output projection gives one score per position (a reward model, with_score_head)
        rather than the vocabulary's logits."""
        return False

    def with_score_head(self) -> BaseModelArgs:
        """A copy whose output projection gives one scalar per position (a reward model's head);
        ValueError (one sentence) for a family that has none."""
        raise ValueError(f"{type(self).__name__} models have no scalar (reward) head")

    def moe_args(self) -> MoEArgs | None:
        """The mixture-of-experts settings (models/common/moe.py), or None for a dense model."""
        return None

    def with_moe_args(self, moe: MoEArgs) -> BaseModelArgs:
        """A copy with other MoE settings (the job's [moe] overrides); only asked of MoE models."""
        raise NotImplementedError(f"{type(self).__name__} has no mixture-of-experts settings")

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): 6 N + the attention term, N without embeddings.
        The attention term counts the full T x T score matrix (attention counted non-causal)."""
        raise NotImplementedError

    def layer_costs(self, seq_len: int) -> list[float] | None:
        """Relative compute of each trunk layer at this sequence length (e.g. forward FLOPs per token),
        for models whose layers differ in cost (a hybrid's Mamba, attention and MLP layers): the
        pipeline split then balances the stages' summed costs. Work the first stage does besides its
        layers (a vision tower beside the embedding) is added to the first layer's cost: that layer
        always goes there. None (the default): every layer costs the same, and the split balances
        layer counts."""
        return None

    def attention_shape(self) -> AttentionShape | None:
        """The attention heads, or None for a model without attention."""
        return None

    # Rules -----------------------------------------------------------------------------------------

    def validate(self, dims: LayoutDegrees, *, seq_len: int) -> None:
        """Raise ValueError (one sentence naming the option to change) when this model cannot run
        under these degrees or at this sequence length. Called before any process group exists."""

    # The job's own sizes ([model.args]) ------------------------------------------------------------

    def with_overrides(self, overrides: Mapping[str, Any], *, option: str = "model.args") -> BaseModelArgs:
        """A copy with the job's settings of its fields (`[model.args]`): keys are field names (nested
        dataclass fields dotted, `moe.num_experts`) or ARG_ALIASES; command-line values are strings,
        converted to each field's type here. The result passes the same checks as a checkpoint's
        sidecar (check_fields) and the class's own rules (its __post_init__); ValueError, one sentence
        naming the option, for anything else."""
        fields = self.to_dict()
        for spelled, value in overrides.items():
            path = spelled.replace("-", "_").split(".")
            path[0] = self.known_arg_names().get(path[0], path[0])
            shown = spelled if len(spelled) <= 60 else spelled[:57] + "..."
            if path[0] in self.OBJECTIVE_FIELDS:
                raise ValueError(f"{option}.{shown} is not a size of the model: {self.OBJECTIVE_FIELDS[path[0]]} "
                                 "sets it; remove it")
            _set_field(type(self), fields, path, value, f"{option}.{shown}")
        check_fields(type(self), fields, what=option)
        try:
            return type(self).from_dict(fields)
        except Exception as e:  # a combination the field checks let through: the class's own rule
            raise ValueError(f"{option}: {e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}'}") from None

    @classmethod
    def known_arg_names(cls) -> dict[str, str]:
        """Every name [model.args] takes: each field under its own name, and the aliases whose field exists."""
        names = {f.name: f.name for f in dataclasses.fields(cls)}
        aliases = {alias: next((f for f in fields if f in names), None) for alias, fields in cls.ARG_ALIASES.items()}
        return {**{alias: field for alias, field in aliases.items() if field is not None}, **names}

    # Serialisation (checkpoint sidecars) -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> BaseModelArgs:
        """Args from to_dict's output; unknown fields are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
        return cls(**fields)


# The largest size or count a model's args may hold (2^31 - 1): beyond any real model's layers,
# heads, features, vocabulary or positions, and small enough that no arithmetic on it overflows.
MAX_SIZE = 2**31 - 1


def check_fields(cls: type, fields: Mapping[str, Any], *, what: str) -> None:
    """ValueError (one sentence naming the field and its value) when a value of `fields` (args as
    to_dict gives them, e.g. read from a checkpoint's sidecar) does not fit field of dataclass `cls`:
    the declared type (int, float, bool, str, optional, a nested args dataclass, a tuple of ints);
    an int from 1 to MAX_SIZE (from 0 where the field's default is 0); a float finite and >= 0. Runs
    before the class is built, so no __post_init__ divides by a zero it was given. `what` names the
    args in the message ("the model args of titanlike.json"). Fields not in `cls` are left to its
    constructor, which refuses them."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in fields:
            default = f.default if f.default is not dataclasses.MISSING else None
            problem = _field_problem(hints[f.name], fields[f.name], default, what, f.name)
            if problem is not None:
                raise ValueError(problem)


def _field_problem(tp: Any, value: Any, default: Any, what: str, name: str) -> str | None:
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else tp
    if value is None:
        return None if optional else f"{what}: {name} is null, but it must be set"
    shown = _show(value)
    if dataclasses.is_dataclass(base):
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            return f"{what}: {name} is {shown}, but it must be an object of {base.__name__} fields"
        try:
            check_fields(base, value, what=f"{what}: {name}")
        except ValueError as e:
            return str(e)
        return None
    if typing.get_origin(base) in (tuple, list):
        item = typing.get_args(base)[0] if typing.get_args(base) else Any
        if not isinstance(value, (list, tuple)):
            return f"{what}: {name} is {shown}, but it must be a list"
        for i, v in enumerate(value):
            if (problem := _field_problem(item, v, 0, what, f"{name}[{i}]")) is not None:
                return problem
        return None
    if base is bool:
        return None if isinstance(value, bool) else f"{what}: {name} is {shown}, but it must be true or false"
    if base is int:
        low = 0 if default == 0 else 1
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SIZE:
            return f"{what}: {name} is {shown}, but it must be an integer from {low} to {MAX_SIZE}"
        return None
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return f"{what}: {name} is {shown}, but it must be a finite number at least 0"
        return None
    if base is str:
        return None if isinstance(value, str) and len(value) <= 10_000 else \
            f"{what}: {name} is {shown}, but it must be a string"
    return None  # another kind of field: its class checks it


def _set_field(cls: type, fields: dict[str, Any], path: list[str], value: Any, where: str) -> None:
    """fields[path] = value converted to the declared type of that field of dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    name = path[0]
    if name not in names:
        from titanlike.config.loader import near_certain

        offered = sorted(cls.known_arg_names()) if hasattr(cls, "known_arg_names") else sorted(names)
        close = near_certain(name, offered)
        hint = f"did you mean '{close}'? " if close else ""
        raise ValueError(f"{where} is not a setting of {cls.__name__}; {hint}its fields are {', '.join(sorted(names))}")
    tp = typing.get_type_hints(cls)[name]
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else tp
    if len(path) > 1:
        if not dataclasses.is_dataclass(base):
            raise ValueError(f"{where}: {name} has no settings of its own (it is one value)")
        nested = fields.get(name)
        if nested is None:
            raise ValueError(f"{where}: the model has no {name} to change (it is not set for this model)")
        nested = dataclasses.asdict(nested) if dataclasses.is_dataclass(nested) else dict(nested)
        _set_field(base, nested, path[1:], value, where)
        fields[name] = nested
        return
    fields[name] = _typed(base, optional, value, where)


def _typed(base: Any, optional: bool, value: Any, where: str) -> Any:
    """A command-line string as the field's type (TOML values arrive typed; check_fields judges them)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if typing.get_origin(base) in (tuple, list):
            return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(base, "a list of integers")
        raise ValueError(f"{where} must be {kind}, got {value!r}") from None
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def model_bytes(args: BaseModelArgs, bytes_per_param: int) -> int:
    """Bytes the model's weights take at bytes_per_param (args.num_params(): arithmetic, nothing is
    built), plus its position tables (RoPE angles: at most context_len x hidden_size float32), a
    bound checked before anything is allocated."""
    return args.num_params() * bytes_per_param + args.context_len * args.hidden_size * 4


def check_divisible(count: int, what: str, degree: int, option: str) -> None:
    """The usual family rule: `count` `what` must split evenly over `degree` ranks of `option`."""
    if count % degree:
        raise ValueError(f"{count} {what} are not divisible by {option} {degree}")


__all__ = ["MAX_SIZE", "AttentionShape", "BaseModelArgs", "LayoutDegrees", "check_divisible", "check_fields",
           "model_bytes"]
