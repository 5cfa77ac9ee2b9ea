"""What every model family must do, checked once for every registered family and flavor (the
test-only toy family of tests/toy_family.py included): a family's own test file keeps only what is
unique to it.

- Sizes (every flavor, on meta): args.num_params() counts the module's parameters (a tied table
  once); exclude_embedding leaves out exactly the lookup tables (embeddings not tied to an output
  projection); active leaves out the routed experts a token does not use; released flavors match
  their published counts (tests/conformance/published.py).
- Initialization (the smallest debug flavor of each distinct structure, materialized as the trainer does: meta, to_empty, init_weights): a
  pure function of the seed (the same seed gives the same values, another seed other values for
  every parameter that is not a constant), and it reaches every parameter.
- Forward and backward on the family's own objective (its samples of the embedded corpus, prepared
  as the trainer prepares them): logits for every label, a finite loss, and a finite gradient that is
  not zero for every parameter (routed experts may be left unrouted by a small batch).
- Causality, for families whose objective predicts the next token: changing the tokens from a
  position on leaves the logits before it untouched and moves every logit after it.
- Generation (families with the generation hooks): the engine's compaction moves the rows still
  running into a smaller cache (the family's copy_row) without changing a seeded call's samples.
- Pipeline stages (families with pipeline ends): the stages of each schedule's split are
  initialized as the same-named parameters of the whole model and, chained, compute what it
  computes; each end lives on its own stage only.
- Objective samples: the fields the loader yields are the ones the objective declares, a pure
  function of (seed, index); its prepared labels are token ids or ignored, with targets in every
  batch; under context parallelism each rank's inputs, labels and token fields are the whole
  sequence's at the rank's positions.
- Hugging Face round trip (families with an adapter): weights to HF's names and back, args to
  config.json and back.
The model contract and its hooks: tests/unit/test_module_protocol.py; each adapter's config rules:
tests/unit/test_hf_config_rules.py; numerics against transformers: the family's own HF tests.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from family_checks import (
    SEQ,
    check_stages_initialized_as_full,
    distinct_flavors,
    family_flavors,
    held_params,
    init_pipeline_stages,
    loader_batch,
    logits_of,
    materialize,
    microbatch,
    plan_family,
    run_stages,
)
from published import PUBLISHED, UNPUBLISHED
from titanlike.models import protocol
from titanlike.models.common.moe import MoE
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives.base import BatchContext
from titanlike.models.registry import get_model_spec, model_names

ALL = family_flavors()
DEBUG = distinct_flavors()  # the smallest debug flavor of each distinct structure
# Lookup tables that are not nn.Embedding modules (module names): T5's relative-position biases.
OTHER_LOOKUPS = {"t5": ("encoder_relative_bias", "decoder_relative_bias")}


def _meta(family: str, args) -> nn.Module:
    with torch.device("meta"):
        return get_model_spec(family).model_cls(args)


def lookup_parameters(family: str, model: nn.Module) -> int:
    """Parameters of the lookup tables: nn.Embedding weights no other module uses (a table tied to the
    output projection does matmul work) and the family's other lookups."""
    tables = {id(p): p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    for name in OTHER_LOOKUPS.get(family, ()):
        tables.update({id(p): p for p in model.get_submodule(name).parameters()})
    used = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Embedding)
            and name not in OTHER_LOOKUPS.get(family, ()) for p in m.parameters(recurse=False)}
    return sum(p.numel() for key, p in tables.items() if key not in used)


def unused_expert_parameters(args, model: nn.Module) -> int:
    """Routed-expert parameters a token does not use: (num_experts - top_k) / num_experts of them."""
    moe = args.moe_args()
    routed = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
    assert (moe is None) == (routed == 0), "moe_args() and the module's MoE layers disagree"
    return 0 if moe is None else routed * (moe.num_experts - moe.top_k) // moe.num_experts


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("family, flavor", ALL)
def test_num_params_counts_the_module(family, flavor):
    args = get_model_spec(family).flavors[flavor]
    model = _meta(family, args)
    total = held_params(model)
    assert args.num_params() == total
    assert list(model.layers.keys()) == [str(i) for i in range(args.total_layers)]
    assert args.num_params(exclude_embedding=True) == total - lookup_parameters(family, model)
    assert args.num_params(active=True) == total - unused_expert_parameters(args, model)


@pytest.mark.parametrize("family, flavor", [key for key in ALL if key in PUBLISHED])
def test_released_flavors_have_their_published_size(family, flavor):
    published = PUBLISHED[family, flavor]
    args = dataclasses.replace(get_model_spec(family).flavors[flavor], **published.changes)
    assert published.total.holds(args.num_params()), (args.num_params(), published.total)
    if published.active is not None:
        assert published.active.holds(args.num_params(active=True)), (args.num_params(active=True), published.active)
    else:
        assert args.num_params(active=True) == args.num_params()


def test_every_released_flavor_has_a_published_size():
    """A flavor not named debug* is a released model (its count is in published.py) or says why not;
    every family but the test-only one has a released flavor."""
    released = {key for key in ALL if not key[1].startswith("debug")}
    assert not released - set(PUBLISHED) - set(UNPUBLISHED), sorted(released - set(PUBLISHED) - set(UNPUBLISHED))
    assert not (set(PUBLISHED) | set(UNPUBLISHED)) - set(ALL), "published.py names flavors that no longer exist"
    # The library's families: tests register their own (tests/toy_family.py, test_objective_seam.py's), in
    # whatever order the suite (or a worker of it) runs them.
    library = {name for name in model_names() if get_model_spec(name).model_cls.__module__.startswith("titanlike.")}
    assert {family for family, _ in PUBLISHED} == library


# ---------------------------------------------------------------- materialized: init, forward, backward


class Case:
    """A debug flavor's job planned as train.py plans it (vocabulary from the job's tokenizer), one
    loader batch of its objective, and that batch prepared for the model."""

    _cache: dict[tuple[str, str], Case] = {}

    def __init__(self, family: str, flavor: str):
        self.family, self.flavor = family, flavor
        self.spec = get_model_spec(family)
        self.plan = plan_family(family, flavor)
        self.args = self.plan.model_args
        self.batch = loader_batch(self.plan)
        self.mb = microbatch(self.plan, self.batch)

    @classmethod
    def of(cls, family: str, flavor: str) -> Case:
        if (family, flavor) not in cls._cache:
            cls._cache[family, flavor] = cls(family, flavor)
        return cls._cache[family, flavor]

    def build(self, seed: int = 0) -> nn.Module:
        return materialize(self.spec.model_cls, self.args, seed=seed)

    def forward(self, model: nn.Module, inputs: torch.Tensor | None = None):
        return model(self.mb.inputs if inputs is None else inputs, **self.mb.forward_kwargs())


@pytest.mark.parametrize("family, flavor", DEBUG)
def test_init_is_a_function_of_the_seed(family, flavor):
    case = Case.of(family, flavor)
    a, b, c = case.build(seed=7), case.build(seed=7), case.build(seed=8)
    others = dict(c.named_parameters())
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        constant = torch.all(p == p.flatten()[0]) and torch.all(others[name] == p.flatten()[0])
        if not constant:
            assert not torch.equal(p, others[name]), f"{name} does not depend on the seed"
    for (name, buf), other in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(buf, other), name
    # Distinct parameters of equal shape do not share values (each is seeded by its own name).
    drawn = {}
    for name, p in a.named_parameters():
        if not torch.all(p == p.flatten()[0]):
            key = (tuple(p.shape), p.flatten()[:8].tolist().__repr__())
            assert key not in drawn, f"{name} holds the values of {drawn[key]}"
            drawn[key] = name


@pytest.mark.parametrize("family, flavor", DEBUG)
def test_init_reaches_every_parameter(family, flavor):
    case = Case.of(family, flavor)
    model = _meta(family, case.args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights(seed=0)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"init_weights leaves {name} unset"


@pytest.mark.parametrize("family, flavor", DEBUG)
def test_forward_and_backward_on_the_objective(family, flavor):
    case = Case.of(family, flavor)
    model = case.build().train()
    output = case.forward(model)
    logits = logits_of(output)
    labels = case.mb.targets["labels"]
    assert labels.dtype == torch.int64 and logits.shape == (*labels.shape, case.args.vocab_size)
    loss = case.plan.objective.loss(output, case.mb.targets, BatchContext(torch.device("cpu"))).value
    targets = int((labels != IGNORE_INDEX).sum())
    assert int(case.mb.units) == targets
    assert loss.dim() == 0 and math.isfinite(loss.item()) and targets > 0
    # At init the model is close to uniform over the vocabulary: the summed loss is about ln V per target.
    assert 0.5 * math.log(case.args.vocab_size) < loss.item() / targets < 2 * math.log(case.args.vocab_size)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} gets no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}'s gradient is not finite"
        if ".experts." not in name:  # routed experts: a small batch may leave one unrouted
            assert p.grad.abs().sum() > 0, f"{name}'s gradient is zero"


@pytest.mark.parametrize("family, flavor", DEBUG)
def test_causal_families_see_only_the_past(family, flavor):
    case = Case.of(family, flavor)
    if case.plan.objective.generation is None:
        pytest.skip(f"{family} does not predict the next token (its own tests check its attention)")
    model = case.build().eval()
    tokens = case.mb.inputs
    t = tokens.shape[1] // 2 - 3
    changed = tokens.clone()
    changed[:, t:] = (changed[:, t:] + 1) % case.args.vocab_size
    with torch.no_grad():
        before, after = logits_of(model(tokens)), logits_of(model(changed))
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 1e-4


# ---------------------------------------------------------------- generation


def _generates(family: str, flavor: str) -> bool:
    spec = get_model_spec(family)
    with torch.device("meta"):
        return protocol.generation_hooks(spec.model_cls(spec.flavors[flavor])) is not None


GENERATING = [key for key in DEBUG if _generates(*key)]


@pytest.mark.parametrize("family, flavor", GENERATING)
def test_generation_compacts_the_cache_of_the_rows_still_running(family, flavor):
    """The engine's compaction (inference/engine.py) moves the rows still running into a smaller cache
    with the family's copy_row, twice here: each prompt then gets the sampled tokens (repetition penalty
    on) and the log-probabilities (within 1e-5) of a call that decodes every row to the end."""
    from titanlike.inference import Engine, SamplingParams

    spec = get_model_spec(family)
    model = materialize(spec.model_cls, spec.flavors[flavor], seed=0).eval()
    g = torch.Generator().manual_seed(0)
    # 8 rows: 3 prompts of their own lengths and rows sharing a prompt (a shared prefill); ids from 3 to
    # 255, below every family's special and image placeholder ids. 12 new tokens pass the 16-token
    # sliding windows of the debug flavors (gemma3, gpt_oss).
    distinct = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 3, 12)]
    prompts = [distinct[i % 3] for i in range(6)] + [distinct[0][:5], distinct[2][:9]]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, logprobs=True, repetition_penalty=1.3)
    first, _ = Engine(model, compact=False).generate(prompts, params)
    # Tokens the rows draw as stop ids: half the rows end within 3 tokens, two more by the 9th.
    stop = {first[row].tokens[t] for row, t in enumerate([1, 2, 1, 2, 5, 8])}
    params = dataclasses.replace(params, stop_token_ids=stop)
    plain, _ = Engine(model, compact=False).generate(prompts, params)
    engine = Engine(model)
    rows, real = [], engine.decode_step
    engine.decode_step = lambda tokens, cache: rows.append(cache.batch_size) or real(tokens, cache)
    compacted, _ = engine.generate(prompts, params)
    assert [c.tokens for c in compacted] == [c.tokens for c in plain], family
    for ours, theirs in zip(compacted, plain):
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=0)
    assert rows[0] == len(prompts) and len(set(rows)) >= 3, (family, rows)


# ---------------------------------------------------------------- pipeline stages


def _stage_cases():
    out = []
    for family, flavor in distinct_flavors(min_layers=4):
        if get_model_spec(family).pipeline_ends is not None:
            out += [(family, flavor, schedule) for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")]
    return out


@pytest.mark.parametrize("family, flavor, schedule", _stage_cases())
def test_pipeline_stages_compose_to_the_whole_model(family, flavor, schedule):
    from titanlike.models.outputs import LossReports
    from titanlike.parallel.pipeline import end_module, plan_layout

    case = Case.of(family, flavor)
    args, ends = case.args, case.spec.pipeline_ends
    try:
        layout = plan_layout(args.num_layers, 2, schedule, None)
    except ValueError as e:
        pytest.skip(f"{family} {flavor} does not split for {schedule}: {e}")
    full = _meta(family, args)
    parts = init_pipeline_stages(full, case.spec, layout, seed=3)
    check_stages_initialized_as_full(parts, full, seed=3)  # materializes full with the same seed
    last = layout.num_stages - 1
    for stage, part in parts.items():
        for name in ends.inputs:
            assert (end_module(part, name) is not None) == (stage == 0 and end_module(full, name) is not None), (
                stage, name)
        for name in ends.outputs:
            assert (end_module(part, name) is not None) == (stage == last and end_module(full, name) is not None), (
                stage, name)
        # Tied weights the split keeps: one Parameter per name, or a copy the pipeline syncs.
        held = dict(part.named_parameters(remove_duplicate=False))
        for alias, owner in getattr(part, "tied_weights", {}).items():
            if alias in held and owner in held:
                assert held[alias] is held[owner], (stage, alias)
    full.train()
    with torch.no_grad():
        want = case.forward(full)
        got = run_stages(parts, case.mb.inputs, **case.mb.forward_kwargs())  # only the ends read the fields
    torch.testing.assert_close(logits_of(got), logits_of(want), rtol=0, atol=0)
    reported = args.reported_losses()
    if reported:  # the loss terms a module adds (BERT's binary loss, DeepSeek's MTP) on the last stage
        whole = LossReports([full], reported, torch.device("cpu")).collect()
        staged = LossReports(list(parts.values()), reported, torch.device("cpu")).collect()
        torch.testing.assert_close(staged, whole, rtol=0, atol=0)


# ---------------------------------------------------------------- Hugging Face round trip


HF_CASES = [key for key in DEBUG if get_model_spec(key[0]).hf is not None]


@pytest.mark.parametrize("family, flavor", HF_CASES)
def test_hf_adapter_round_trips_weights_and_config(family, flavor):
    """args -> config.json -> args' gives the same config.json again; our weights -> HF's names ->
    weights of args' load strictly into a model of args' and are the same tensors (what HF's model
    has no place for, e.g. a training-only module, is not exported: args' leaves it out). An
    adapter that cannot export a flavor says so in one sentence. Numerics against transformers'
    own classes: each family's HF tests."""
    case = Case.of(family, flavor)
    hf = case.spec.hf
    model = case.build(seed=5)
    ours = model.state_dict()
    try:
        config = hf.args_to_config(case.args)
        hf_sd = hf.to_hf_state_dict(ours, case.args)
    except ValueError as e:
        assert len(str(e).splitlines()) == 1 and "export" in str(e), e
        return
    assert config["model_type"] in hf.model_types
    args = hf.read_config(config)
    assert hf.args_to_config(args) == config
    assert hf_sd and all(isinstance(v, torch.Tensor) for v in hf_sd.values())
    back = materialize(case.spec.model_cls, args, seed=6)
    loaded = hf.from_hf_state_dict(hf_sd, args)
    for alias, owner in protocol.tied_weights(back).items():
        # DeepSeek's adapter leaves out its MTP embedding (an alias of the table): one Parameter anyway.
        if owner in loaded:
            loaded.setdefault(alias, loaded[owner])
    back.load_state_dict(loaded, strict=True)
    for name, value in back.state_dict().items():
        torch.testing.assert_close(value, ours[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- objective samples


FAMILIES = [(family, min(get_model_spec(family).flavors, key=lambda f: get_model_spec(family).flavors[f].num_params()))
            for family in model_names()]


@pytest.mark.parametrize("family, flavor", FAMILIES)
def test_objective_samples_and_batches(family, flavor):
    from titanlike.parallel.context import load_balanced_positions

    case = Case.of(family, flavor)
    objective = case.plan.objective
    want = objective.sample_fields(SEQ)
    assert {k: (tuple(v.shape), str(v.dtype)) for k, v in case.batch.items()} == {
        k: ((2, *shape), f"torch.{dtype}") for k, (shape, dtype) in want.items()}
    # A pure function of (seed, index): the same batch again, another batch for another seed.
    again, other = loader_batch(case.plan), loader_batch(case.plan, seed=1)
    assert all(torch.equal(again[k], v) for k, v in case.batch.items())
    assert not all(torch.equal(other[k], v) for k, v in case.batch.items())
    labels = case.mb.targets["labels"]
    targets = labels != IGNORE_INDEX
    assert targets.any() and bool(((labels >= 0) & (labels < case.args.vocab_size))[targets].all())
    # Context parallelism: each rank's slice of the whole sequence, where the objective allows it.
    try:
        plan_family(family, flavor, "--parallelism.context_parallel_degree", "2", world_size=2)
    except ValueError as e:
        pytest.skip(f"no context parallelism for {family}: {e}")
    seq = case.mb.inputs.shape[1]
    token_fields = getattr(objective, "token_fields", ())
    for rank in range(2):
        positions = load_balanced_positions(seq, 2, rank)
        cut = microbatch(case.plan, case.batch, cp_positions=positions)
        assert torch.equal(cut.inputs, case.mb.inputs[:, positions]) and torch.equal(cut.targets["labels"], labels[:, positions])
        for name in token_fields:
            assert torch.equal(cut.fields[name], case.mb.fields[name][:, positions]), name
        for name in set(case.mb.fields) - set(token_fields):
            assert torch.equal(cut.fields[name], case.mb.fields[name]), name
