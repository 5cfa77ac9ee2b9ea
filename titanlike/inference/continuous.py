"""Continuous batching: a fixed number of rows (slots) decoded together, each refilled as soon as its
sequence ends, so a server's concurrent requests share every decode step (Orca's iteration-level
scheduling, as vLLM and Megatron-Core's dynamic engine do it).

One step: sequences that were cancelled leave their slots; waiting sequences take the free slots
(their prompts prefilled together in a cache of their own, then copied into the slots:
ModelCache.copy_row, every family's cache provides it); then one decode step over the rows that
hold a sequence. The sequences are kept in the first rows (a row that ends is refilled by a waiting
sequence, or else takes the last row's, moved with copy_row), so the step runs on a head of the
cache (ModelCache.head). Eager, it is exactly those rows, and attention reads the slots the longest
row has. Compiled, it is the smallest of a few row counts that holds them (1, 4, 16, ..., slots;
rows past the sequences are reset to length 0 and their tokens dropped) and the smaller of two slot
counts (capacity / 4, capacity) that holds the longest row, so the step keeps a few shapes.

Why a head of one cache rather than a paged cache with a block table (vLLM's): the work of a step
then follows the live requests and their lengths, every family's cache keeps its own layout (a row
moves with the copy_row it already has), and a step gathers nothing; a paged cache would also bound
the memory by the tokens held rather than slots x capacity, which matters for long contexts on a
GPU, not for the sizes served here.

Each sequence samples with its own settings and its own seeded generator, so what it gets does not
depend on what else is in the batch: a greedy sequence gets what Engine.generate gives it alone, and
a seeded one draws what Engine.generate draws for it alone with that seed.

Compiling takes a minute on CPU (docs/performance.md), so a server need not wait for it:
compile_in_background() compiles the shapes in a thread of its own, the smallest first (one row, the
shorter slot bucket: a lone request's), on a scratch cache of the same layout, so the compiled step
never touches the cache the serving thread steps; until a shape is ready (or when its compile
failed) a step of that shape runs the eager hook on exactly the rows in use, as an eager engine does.

Thread use (a server): submit() and cancel() from any thread; step() from one thread only (the one
that owns the model). Callbacks run on the stepping thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from titanlike.inference.engine import Completion, Engine, GenerationError, _TextStream
from titanlike.inference.sampling import SamplingParams, next_tokens

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    """One prompt being continued. on_text(seq, text) gets its text as it becomes final, on_token(seq,
    id) each new token, on_done(seq) is called once when it ended (completion.finish_reason set:
    "stop", "length", "context", "cancelled", or "error" with `error` the exception)."""

    prompt: list[int]
    params: SamplingParams
    detokenize: Callable[[list[int]], str] | None = None
    on_text: Callable[[Sequence, str], None] | None = None
    on_token: Callable[[Sequence, int], None] | None = None
    on_done: Callable[[Sequence], None] | None = None
    completion: Completion = field(default_factory=Completion)
    id: int = 0
    slot: int | None = None
    error: BaseException | None = None
    cancelled: bool = False
    done: bool = False
    _stream: _TextStream | None = None
    _generator: torch.Generator | None = None


class ContinuousBatch:
    """`slots` rows of up to `capacity` tokens (default: the engine's context) decoded together."""

    def __init__(self, engine: Engine, slots: int, capacity: int | None = None):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.engine, self.slots = engine, slots
        self.capacity = min(capacity or engine.context_len, engine.context_len)
        self.cache = engine.init_cache(slots, self.capacity, device=engine.device, dtype=engine.dtype)
        # The shapes a compiled step takes (_shape): a few row counts (1, 4, 16, ..., slots) and two
        # slot counts, since each is a graph of its own and torch compiles at most 8 shapes of one
        # function before it runs it eagerly (torch._dynamo.config.cache_size_limit).
        self.row_buckets = sorted({min(4 ** k, slots) for k in range(slots.bit_length())} | {slots})
        self.slot_buckets = sorted({max(1, self.capacity // 4), self.capacity})
        self.rows: list[Sequence | None] = [None] * slots
        self.waiting: deque[Sequence] = deque()
        self._admitting: list[Sequence] = []  # taken from waiting, not yet in a row
        self.seen: torch.Tensor | None = None  # (slots, vocab) bool, once a sequence has a repetition penalty
        self.last = torch.zeros(slots, dtype=torch.long, device=engine.device)  # each row's newest token
        self.work = threading.Condition()
        self._ids = itertools.count(1)
        self.steps = 0  # decode steps taken (statistics: a server's /health)
        self.compiled_steps = 0  # of those, the ones the compiled step took
        # compile_in_background: the shapes compiled so far (None: every shape is the compiled step's,
        # compiled when first met unless warm_up did it), the thread, and what stops it.
        self.ready: set[tuple[int, int]] | None = None
        self._compiler: threading.Thread | None = None
        self._stop_compiling = threading.Event()
        self.cancelled = 0  # sequences ended by cancel() before they were done

    # Any thread ------------------------------------------------------------------------------------

    def submit(self, prompt: Seq[int], params: SamplingParams, *, detokenize=None, on_text=None, on_token=None,
               on_done=None) -> Sequence:
        """Queue a prompt (GenerationError, one sentence, for one the model cannot continue)."""
        self.engine.check_prompts([prompt])
        if len(prompt) >= self.capacity:
            raise GenerationError(f"the prompt has {len(prompt)} tokens, which leaves no room in the {self.capacity} "
                                  f"tokens a sequence may hold; shorten it to at most {self.capacity - 1}")
        if params.stop_strings and detokenize is None:
            raise GenerationError("stop strings need a detokenizer (token ids -> text)")
        seq = Sequence(list(prompt), params, detokenize, on_text, on_token, on_done, id=next(self._ids))
        with self.work:
            self.waiting.append(seq)
            self.work.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """End a sequence at the next step (its slot is freed then); a no-op once it has ended."""
        with self.work:
            seq.cancelled = True
            self.work.notify_all()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a sequence is waiting or running (True) or the timeout passed (False)."""
        with self.work:
            return self.work.wait_for(self.busy, timeout)

    def busy(self) -> bool:
        return bool(self.waiting) or any(seq is not None for seq in self.rows)

    @property
    def active(self) -> int:
        return sum(seq is not None for seq in self.rows)

    # The stepping thread -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Free cancelled sequences' slots, admit waiting sequences, then one decode step."""
        with self.work:
            for row, seq in enumerate(self.rows):
                if seq is not None and seq.cancelled:
                    self._end(seq, "cancelled")
            for seq in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(seq)
                self._end(seq, "cancelled")
            free = [row for row, seq in enumerate(self.rows) if seq is None]
            admitted = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        if admitted:
            self._admitting = admitted  # ended by fail_all too, should the prefill raise
            self._admit(admitted, free)
            self._admitting = []
        self._compact()
        live = self.active  # rows 0..live - 1 (_compact)
        if not live:
            return
        self.cache.reset_rows(list(range(live, self.slots)))
        rows, slots = self._shape(live)
        eager = slots is not None and self.ready is not None and (rows, slots) not in self.ready
        if eager:  # its compile is not ready (or failed): the eager step over the rows in use
            head = self.cache.head(live, static=False)
            logits = self.engine.decode(self.last[:live], head, eager=True)
        else:
            head = self.cache.head(rows, slots)
            logits = self.engine.decode(self.last[:rows], head)
        head.write_back()
        self.steps += 1
        if self.cache.static and not eager:
            self.compiled_steps += 1
        self._sample(logits[:live], list(range(live)))

    def _shape(self, live: int) -> tuple[int, int | None]:
        """The rows and slots a decode step over `live` sequences takes: exactly those rows, and the
        slots the longest row has (ModelCache.begin_decode), when eager; the smallest buckets that
        hold them when the step is compiled (a static cache reads all the slots it is given)."""
        if not self.cache.static:
            return live, None
        rows = next(b for b in self.row_buckets if b >= live)
        slots = next((b for b in self.slot_buckets if b > self.cache.host_max_length), self.capacity)
        return rows, slots

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, slots) a compiled step can take (_shape), the most used first: fewer rows, then
        fewer slots (0 shapes when the step is eager)."""
        if not self.cache.static:
            return []
        return [(rows, slots) for rows in self.row_buckets for slots in self.slot_buckets]

    @torch.no_grad()
    def warm_up(self) -> int:
        """Compile every shape a step can take (_shape) before the first request, so none waits for a
        compile; the number of shapes (0 when the step is eager). Placeholder rows: a one-token prompt
        copied into every row, stepped at each shape without writing back, then reset."""
        if not self.cache.static:
            return 0
        if self.busy():
            raise RuntimeError("warm_up runs before any sequence is submitted")
        self._fill_placeholders(self.cache)
        shapes = self.shapes()
        for rows, slots in shapes:
            self.engine.decode(self.last[:rows], self.cache.head(rows, slots))
        self.cache.reset_rows(list(range(self.slots)))
        return len(shapes)

    def compile_in_background(self, done: Callable[[int, float], None] | None = None) -> int:
        """Compile every shape in a thread of its own while step() serves eager (module docstring), each
        shape taking over its steps once compiled; the number of shapes (0 when the step is eager).
        done(compiled, seconds) is called from that thread when it ends (compiled: the shapes whose
        compile succeeded; one that failed is logged in one sentence and stays eager)."""
        shapes = self.shapes()
        if not shapes:
            return 0
        if self._compiler is not None:
            raise RuntimeError("the decode step is compiling in the background already")
        self.ready = set()
        self._compiler = threading.Thread(target=self._compile, args=(shapes, done), daemon=True,
                                          name="titanlike-compile")
        self._compiler.start()
        return len(shapes)

    def stop_compiling(self, timeout: float = 0.0) -> bool:
        """Compile no further shape (the one in progress finishes: a compile cannot be interrupted); wait
        up to `timeout` seconds for the thread to end (it is a daemon: exiting the process does not wait
        for it). True when no compile is running."""
        self._stop_compiling.set()
        if self._compiler is not None:
            self._compiler.join(timeout)
        return self._compiler is None or not self._compiler.is_alive()

    @torch.no_grad()
    def _compile(self, shapes: list[tuple[int, int]], done: Callable[[int, float], None] | None) -> None:
        """The compile thread: each shape stepped once on a scratch cache of self.cache's layout (the same
        sizes and strides, so the serving step's guards hold), then handed to step() through `ready`."""
        started = time.perf_counter()
        engine = self.engine
        scratch = engine.init_cache(self.slots, self.capacity, device=engine.device, dtype=engine.dtype)
        self._fill_placeholders(scratch)
        tokens = torch.zeros(self.slots, dtype=torch.long, device=engine.device)
        compiled = 0
        for rows, slots in shapes:
            if self._stop_compiling.is_set():
                return
            try:
                engine.decode(tokens[:rows], scratch.head(rows, slots))
            except Exception as e:  # that shape stays eager; the server goes on
                why = " ".join(str(e).split())[:300] or type(e).__name__
                logger.warning(f"compiling the decode step for {rows} rows of {slots} slots failed, so that shape "
                               f"stays eager: {why}")
                continue
            self.ready.add((rows, slots))
            compiled += 1
        del scratch
        if done is not None:
            done(compiled, time.perf_counter() - started)

    def _fill_placeholders(self, cache) -> None:
        """Every row of `cache` holding a one-token prompt: what a compile steps on."""
        engine = self.engine
        staging = engine.init_cache(1, 1, device=engine.device, dtype=engine.dtype)
        engine.prefill(torch.zeros(1, 1, dtype=torch.long, device=engine.device),
                       torch.ones(1, dtype=torch.long, device=engine.device), staging, start_id=engine.start_id)
        for row in range(cache.batch_size):
            cache.copy_row(row, staging, 0)

    def _compact(self) -> None:
        """Move the sequences into the first rows: each row that holds none below their count takes
        the sequence of a row past it (its cache row, newest token and seen tokens)."""
        count = self.active
        holes = [row for row in range(count) if self.rows[row] is None]
        movers = [row for row in range(count, self.slots) if self.rows[row] is not None]
        for hole, row in zip(holes, movers):
            self.cache.copy_row(hole, self.cache, row)
            self.last[hole] = self.last[row]
            if self.seen is not None:
                self.seen[hole] = self.seen[row]
            seq = self.rows[row]
            self.rows[hole], self.rows[row], seq.slot = seq, None, hole

    def cancel_all(self) -> int:
        """Cancel every sequence waiting or running (a server that drains); how many there were."""
        with self.work:
            pending = [seq for seq in self.rows if seq is not None] + list(self.waiting)
            for seq in pending:
                seq.cancelled = True
            self.work.notify_all()
        return len(pending)

    def fail_all(self, error: BaseException) -> None:
        """End the sequences the step was serving (in a row or being admitted) with `error` (the step
        raised) and start from an empty cache; the waiting ones were not in it and stay queued."""
        with self.work:
            pending = [seq for seq in self.rows if seq is not None] + self._admitting
            self._admitting = []
        for seq in pending:
            seq.error = error
            self._end(seq, "error")
        self.cache = self.engine.init_cache(self.slots, self.capacity, device=self.engine.device,
                                            dtype=self.engine.dtype)
        self.seen = None

    def _admit(self, admitted: list[Sequence], free: list[int]) -> None:
        """Prefill the admitted prompts together and move each into a free slot."""
        engine = self.engine
        lengths = [len(seq.prompt) for seq in admitted]
        tokens = torch.zeros(len(admitted), max(lengths), dtype=torch.long)
        for i, seq in enumerate(admitted):
            tokens[i, :len(seq.prompt)] = torch.as_tensor(seq.prompt)
        staging = engine.init_cache(len(admitted), max(lengths), device=engine.device, dtype=engine.dtype)
        logits = engine.prefill(tokens.to(engine.device), torch.tensor(lengths, device=engine.device), staging,
                                start_id=engine.start_id)
        for i, seq in enumerate(admitted):
            row = free[i]
            self.cache.copy_row(row, staging, i)
            self.rows[row], seq.slot = seq, row
            if seq.params.seed is not None:
                seq._generator = torch.Generator(device=engine.device).manual_seed(seq.params.seed)
            if seq.detokenize is not None:
                seq._stream = _TextStream(seq.detokenize, seq.params.stop_strings)
            if seq.params.repetition_penalty != 1.0 and self.seen is None:
                self.seen = torch.zeros(self.slots, logits.shape[-1], dtype=torch.bool, device=engine.device)
            if self.seen is not None:
                self.seen[row] = False
                self.seen[row, torch.as_tensor(seq.prompt, device=engine.device)] = True
        # The first token of each admitted sequence, from its prompt's logits.
        self._sample(logits, free[:len(admitted)])

    def _sample(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Choose the next token of each row in `rows` (logits: (len(rows), vocab), in that order)
        with its own settings, record it, end the sequences that ended."""
        seqs = [self.rows[row] for row in rows]
        plain = [s.params.greedy and s.params.repetition_penalty == 1.0 for s in seqs]
        chosen = logits.float().argmax(-1) if any(plain) else torch.zeros(len(rows), dtype=torch.long,
                                                                          device=logits.device)
        failed: dict[int, BaseException] = {}
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            if not plain[i]:
                seen = self.seen[row:row + 1] if seq.params.repetition_penalty != 1.0 else None
                try:
                    chosen[i] = next_tokens(logits[i:i + 1], seq.params, seen=seen, generator=seq._generator)[0]
                except RuntimeError as e:  # its settings broke sampling (NaN probabilities): it alone ends
                    failed[i] = e
        index = torch.tensor(rows, device=logits.device)
        if self.seen is not None:
            self.seen[index, chosen] = True
        self.last.index_copy_(0, index, chosen)
        ids = chosen.tolist()  # the one host sync of a step
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            if i in failed:
                seq.error = failed[i]
                self._end(seq, "error")
                continue
            on_text = (lambda _, text, seq=seq: seq.on_text(seq, text)) if seq.on_text else None
            on_token = (lambda _, token, seq=seq: seq.on_token(seq, token)) if seq.on_token else None
            if self.engine._append(row, ids[i], seq.completion, seq._stream, seq.params, len(seq.prompt), on_text,
                                   on_token):
                self._end(seq, None)

    def _end(self, seq: Sequence, reason: str | None) -> None:
        """Release a sequence's slot and tell its owner (reason None: the one _append set)."""
        if seq.done:
            return
        if seq.slot is not None:
            self.rows[seq.slot] = None
        if reason is not None:
            seq.completion.finish_reason = reason
        self.cancelled += reason == "cancelled"
        if seq._stream is not None:
            rest = seq._stream.finish() if reason is None else ""
            if rest and seq.on_text is not None:
                seq.on_text(seq, rest)
            seq.completion.text = seq._stream.text
        seq.done = True
        if seq.on_done is not None:
            seq.on_done(seq)

    def run(self) -> None:
        """Step until every submitted sequence has ended (one thread, no server)."""
        while self.busy():
            self.step()


__all__ = ["ContinuousBatch", "Sequence"]
