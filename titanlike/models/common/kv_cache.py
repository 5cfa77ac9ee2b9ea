"""Decoding state for generation: one ModelCache per batch, one entry per layer that carries state.

The layout (gpt-fast's static cache, with per-sequence lengths as Megatron-Core's dynamic engine keeps):
every row of the batch has its own length (`lengths`, the tokens cached so far), so prompts of
different lengths need no left padding and a row's slot can later be refilled on its own.

- Prefill: the prompts go in right-padded to one length P (tokens past a row's length are
  placeholders). Causal attention never lets a real token see a later placeholder, so every layer
  computes the prompt exactly as the training forward does and writes its state for slots 0..P-1;
  placeholders' slots are overwritten by the decode steps that follow. What is not positional
  (a Mamba-2 state) reads the row's length to stop at its last real token.
- Decode: one token per row at position lengths[i], written to slot lengths[i]; attention reads
  slots 0..lengths[i] of its row (a boolean mask over the slots in use).
- Static (a compiled decode step, titanlike/inference/engine.py): every decode step reads all
  `capacity` slots (the mask hides those past a row's length), so its shapes never change and one
  compiled graph serves every step. The host-side bookkeeping (begin_decode, end_decode) stays out of
  the graph: its integers would otherwise be guarded on, and change, at every step. On a GPU that
  graph is replayed as a CUDA graph, which reads and writes its state at the addresses it was
  recorded with: a static cache's tensors are marked as such after the prefill, state that a step
  replaces as a whole is copied into its tensor instead (`keep`), and the engine reuses its cache
  for the next call of the same batch size (a prefill rewrites all that a call reads), so the
  recorded graph stays valid.
- Refill (continuous batching, titanlike/inference/continuous.py): a new prompt is prefilled in a
  cache of its own and copied into a free row (copy_row); a row that holds nothing is reset to
  length 0 (reset_rows) so its placeholder steps never fill the cache. Rows never mix (every op
  is per row), so what the other rows hold is untouched. Every layer cache (and every entry of
  `extra`) therefore provides copy_row(row, source, source_row): copy what row source_row of a
  cache of the same family holds, slots 0..source capacity - 1 where it has slots.
- Head (continuous batching's decode step over the rows in use): ModelCache.head is a cache of the
  first rows whose entries are shallow copies holding views of the same tensors, so every entry's
  tensors are batch first, and an entry that refers to its ModelCache does so as `cache`.

A layer's cache object is its family's: keys and values (KVCache, here), the compressed latent of
multi-head latent attention (deepseek_v3/attention.py), the conv and SSM state of a Mamba-2 mixer
(common/mamba2.py), a T5 decoder layer's self-attention and cross-attention (t5/model.py). The model
builds them in its `init_cache` (models/protocol.py) and hands each layer its own in the forward.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from titanlike.models.common.dtensor import local_part
from titanlike.models.common.eager import eager_only
from titanlike.models.common.sinks import sink_attention


class ModelCache:
    """The decoding state of a batch: per-row lengths, the step in progress, and each layer's cache."""

    def __init__(self, batch_size: int, capacity: int, device: torch.device | str, *, static: bool = False):
        self.batch_size = batch_size
        self.capacity = capacity
        self.static = static
        self.device = torch.device(device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.layers: dict[str, object] = {}
        # Set by begin_prefill / begin_decode for the forward in progress.
        self.prefilling = False
        self.prompt_lengths: torch.Tensor | None = None  # (batch,) real tokens of each padded prompt
        self.slots_in_use = 0  # host-side: slots any row may read in this step (no device sync)
        self.host_max_length = 0  # host-side upper bound of the longest row's length
        self._row_bounds = [0] * batch_size  # host-side upper bound of each row's length
        self._mask: torch.Tensor | None = None
        # A family's own entries that are not layers (T5: the encoder's padding mask).
        self.extra: dict[str, object] = {}
        self._viewed = None  # a head(): (the full cache, the tensors the view started with)

    def layer(self, key: str):
        """The cache of layer `key`, or None for a layer that keeps none (an MLP)."""
        return self.layers.get(key)

    def begin_prefill(self, prompt_lengths: torch.Tensor, padded_len: int) -> None:
        if padded_len > self.capacity:
            raise ValueError(f"a prompt of {padded_len} tokens does not fit a cache of {self.capacity} slots")
        self.prefilling = True
        self.prompt_lengths = prompt_lengths.to(self.device)
        self.slots_in_use = padded_len
        self._mask = None

    def end_prefill(self) -> None:
        self.lengths = self.prompt_lengths.clone()
        self.host_max_length = self.slots_in_use
        self._row_bounds = [self.slots_in_use] * self.batch_size
        self.prefilling = False
        self._hold_static()

    def _hold_static(self) -> None:
        """In a static cache, mark the tensors it holds as the compiled step's inputs at fixed
        addresses: CUDA graphs then neither copy them in at every replay nor refuse the step's
        in-place writes into them. Unguarded: a tensor at a new address (one a prefill made anew)
        re-records the CUDA graph rather than recompiling the step."""
        if not self.static:
            return
        for value in self.held_tensors().values():
            torch._dynamo.mark_static_address(value, guard=False)

    def held_tensors(self) -> dict[tuple[str, str, str], torch.Tensor]:
        """Every tensor the layers' and the family's entries hold: ("layers" or "extra", entry key,
        attribute) -> tensor."""
        return {(kind, key, name): value for kind, entries in (("layers", self.layers), ("extra", self.extra))
                for key, entry in entries.items() for name, value in vars(entry).items()
                if isinstance(value, torch.Tensor)}

    def keep(self, held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """State a step replaces as a whole (a Mamba-2 state): `new`, copied into the tensor already
        held when the cache is static (a CUDA graph reads it at that address), else `new` itself."""
        if self.static and held is not None and held.shape == new.shape:
            return held.copy_(new)
        return new

    @eager_only
    def begin_decode(self) -> None:
        if self.host_max_length >= self.capacity:
            raise ValueError(f"the cache of {self.capacity} slots is full")
        self.slots_in_use = self.capacity if self.static else self.host_max_length + 1
        # (batch, 1, 1, slots): a row reads its own tokens, the new one included.
        slots = torch.arange(self.slots_in_use, device=self.device)
        self._mask = (slots[None, :] <= self.lengths[:, None])[:, None, None, :]

    @eager_only
    def end_decode(self) -> None:
        self.lengths = self.lengths + 1
        self.host_max_length += 1
        self._row_bounds = [bound + 1 for bound in self._row_bounds]

    # Continuous batching: one row at a time ------------------------------------------------------

    def copy_row(self, row: int, source: ModelCache, source_row: int) -> None:
        """Make row `row` hold what row `source_row` of `source` holds (a cache of the same model,
        filled by a prefill of its own): the refill of a finished sequence's slot."""
        if source.capacity > self.capacity:
            raise ValueError(f"a cache of {source.capacity} slots does not fit a row of {self.capacity}")
        for key, entry in self.layers.items():
            entry.copy_row(row, source.layers[key], source_row)
        for key, entry in self.extra.items():
            entry.copy_row(row, source.extra[key], source_row)
        self.lengths[row] = source.lengths[source_row]
        self._row_bounds[row] = source._row_bounds[source_row]
        self.host_max_length = max(self._row_bounds)
        self._hold_static()  # the first copy allocates the rows' tensors

    def reset_rows(self, rows: list[int]) -> None:
        """Rows that hold no sequence: length 0, so the placeholder steps they still take (the
        decode step keeps its shape) write slot 0 and never reach the cache's end."""
        if not rows:
            return
        self.lengths = self.lengths.index_fill(0, torch.tensor(rows, device=self.device), 0)
        for row in rows:
            self._row_bounds[row] = 0
        self.host_max_length = max(self._row_bounds)

    def head(self, rows: int, slots: int | None = None, *, static: bool | None = None) -> ModelCache:
        """A cache of this one's first `rows` rows whose tensors are views of this one's, reading at
        most `slots` slots (default: this cache's capacity; a static cache reads exactly that many):
        a decode step over the rows in use only (continuous.py keeps its sequences in the first rows).
        The step writes its keys and values in place; what it replaces as a whole (a Mamba-2 state,
        the lengths) comes back with write_back(). static=False: a head an eager step reads as it
        reads a cache that is not static (continuous.py, while the compiled step compiles)."""
        if not 1 <= rows <= self.batch_size:
            raise ValueError(f"a head of {rows} rows does not fit a cache of {self.batch_size}")
        static = self.static if static is None else static
        view = ModelCache(rows, min(slots or self.capacity, self.capacity), self.device, static=static)
        view.lengths = self.lengths[:rows]
        view._row_bounds = self._row_bounds[:rows]
        view.host_max_length = max(view._row_bounds)
        for kind in ("layers", "extra"):
            for key, entry in getattr(self, kind).items():
                part = copy.copy(entry)
                for name, value in vars(entry).items():
                    if isinstance(value, torch.Tensor):
                        setattr(part, name, value[:rows])
                    elif value is self:  # the entry's back reference (KVCache.cache)
                        setattr(part, name, view)
                getattr(view, kind)[key] = part
        view._viewed = (self, view.held_tensors())
        view._hold_static()
        return view

    def write_back(self) -> None:
        """After a step on a head(): copy into the full cache what the step replaced rather than wrote
        in place (state a family replaces as a whole, the rows' lengths)."""
        full, held = self._viewed
        rows = self.batch_size
        for (kind, key, name), value in self.held_tensors().items():
            if value is not held.get((kind, key, name)):
                getattr(getattr(full, kind)[key], name)[:rows].copy_(value)
        full.lengths[:rows] = self.lengths
        full._row_bounds[:rows] = self._row_bounds
        full.host_max_length = max(full._row_bounds)

    @property
    def decode_mask(self) -> torch.Tensor:
        """(batch, 1, 1, slots in use) bool: which slots the new token of each row attends to."""
        return self._mask

    def positions(self) -> torch.Tensor:
        """(batch, 1): the position of each row's new token in a decode step."""
        return self.lengths[:, None]

    def write(self, buffer: torch.Tensor, value: torch.Tensor, dim: int) -> None:
        """Store `value` in `buffer` along the slot dim `dim` (batch first): slots 0..P-1 in a
        prefill, slot lengths[i] of row i in a decode step."""
        if self.prefilling:
            buffer.narrow(dim, 0, value.shape[dim]).copy_(value)
            return
        rows = torch.arange(self.batch_size, device=self.device)
        index = [rows] + [slice(None)] * (dim - 1) + [self.lengths]
        buffer[tuple(index)] = value.select(dim, 0).to(buffer.dtype)

    def read(self, buffer: torch.Tensor, dim: int) -> torch.Tensor:
        """The slots in use of `buffer` along dim `dim`."""
        return buffer.narrow(dim, 0, self.slots_in_use)


def lazy_buffer(buffer: torch.Tensor | None, cache: ModelCache, like: torch.Tensor, *, slot_dim: int | None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """`buffer`, or when it does not exist yet a zero one shaped as `like` (a value the forward
    computes, batch first) with the cache's batch size and, along slot_dim, its capacity.

    Caches take their shapes from the forward's own tensors rather than from the weights: under
    tensor parallelism a rank holds some heads (the local shard the forward computes with), and
    under FSDP a weight outside the forward is a shard of rows that says nothing of the heads."""
    if buffer is not None:
        return buffer
    shape = [cache.batch_size, *like.shape[1:]]
    if slot_dim is not None:
        shape[slot_dim] = cache.capacity
    like = local_part(like)
    return torch.zeros(shape, dtype=dtype or like.dtype, device=cache.device)


def copy_slots(buffer: torch.Tensor, row: int, source: torch.Tensor, source_row: int, dim: int) -> None:
    """buffer[row] = source[source_row] over the source's slots (dim `dim` of the batch-first
    buffers; the source may have fewer slots)."""
    source = source[source_row]
    buffer[row].narrow(dim - 1, 0, source.shape[dim - 1]).copy_(source)


class KVCache:
    """Keys and values of one grouped-query attention layer: (batch, kv_heads, capacity, head_dim) each,
    allocated at the first write from the keys and values the forward computes (see lazy_buffer)."""

    def __init__(self, cache: ModelCache, dtype: torch.dtype):
        self.cache, self.dtype = cache, dtype
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def copy_row(self, row: int, source: KVCache, source_row: int) -> None:
        self.k = lazy_buffer(self.k, self.cache, source.k, slot_dim=2)
        self.v = lazy_buffer(self.v, self.cache, source.v, slot_dim=2)
        copy_slots(self.k, row, source.k, source_row, dim=2)
        copy_slots(self.v, row, source.v, source_row, dim=2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill_kernel, *,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q (batch, heads, seq, head_dim) with the new k, v (batch, kv_heads, seq,
        head_dim) stored first. In a prefill the prompt attends to itself with `prefill_kernel` (the
        module's training kernel, so the numbers are the training forward's); in a decode step the
        one new token attends to its row's slots. sinks: the layer's per-head sink logits, if any."""
        c = self.cache
        self.k = lazy_buffer(self.k, c, k, slot_dim=2, dtype=self.dtype)
        self.v = lazy_buffer(self.v, c, v, slot_dim=2, dtype=self.dtype)
        c.write(self.k, k, dim=2)
        c.write(self.v, v, dim=2)
        if c.prefilling:
            return prefill_kernel(q, k, v)
        keys, values = c.read(self.k, 2), c.read(self.v, 2)
        return _decode_attention(q, keys.to(q.dtype), values.to(q.dtype), c.decode_mask, scale, sinks)


class SlidingKVCache(KVCache):
    """The keys and values of a sliding-window attention layer (attention.py): a rolling buffer of
    min(window, capacity) slots per row, position p in slot p % slots, so its memory is bounded by the
    window however long the generation runs (Mistral's rolling buffer cache).

    A prefill attends within the prompt with the module's kernel (its window included) and keeps each
    row's last `slots` real tokens; a decode step writes slot lengths % slots and reads every slot,
    masking those no token has reached yet. The window always covers the slots that are filled: a
    row's last `window` tokens are exactly what they hold. Rows copied from another cache (copy_row)
    keep their slots: a smaller source has slots == positions, which are also ours."""

    def __init__(self, cache: ModelCache, dtype: torch.dtype, window: int):
        super().__init__(cache, dtype)
        self.slots = min(window, cache.capacity)

    def _buffer(self, buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        if buffer is not None:
            return buffer
        like = local_part(like)
        shape = [self.cache.batch_size, like.shape[1], self.slots, *like.shape[3:]]
        return torch.zeros(shape, dtype=self.dtype, device=self.cache.device)

    def copy_row(self, row: int, source: KVCache, source_row: int) -> None:
        self.k, self.v = self._buffer(self.k, source.k), self._buffer(self.v, source.v)
        copy_slots(self.k, row, source.k, source_row, dim=2)
        copy_slots(self.v, row, source.v, source_row, dim=2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill_kernel, *,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        c = self.cache
        self.k, self.v = self._buffer(self.k, k), self._buffer(self.v, v)
        slots = torch.arange(self.slots, device=c.device)
        if c.prefilling:
            # Slot s of row i takes the latest real position p < length_i with p % slots == s (none: p < 0,
            # left as it is and masked until a decode step writes it).
            last = c.prompt_lengths[:, None] - 1
            positions = last - (last - slots[None, :]).remainder(self.slots)  # (batch, slots)
            filled = (positions >= 0)[:, None, :, None]
            index = positions.clamp(min=0)[:, None, :, None]
            for buffer, new in ((self.k, k), (self.v, v)):
                picked = new.gather(2, index.expand(-1, new.shape[1], -1, new.shape[3])).to(buffer.dtype)
                buffer.copy_(torch.where(filled, picked, buffer))
            return prefill_kernel(q, k, v)
        rows = torch.arange(c.batch_size, device=c.device)
        slot = c.lengths.remainder(self.slots)
        self.k[rows, :, slot] = k.select(2, 0).to(self.dtype)
        self.v[rows, :, slot] = v.select(2, 0).to(self.dtype)
        # While no row has wrapped around (every length below the slots in use), only the slots in use
        # hold anything: read those. Before a row has filled its buffer, slots past its new token hold
        # nothing yet.
        used = min(self.slots, c.slots_in_use)
        mask = (slots[None, :used] <= c.lengths[:, None])[:, None, None, :]
        keys, values = self.k.narrow(2, 0, used), self.v.narrow(2, 0, used)
        return _decode_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale, sinks)


def _decode_attention(q, keys, values, mask, scale, sinks):
    if sinks is not None:
        return sink_attention(q, keys, values, mask, sinks, scale=scale)
    kwargs = {} if scale is None else {"scale": scale}
    if keys.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **kwargs)


def local_rows(weight: torch.Tensor) -> int:
    """Rows of a weight this rank holds (a tensor-parallel DTensor's local shard; a plain tensor whole)."""
    return local_part(weight).shape[0]


def last_prompt_tokens(h: torch.Tensor, cache: ModelCache) -> torch.Tensor:
    """In a prefill, the hidden state (batch, 1, dim) of each row's last real prompt token: the only
    one whose logits generation needs (the output projection is then one row per prompt). In a
    decode step, h itself."""
    if not cache.prefilling:
        return h
    rows = torch.arange(h.shape[0], device=h.device)
    return h[rows, cache.prompt_lengths - 1][:, None]


__all__ = ["KVCache", "ModelCache", "SlidingKVCache", "copy_slots", "lazy_buffer", "last_prompt_tokens", "local_rows"]
