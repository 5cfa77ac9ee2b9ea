"""Generation with a KV cache: prefill the prompts in one pass, then one token per row per step.

The engine knows a model only through the generation hooks of models/protocol.py (init_cache,
prefill, decode_step): the family owns its cache (attention keys and values, MLA's latent, Mamba-2
states, T5's encoder output and decoder caches) and what a prompt means to it (T5: the encoder's
input, the decoder starting from its start token). Prompts of different lengths go in one batch
with per-row lengths (models/common/kv_cache.py): no left padding, no position shifting.

Each row ends on its own (stop token, stop string, max_new_tokens, the context); the batch steps
until every row has ended. Rows that ended keep being computed (their tokens are dropped) until half
the cache's rows or fewer still run; then the rows still running move to the first rows (copy_row,
every family's cache has it) and the steps compute a cache of those only: a batch whose lengths have
a long tail (GRPO's completions, rl/rollout.py) stops paying for its finished rows, in at most
log2(batch) sizes of step. Each row draws the random numbers it draws in the whole batch, so a seed
gives the same samples either way. Refilling ended rows at once with waiting prompts (continuous
batching, what a server needs) is ContinuousBatch (continuous.py), on the same hooks and stop rules.

Engine(compile=True) decodes with a torch.compile'd step on static caches (kv_cache.py, "Static"):
one graph per batch size for every step of every call, the prefill eager; on a GPU the step is
replayed as a CUDA graph (speed: docs/performance.md).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from titanlike.inference.low_precision import LowPrecisionCopy
from titanlike.inference.packed import PackedLinears
from titanlike.inference.sampling import SamplingParams, draw_uniforms, next_tokens, sampled_logprobs
from titanlike.models import protocol


class GenerationError(ValueError):
    """A request the model cannot serve (one sentence)."""


@dataclass
class Completion:
    """One prompt's continuation. tokens: the new token ids (a stop token, when one ended it, last);
    text: their text without the stop token and cut before a stop string (when a detokenizer was
    given); finish_reason: "stop" (a stop token or string), "length" (max_new_tokens) or "context"
    (the model's context is full); logprobs: with SamplingParams.logprobs, the log-probability of each
    token under the distribution it was drawn from (sampling.py sampled_logprobs), else None."""

    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[float] | None = None


@dataclass
class GenerationStats:
    """Timings of one generate call (seconds) and token counts."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    decode_steps: int = 0
    first_step_tokens: int = 0  # the rows that got their first token from the prefill

    @property
    def tokens_per_second(self) -> float:
        """New tokens of all rows per second of the whole call (prefill included)."""
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the decode steps (after the first token)."""
        decode_time = self.total_time - self.time_to_first_token
        return (self.new_tokens - self.first_step_tokens) / decode_time if decode_time > 0 else 0.0


class _TextStream:
    """A row's text so far, released only where it is final: not inside a multi-byte character
    still being spelled out, and not a possible start of a stop string."""

    def __init__(self, detokenize: Callable[[list[int]], str], stop_strings: tuple[str, ...]):
        self.detokenize, self.stop_strings = detokenize, stop_strings
        self.released = 0
        self.text = ""

    def update(self, tokens: list[int]) -> tuple[str, bool]:
        """(text newly final, whether a stop string appeared)."""
        text = self.detokenize(tokens)
        for stop in self.stop_strings:
            at = text.find(stop, max(0, self.released - len(stop)))
            if at >= 0:
                self.text = text[:at]
                return self._release(at), True
        self.text = text
        end = len(text.rstrip("\ufffd"))  # a replacement char at the end: a character in progress
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text[:end].endswith(stop[:n]):
                    end -= n
                    break
        return self._release(end), False

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        delta = self.text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return delta


def scores_only(model: nn.Module) -> str | None:
    """The sentence for a decoder whose head scores instead of predicting tokens (a reward model:
    models/protocol.py no_text_reason), None otherwise (an encoder is its caller's to name)."""
    if protocol.generation_hooks(model) is None:
        return None
    reason = protocol.no_text_reason(model, model.model_args)
    if reason is None:
        return None
    return (f"{type(model).__name__} cannot generate text: it {reason}; score text with titanlike.load_model, or "
            "export it to Hugging Face")


class Engine:
    """Generation for one model (one process, or one tensor-parallel rank of several: every rank
    runs the same steps and draws the same samples from the same seed)."""

    def __init__(self, model: nn.Module, *, context_len: int | None = None, start_id: int | None = None,
                 compile: bool = False, dtype: torch.dtype | None = None, compact: bool = True):
        """context_len: the longest sequence (default: the model's context). start_id: the decoder
        start token of an encoder-decoder model (its pad id; None: the model's default). compile:
        decode with a torch.compile'd step on caches of context_len slots (see below). dtype: generate
        in this precision from a copy of the weights (LowPrecisionCopy) when the model's differ (one
        process; a sharded model generates as it is). compact: once half a call's rows or fewer still
        run, decode those only (eager only; False: every row to the end, for comparison)."""
        hooks = protocol.generation_hooks(model)
        if hooks is None:
            raise GenerationError(f"{type(model).__name__} cannot generate text: it has no decoder to continue a "
                                  "prompt with (an encoder-only model such as BERT predicts masked tokens); use a "
                                  "decoder or encoder-decoder checkpoint")
        problem = scores_only(model)  # a reward model
        if problem is not None:
            raise GenerationError(problem)
        self.source = model  # the module whose weights generate (a copy follows it at every call)
        self.weights = None
        if dtype is not None and dtype != next(model.parameters()).dtype and LowPrecisionCopy.possible(model):
            self.weights = LowPrecisionCopy(model, dtype)
            model = self.weights.model
            init_cache, prefill, decode_step = protocol.generation_hooks(model)
            hooks = init_cache, self.weights.autocast(prefill), self.weights.autocast(decode_step)
        self.model = model.eval()
        self._init_cache, self.prefill, self.decode_step = hooks
        # Eager on a CPU, the linear layers run through oneDNN with prepacked weights (packed.py: 1.2-2.2x
        # MKL's speed where MKL takes a slow path). Not when compiled: inductor traces the modules, and
        # the background compile of a server (continuous.py) traces them while the eager steps run.
        self.packed = PackedLinears(model) if not compile else None
        if self.packed:
            self.prefill, self.decode_step = self.packed.wrap(self.prefill), self.packed.wrap(self.decode_step)
        first = next(model.parameters())
        # The cache holds keys and values as the steps compute them (bf16 under autocast).
        self.device, self.dtype = first.device, self.weights.dtype if self.weights else first.dtype
        self.context_len = context_len or model.model_args.context_len
        self.start_id = start_id
        self.compiled = compile
        # Compiled, the call's rows stay where they are: each smaller batch would be another static cache
        # of context_len slots and another compile (on a GPU another CUDA graph), for a step that on a GPU
        # is memory-bound at these batch sizes (it reads its weights once whatever its rows:
        # docs/performance.md), where fewer rows save little.
        self.compact = compact and not compile
        self.eager_step = self.decode_step  # the hook itself: what a continuous batch serves with while it compiles
        self._cache = None  # compiled: the static cache the last call decoded in (kept for the next)
        if compile:
            # Static shapes: every cache holds context_len slots and a decode step reads them all
            # (ModelCache.static), so the one-token step is one graph for every step of every call
            # (a new batch size compiles once more). The prefill stays eager: its length varies
            # with the prompts, and it runs once per call. dynamic=False: a new batch size gets a
            # graph of its own rather than a symbolic one. On a GPU, "reduce-overhead" replays the
            # step as a CUDA graph: one launch instead of a few hundred kernels' (a decode step of
            # a model this size is launch overhead; transformers' static cache does the same). One
            # process only: a tensor-parallel step's collectives inside a CUDA graph have not run on
            # the machines this was checked on (one GPU), so several ranks compile without graphs.
            alone = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
            mode = "reduce-overhead" if self.device.type == "cuda" and alone else None
            self.decode_step = torch.compile(self.decode_step, dynamic=False, mode=mode)

    def init_cache(self, batch_size: int, capacity: int, *, device, dtype):
        """The model's cache (the init_cache hook), static when the decode step is compiled."""
        cache = self._init_cache(batch_size, capacity, device=device, dtype=dtype)
        cache.static = self.compiled
        return cache

    def decode(self, tokens: torch.Tensor, cache, *, eager: bool = False) -> torch.Tensor:
        """One decode step (the decode_step hook, compiled or not; eager: the hook itself, on a cache that
        is not static): logits (batch, vocab). A CUDA-graphed step's logits live until the next step,
        which overwrites them: read them first."""
        if eager:
            return self.eager_step(tokens, cache)
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        return self.decode_step(tokens, cache)

    def _call_cache(self, batch_size: int, capacity: int):
        """A cache for one generate call: compiled, the last call's static cache when it has this batch
        size, which the prefill rewrites (its tensors keep their addresses, so a recorded CUDA graph of
        the step stays valid), else a new one that replaces it (one cache's memory at a time)."""
        if not self.compiled:
            return self.init_cache(batch_size, capacity, device=self.device, dtype=self.dtype)
        if self._cache is None or (self._cache.batch_size, self._cache.capacity) != (batch_size, capacity):
            self._cache = None  # freed before the new one is allocated
            self._cache = self.init_cache(batch_size, capacity, device=self.device, dtype=self.dtype)
        return self._cache

    @staticmethod
    def _compacted(cache, rows: list[int]):
        """A cache of `rows` of `cache` only, in their order: the rows moved down into the first ones
        (each family's copy_row), then a cache of those (ModelCache.head, views of the same tensors), as
        the continuous batch keeps its sequences (continuous.py). The decode steps that follow compute
        those rows only, in the memory the call already holds: a new cache would hold both at once."""
        for row, source_row in enumerate(rows):
            if row != source_row:  # rows ascend: each is read before a row moved down overwrites it
                cache.copy_row(row, cache, source_row)
        return cache.head(len(rows))

    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """GenerationError, one sentence, for prompts the model cannot continue."""
        if not prompts:
            raise GenerationError("no prompts were given")
        for i, prompt in enumerate(prompts):
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            if len(prompt) == 0:
                raise GenerationError(f"{which} is empty: give at least one token (a BOS token for an empty text)")
            if len(prompt) >= self.context_len:
                raise GenerationError(f"{which} has {len(prompt)} tokens, which leaves no room in the model's context "
                                      f"of {self.context_len} tokens; shorten it to at most {self.context_len - 1}")

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 detokenize: Callable[[list[int]], str] | None = None,
                 on_text: Callable[[int, str], None] | None = None,
                 on_token: Callable[[int, int], None] | None = None,
                 fields: Mapping[str, torch.Tensor] | None = None) -> tuple[list[Completion], GenerationStats]:
        """Continue every prompt (lists of token ids). detokenize (token ids -> text) gives each
        completion its text and makes stop strings work; on_text(row, text) receives each row's text
        as it becomes final (streaming), on_token(row, id) each new token. fields: the prompts' other
        inputs the model's prefill takes, one row per prompt (a vision-language model's pixel_values,
        made by the Processor, processor.py)."""
        self.check_prompts(prompts)
        fields = {name: value.to(self.device) for name, value in (fields or {}).items()}
        unknown = sorted(set(fields) - set(inspect.signature(self.prefill).parameters))
        if unknown:
            raise GenerationError(f"{type(self.model).__name__} takes no {unknown[0]} input with its prompts")
        if params.stop_strings and detokenize is None:
            raise GenerationError("stop strings need a detokenizer (token ids -> text)")
        started = time.perf_counter()
        if self.weights:
            self.weights.refresh()  # the source's weights may have changed since the last call
        if self.packed:
            self.packed.refresh()  # the weights may have changed since the last call (packed.py)
        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        # Compiled, every call's cache has the one fixed length (a graph per length otherwise).
        capacity = self.context_len if self.compiled else min(self.context_len, longest + params.max_new_tokens)
        tokens = torch.zeros(batch, longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        tokens = tokens.to(self.device)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        cache = self._call_cache(batch, capacity)
        # Rows with the same prompt (GRPO's G completions of each prompt) share one prefill: the
        # distinct prompts fill a cache of their own, copied row by row (copy_row).
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(p), len(first)) for p in prompts]
        shared = len(first) < batch and not fields  # with fields (an image), equal ids are not equal prompts
        rows = [source.index(i) for i in range(len(first))] if shared else list(range(batch))
        prefilled = self._init_cache(len(rows), capacity, device=self.device, dtype=self.dtype) if shared else cache
        logits = self.prefill(tokens[rows], torch.tensor(lengths, device=self.device)[rows], prefilled,
                              start_id=self.start_id, **fields)
        if shared:
            for row, i in enumerate(source):
                cache.copy_row(row, prefilled, i)
            logits = logits[source]
        seen = None
        if params.repetition_penalty != 1.0:
            # (batch, vocab): the tokens each row holds, which the penalty discourages.
            seen = torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=self.device)
            for row, prompt in enumerate(prompts):
                seen[row, torch.as_tensor(list(prompt), device=self.device)] = True
        completions = [Completion(logprobs=[] if params.logprobs else None) for _ in prompts]
        streams = [_TextStream(detokenize, params.stop_strings) if detokenize else None for _ in prompts]
        stats = GenerationStats(prompt_tokens=sum(lengths))
        prompt_of = list(range(batch))  # the prompt each row of the cache (and of logits, seen) continues
        live = None  # prompt_of on the device, once the cache has fewer rows than prompts
        active = list(range(batch))  # the cache's rows whose prompt has not ended
        step = 0
        while True:
            # Every prompt's random number, the cache's rows' taken: a row draws what it draws in a batch
            # that never shrinks (sampling.py draw).
            u = None if params.greedy else draw_uniforms(batch, generator, self.device)
            chosen = next_tokens(logits, params, seen=seen, generator=generator,
                                 uniforms=u if u is None or live is None else u[live])
            logprobs = sampled_logprobs(logits, chosen, params, seen=seen).tolist() if params.logprobs else None
            if seen is not None:
                seen.scatter_(1, chosen[:, None], True)
            ids = chosen.tolist()  # the one host sync of a step (two with logprobs)
            if step == 0:
                stats.time_to_first_token = time.perf_counter() - started
                stats.first_step_tokens = len(active)
            still = []
            for i in active:
                row = prompt_of[i]
                if logprobs is not None:
                    completions[row].logprobs.append(logprobs[i])
                done = self._append(row, ids[i], completions[row], streams[row], params, lengths[row], on_text,
                                    on_token)
                if not done:
                    still.append(i)
            active = still
            step += 1
            if not active:
                break
            if self.compact and 2 * len(active) <= cache.batch_size:
                # Half the rows or fewer still run: the steps that follow decode those only.
                cache = self._compacted(cache, active)
                keep = torch.tensor(active, device=self.device)
                chosen = chosen[keep]
                seen = seen[keep] if seen is not None else None
                prompt_of = [prompt_of[i] for i in active]
                live = torch.tensor(prompt_of, device=self.device)
                active = list(range(len(active)))
            logits = self.decode(chosen, cache)
            stats.decode_steps += 1
        for row, completion in enumerate(completions):
            if streams[row] is not None:
                rest = streams[row].finish()
                if rest and on_text is not None:
                    on_text(row, rest)
                completion.text = streams[row].text
        stats.new_tokens = sum(len(c.tokens) for c in completions)
        stats.total_time = time.perf_counter() - started
        return completions, stats

    def _append(self, row: int, token: int, completion: Completion, stream: _TextStream | None,
                params: SamplingParams, prompt_len: int, on_text, on_token) -> bool:
        """Record a row's new token; True when the row has ended."""
        completion.tokens.append(token)
        if on_token is not None:
            on_token(row, token)
        if token in params.stop_token_ids:
            completion.finish_reason = "stop"
            if stream is not None:
                stream.text = stream.detokenize(completion.tokens[:-1])
            return True
        if stream is not None:
            delta, stopped = stream.update(completion.tokens)
            if delta and on_text is not None:
                on_text(row, delta)
            if stopped:
                completion.finish_reason = "stop"
                return True
        if len(completion.tokens) >= params.max_new_tokens:
            completion.finish_reason = "length"
            return True
        if prompt_len + len(completion.tokens) >= self.context_len:
            completion.finish_reason = "context"
            return True
        return False


@torch.no_grad()
def uncached_logits(model: nn.Module, prompt: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """The reference a cache must equal: the logits (len(continuation) + 1, vocab) of the token after
    prompt + continuation[:i] for every i, each from a full forward over the whole sequence."""
    from titanlike.models.outputs import logits_of

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(continuation)], device=device)
    logits = logits_of(model(ids))[0].float()
    return logits[len(prompt) - 1:]


__all__ = ["Completion", "Engine", "GenerationError", "GenerationStats", "scores_only", "uncached_logits"]
