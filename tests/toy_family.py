"""A model family and a training objective defined outside titanlike/ (issue 26, item 1's proof).

Importing this module registers both, the way a user brings their own: then `train.main(argv)`
trains them with `--model.name toy` (tests/distributed/test_custom_family.py does exactly that). It
uses only public titanlike entry points: the ModelSpec registry, the args contract, the init
helpers, the shared ShardingPlan and a torch ParallelStyle of its own, the Objective base,
register_section and the loader's GlobalSamples.

The family, `toy`: a small decoder of *parallel* blocks (GPT-J / PaLM: one norm, then
x + attention(h) + mlp(h)) whose attention holds one fused, head-major QKV parameter of shape
(3, heads, head_dim, dim). Its tensor parallelism is plain Megatron TP without sequence parallelism:
the residual stream stays whole on every rank between blocks; the QKV parameter is split on its
heads dimension (Shard(1)) by `HeadMajorQKV`, a style of its own, and each rank's attention reads its
heads with to_local(); the output projection and the MLP are rowwise / colwise linears, the
vocabulary is split in the embedding, and the logits are gathered whole (see `toy_sharding`).

The objective, `toy_copy`: a synthetic copy task. Each sample is a window whose second half repeats
its first (random ids below ALPHABET, drawn from (seed, split, sample index)); only the second
half's tokens are targets, and the loss is a label-smoothed cross-entropy summed over them, with
the smoothing read from its own config section `[toy_copy] label_smoothing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.data.loader import GlobalSamples
from titanlike.models.args import AttentionShape, BaseModelArgs, check_divisible
from titanlike.models.common.init import normal_, ones_
from titanlike.models.common.sharding import ShardingPlan, replicated
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.models.registry import ModelSpec, PipelineEnds, model_names, register_model_spec
from titanlike.objectives.base import (LossTerms, Microbatch, Objective, compile_options, next_token_correct,
                                       target_count)
from titanlike.objectives.companion import Companion, Source
from titanlike.objectives.registry import register_family_objective, register_objective

# ---------------------------------------------------------------------------------- the family


@dataclass
class ToyArgs(BaseModelArgs):
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 2048  # replaced by the tokenizer's (update_from_config)
    max_seq_len: int = 64  # rows of the learned position table: the job's training.seq_len
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        d = self.dim
        block = 3 * d * d + d * d + 2 * 4 * d * d + d  # qkv, wo, w1 and w2, the norm
        tables = (self.vocab_size + self.max_seq_len) * d  # token and position embeddings
        total = self.n_layers * block + d + self.vocab_size * d + tables  # + final norm, output projection
        return total - tables if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * self.num_params(exclude_embedding=True) + 12 * self.n_layers * self.dim * seq_len

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_heads, self.n_heads, self.head_dim)

    def validate(self, dims, *, seq_len: int) -> None:
        check_divisible(self.n_heads, "attention heads", dims.tp, "tensor_parallel_degree")


def local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter tensor parallelism split (HeadMajorQKV), else the tensor."""
    return param.to_local() if isinstance(param, DTensor) else param


class FusedAttention(nn.Module):
    """Causal multi-head attention with one head-major QKV parameter, (3, heads, head_dim, dim)."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.qkv = nn.Parameter(torch.empty(3, args.n_heads, args.head_dim, args.dim))
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.einsum("bsd,thed->tbhse", h, local(self.qkv))  # this rank's heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, seq, head_dim)
        return self.wo(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, 4 * args.dim, bias=False)
        self.w2 = nn.Linear(4 * args.dim, args.dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(h)))


class ParallelBlock(nn.Module):
    """x + attention(norm(x)) + mlp(norm(x)): one norm, attention and MLP side by side."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = FusedAttention(args)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attention(h) + self.mlp(h)


class ToyDecoder(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab). A pipeline stage lacks the input ends
    (it takes hidden states) or the output ends (it returns them): see `toy_spec.pipeline_ends`."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings: nn.Module | None = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): ParallelBlock(args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, mask=None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("the toy decoder attends causally over the whole window; it takes no mask")
        h = tokens
        if self.tok_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
            h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device=None) -> None:
        """Every parameter drawn from (seed, its name) alone, whatever this part holds and however it
        is sharded: norms 1, the projections into the residual stream (wo, w2) scaled down with depth."""
        a = self.model_args
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                ones_(param)
            else:
                into_residual = name.endswith(("wo.weight", "w2.weight"))
                std = a.init_std / math.sqrt(2 * a.n_layers) if into_residual else a.init_std
                normal_(param, std=std, seed=seed, fqn=name)


# Tensor parallelism ------------------------------------------------------------------------------


class HeadMajorQKV(ParallelStyle):
    """The attention's fused (3, heads, head_dim, dim) parameter split on its heads (Shard(1)); the
    module reads its heads with to_local(). Its input, the normed residual stream, is whole on every
    rank and enters unchanged; in backward its gradient, which each rank computes from its own heads
    only, is summed over the ranks (Megatron's `f`). The output projection is a rowwise linear of
    its own (toy_sharding)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.register_parameter("qkv", nn.Parameter(distribute_tensor(module.qkv, mesh, [Shard(1)])))

        def sum_input_grad(mod, inputs):
            h, *rest = inputs
            # Identity forward; backward turns the local (Partial) gradient into the whole one (Replicate).
            h = DTensor.from_local(h, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return (h, *rest)

        module.register_forward_pre_hook(sum_input_grad)
        return module


def toy_sharding() -> ShardingPlan:
    """Plain TP: the residual stream is whole (Replicate) on every rank between blocks, so it ignores
    ShardOptions.sequence_parallel. The logits stay split over the vocabulary when
    ShardOptions.loss_parallel asks for it; the plan never does for this family's objective, whose
    label-smoothed loss needs whole logits (ToyCopy.vocab_parallel_loss: torch's loss_parallel()
    covers plain cross-entropy only; with label_smoothing, F.cross_entropy on Shard(-1) logits fails
    too, torch 2.13)."""
    whole = Replicate()
    return ShardingPlan(
        top={
            "tok_embeddings": lambda m, o: RowwiseParallel(input_layouts=whole, output_layouts=whole),
            "pos_embeddings": replicated,
            "norm": replicated,
            "output": lambda m, o: ColwiseParallel(output_layouts=Shard(-1) if o.loss_parallel else whole,
                                                   use_local_output=not o.loss_parallel),
        },
        block={
            "norm": replicated,
            "attention": lambda m, o: HeadMajorQKV(),
            "attention.wo": lambda m, o: RowwiseParallel(),
            "mlp.w1": lambda m, o: ColwiseParallel(),
            "mlp.w2": lambda m, o: RowwiseParallel(),
        },
    )


# ---------------------------------------------------------------------------------- the objective


@dataclass
class ToyCopyOptions:
    label_smoothing: float = opt(0.0, "label smoothing of the copy task's cross-entropy, in [0, 1)")

    def check(self) -> None:
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"toy_copy.label_smoothing must be in [0, 1), got {self.label_smoothing}")


class CopySamples:
    """Map-style: sample i is {"tokens": a window of seq_len ids whose second half repeats its first},
    the first half drawn below ALPHABET from (seed, split, i) alone."""

    SPLITS = ("train", "valid", "test")

    def __init__(self, seq_len: int, seed: int, split_name: str = "train"):
        self.seq_len, self.seed, self.split = seq_len, seed, self.SPLITS.index(split_name)

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        half = np.random.default_rng([self.seed, self.split, index]).integers(0, ToyCopy.ALPHABET, self.seq_len // 2)
        return {"tokens": np.concatenate([half, half])}


class ToyCopy(Objective):
    name = "toy_copy"
    vocab_parallel_loss = False  # its label-smoothed loss needs whole logits (see toy_sharding)
    ALPHABET = 64  # the copied ids are 0..63 of the tokenizer's vocabulary

    def __init__(self, options: ToyCopyOptions | None = None, **loss_options):
        super().__init__(**loss_options)
        self.options = options or ToyCopyOptions()
        self._loss = _smoothed_cross_entropy_sum
        if self._compile_backend is not None:
            self._loss = torch.compile(self._loss, backend=self._compile_backend)

    @classmethod
    def for_job(cls, cfg, args) -> ToyCopy:
        return cls(cfg.toy_copy, **compile_options(cfg))

    def _validate_job(self, cfg, dims, *, model: str) -> None:
        t = cfg.training
        if t.dataset != "default" or t.dataset_path:
            raise ValueError(f"toy_copy makes its own samples and reads no dataset: leave training.dataset at "
                             f"default and training.dataset_path unset (got {t.dataset!r})")
        if t.seq_len % 2:
            raise ValueError(f"toy_copy repeats the first half of every window: training.seq_len must be even, "
                             f"got {t.seq_len}")
        if dims.cp > 1:
            raise ValueError("toy_copy does not cut its samples for context parallelism (nor has the toy decoder "
                             "a context-parallel attention): set context_parallel_degree 1")
        for option in ("document_masking", "eod_mask_loss"):
            if getattr(t, option):
                raise ValueError(f"training.{option} applies to packed documents, which toy_copy samples are not; "
                                 f"remove it")

    def sample_fields(self, seq_len: int):
        return {"tokens": ((seq_len,), "int64")}

    def samples(self, dataset: str, *, seq_len, seed, split_name="train", **source_args) -> GlobalSamples:
        return GlobalSamples(CopySamples(seq_len, seed, split_name), shuffle=False,
                             fields=self.sample_fields(seq_len))

    def prepare(self, batch, ctx) -> Microbatch:
        """inputs: the whole window; labels: the next token where it lies in the second half (the
        copy), IGNORE_INDEX elsewhere."""
        tokens = batch["tokens"].to(ctx.device)
        half = tokens.shape[1] // 2
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:, half - 1:-1] = tokens[:, half:]
        return Microbatch(tokens, {"labels": labels}, target_count(labels))

    def loss(self, output: torch.Tensor, targets, ctx, *, correct: bool = False) -> LossTerms:
        labels = targets["labels"]
        return LossTerms(self._loss(output, labels, self.options.label_smoothing),
                         correct=next_token_correct(output, labels) if correct else None)


def _smoothed_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """(1 - s) x cross-entropy + s x the mean over the vocabulary of -log p, summed over the targets."""
    logp = logits.float().log_softmax(-1)
    target = labels != IGNORE_INDEX
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = (1 - smoothing) * nll - smoothing * logp.mean(-1)
    return (per_token * target).sum()


# ------------------------------------------------------- a test-only objective with a frozen companion


@dataclass
class ToyAnchorOptions:
    weight: float = opt(1.0, "weight of the KL from the frozen copy of the model as training started")


def anchor_logps(output, targets) -> dict[str, torch.Tensor]:
    """What the frozen companion adds: its log-probabilities over the vocabulary at every position."""
    return {"anchor_logps": output.float().log_softmax(-1)}


class ToyAnchoredCopy(ToyCopy):
    """The copy task, anchored to the model as it started: the copy loss plus `weight` x KL(anchor ||
    model) summed over the targets (reported apart as anchor_kl). It touches no file of titanlike/:
    its companion (a frozen copy) is declared, the trainer builds and runs it."""

    name = "toy_anchored_copy"
    reported_terms = ("anchor_kl",)

    def __init__(self, options: ToyAnchorOptions | None = None, copy: ToyCopyOptions | None = None, **loss_options):
        super().__init__(copy, **loss_options)
        self.anchor = options or ToyAnchorOptions()

    @classmethod
    def for_job(cls, cfg, args, *, family_objective=None, model: str = "the model") -> ToyAnchoredCopy:
        if not isinstance(family_objective, ToyCopy):
            raise ValueError(f"training.objective toy_anchored_copy trains the toy family's copy task; {model} trains "
                             f"with {family_objective.name}")
        return cls(cfg.toy_anchor, cfg.toy_copy, **compile_options(cfg))

    @property
    def companions(self) -> tuple[Companion, ...]:
        return (Companion("anchor", "training.objective toy_anchored_copy", Source.FROZEN_COPY, anchor_logps),)

    def loss(self, output: torch.Tensor, targets, ctx, *, correct: bool = False) -> LossTerms:
        copy = super().loss(output, targets, ctx, correct=correct)
        anchor = targets["anchor_logps"]
        trained = targets["labels"] != IGNORE_INDEX
        kl = (anchor.exp() * (anchor - output.float().log_softmax(-1))).sum(-1)
        kl = (kl * trained).sum()
        return LossTerms(copy.value + self.anchor.weight * kl, kl.detach().reshape(1), copy.correct)


# ---------------------------------------------------------------------------------- registration

toy_spec = ModelSpec(
    name="toy",
    model_cls=ToyDecoder,
    flavors={"tiny": ToyArgs()},
    shard=toy_sharding(),
    pipeline_ends=PipelineEnds(inputs=("tok_embeddings", "pos_embeddings"), outputs=("norm", "output")),
    objective=ToyCopy.name,
)

if "toy" not in model_names():  # importing this file under two module names registers once
    register_section("toy_copy", ToyCopyOptions)
    register_section("toy_anchor", ToyAnchorOptions)
    register_family_objective(ToyCopy.name, ToyCopy.for_job)
    register_model_spec(toy_spec)
    register_objective("toy_anchored_copy", ToyAnchoredCopy.for_job, section="toy_anchor")

__all__ = ["CopySamples", "HeadMajorQKV", "ToyAnchorOptions", "ToyAnchoredCopy", "ToyArgs", "ToyCopy", "ToyCopyOptions",
           "ToyDecoder", "anchor_logps", "toy_sharding", "toy_spec"]
