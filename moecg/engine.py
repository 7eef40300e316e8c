"""Decode engine: eager prefill, then greedy decode on a StaticCache, one step at a time.

Dims: B rows run (a bucket, >= n), n real rows, S prompt tokens, V vocab, L cache length, H kv heads, Dh head dim
(keys and values may differ in both: MLA caches its latent, FamilyAdapter.kv_shapes).
The engine owns the loop; how a decode step runs is its step policy's (`set_policy`, StepPolicy: which row count
a batch runs at, what runs the step, which forward runs one-token steps). The default, EagerPolicy, runs every
batch at its own row count, eagerly; a capture strategy (moecg.capture.Capture) is a policy that pads to a bucket and
replays its graph, or wraps modules of the model (single layers) from outside. Rows are "slots" in one StaticCache
sized for the largest row count: a forward over B rows uses a view of the first B rows, so a batch that shrinks is
compacted to the front and simply runs on fewer rows (a smaller bucket) with no new allocation and no re-capture.

Every cache layer is a linear StaticLayer of max_cache_len slots, sliding-window layers included: slot = absolute
position, one device position counter shared by all layers and views. HF's own StaticCache would give sliding
layers a ring buffer (StaticSlidingWindowLayer) whose host-side length cannot be shared by row views, replayed by
a CUDA graph or read by the fused step. The model still masks each sliding layer to its window: its
create_sliding_window_causal_mask, given a cache without sliding layers, sizes the mask from layer 0 (the whole
linear cache) and masks by absolute position, which is exact on a linear cache. Memory: max_cache_len slots per
layer, as for full attention.

Chunked prefill (`prefill_chunk=c`): the padded prompt runs through the model c tokens at a time on the same cache.
HF's model continues from the cache: positions are `cache.get_seq_length()` (the shared device counter) onward, and
its mask is [B, 1, c, L] over the whole linear cache, causal (and windowed) by absolute position, so every chunk sees
exactly the keys one forward would show it; on sliding layers too, because no slot is ever overwritten. It bounds the
prefill's mask and activations by c tokens instead of the prompt's S (a [B, 1, S, L] mask and S-token intermediates
are what a long prompt cannot afford). A dispatcher that drops is refused: capacity depends on the tokens per forward.
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from moecg.dispatch import state_of
from moecg.models import check_transformers
from moecg.models.adapter import adapter_for


class CacheOverflowError(ValueError):
    pass


def check_prefill_chunk(chunk, prefiller=None) -> int | None:
    """`prefill_chunk` as given (None: one forward) or a ValueError naming the key and the fix.

    prefiller: the dispatcher that runs the prefill (DispatchState.prefill_dispatcher, else its dispatcher), if known.
    """
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
        # one-token chunks have a decode step's shapes, which per-layer graphs and the fused step would take over
        raise ValueError(f"prefill_chunk={chunk!r}: must be null (one forward) or an integer >= 2 "
                         "(e.g. prefill_chunk=2048)")
    if prefiller is not None and prefiller.drops:
        raise ValueError(f"prefill_chunk={chunk} with a prefill dispatcher that drops ({prefiller.name}): its capacity "
                         "depends on the tokens per forward, so chunks would drop other assignments than one forward; "
                         "prefill dropless with dispatch.prefill=dropless, or set prefill_chunk=null")
    return chunk


def chunk_bounds(S: int, chunk: int | None) -> list[tuple[int, int]]:
    """[start, end) of each prefill forward over S prompt tokens, at most `chunk` tokens each (None: one forward).

    A one-token tail joins the chunk before it (chunk + 1 tokens): a one-token forward has a decode step's shapes,
    so a per-layer graph captured for decode would replay it with the decode dispatcher and counters."""
    if chunk is None or S <= chunk:
        return [(0, S)]
    starts = list(range(0, S, chunk))
    if S - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [S]))


def kv_shape(config):
    """((heads, dim) of a cached key, (heads, dim) of a cached value): they differ for MLA, which caches its latent."""
    return adapter_for(config).kv_shapes(config)


def linear_cache_config(config):
    """A shallow copy of `config` that makes StaticCache build a full (linear) StaticLayer for every layer.

    transformers 5.24's StaticCache picks each layer's class from `layer_types` (else from `sliding_window`); the
    copy is only read there, the model keeps its own config (and so its sliding-window masks).
    """
    c = copy.copy(config)
    c.layer_types = ["full_attention"] * config.num_hidden_layers
    c.sliding_window = None
    return c


def _linear_static_cache(config, max_cache_len: int) -> StaticCache:
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer]
    if bad:
        raise RuntimeError(f"StaticCache built {bad} layers from a full-attention config: this transformers "
                           "version chooses cache layers differently; RowCache needs linear StaticLayers")
    return cache


class RowCache:
    """One StaticCache for `max_rows` rows plus aliasing views of its first B rows (shared length counters).

    All layers are linear StaticLayers of max_cache_len slots, sliding-window layers too (module docstring)."""

    def __init__(self, config, max_rows: int, max_cache_len: int, device, dtype):
        self.config, self.max_rows, self.max_cache_len = config, max_rows, max_cache_len
        self._cache_config = linear_cache_config(config)
        self.full = _linear_static_cache(self._cache_config, max_cache_len)
        (hk, dk), (hv, dv) = kv_shape(config)
        # StaticCache.early_initialization gives keys and values one shape; MLA's differ, so each layer is
        # initialised from empty [B, H, 0, D] stand-ins of its own key and value (no data allocated for them)
        for layer in self.full.layers:
            layer.lazy_initialization(torch.zeros(max_rows, hk, 0, dk, dtype=dtype, device=device),
                                      torch.zeros(max_rows, hv, 0, dv, dtype=dtype, device=device))
        self._views: dict[int, StaticCache] = {max_rows: self.full}

    def view(self, rows: int) -> StaticCache:
        if rows not in self._views:
            if rows > self.max_rows:
                raise ValueError(f"{rows} rows exceed the cache's {self.max_rows}")
            v = _linear_static_cache(self._cache_config, self.max_cache_len)
            for lv, lf in zip(v.layers, self.full.layers):
                lv.__dict__.update(lf.__dict__)
                lv.keys, lv.values = lf.keys[:rows], lf.values[:rows]  # [B, H, L, Dh] views, fixed addresses
                lv.batch_size = rows
                # lv.cumulative_length is lf's tensor itself: one position counter for every view
            self._views[rows] = v
        return self._views[rows]

    def length(self) -> torch.Tensor:
        return self.full.layers[0].cumulative_length

    def reset(self) -> None:
        self.full.reset()

    def save_lengths(self) -> list[torch.Tensor]:
        return [layer.cumulative_length.clone() for layer in self.full.layers]

    def restore_lengths(self, saved) -> None:
        for layer, s in zip(self.full.layers, saved):
            layer.cumulative_length.copy_(s)

    def compact(self, keep: torch.Tensor) -> None:
        """Move rows `keep` [m] (device long) to the front, in order (finished requests leave)."""
        m = keep.numel()
        for layer in self.full.layers:
            layer.keys[:m] = layer.keys.index_select(0, keep)
            layer.values[:m] = layer.values.index_select(0, keep)


@dataclass
class GenerateResult:
    tokens: torch.Tensor  # [n, new_tokens] long (cpu); rows that finished early are padded with -1
    step_ms: list[float]  # per decode step wall time (CUDA events on GPU), first step included
    step_rows: list[int]  # rows run per step (the bucket)
    prefill_ms: float
    logits: list[torch.Tensor] | None = None  # per step [n_active, V] in original-row order slots (cpu, fp32)
    logits_rows: list[torch.Tensor] | None = None  # per step: original row index of each logits row
    extra: dict = field(default_factory=dict)


class StepPolicy(Protocol):
    """How an engine runs its decode steps (the engine calls these; mechanisms such as graph replay live behind)."""

    decode_forward: Callable | None  # the forward of one-token steps (None: the model's own); prefill runs the model

    def rows_for(self, n: int) -> int:
        """Rows to run for n real ones (>= n; the extra rows are padding)."""

    def step(self, ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B_max] -> (next ids [B], logits [B, V]) for the first `rows` rows (B = rows)."""


class EagerPolicy:
    """The default step policy: every batch runs at its own row count, each step eagerly (`engine.eager_step`)."""

    decode_forward = None

    def __init__(self, engine):
        self.engine = engine

    def rows_for(self, n: int) -> int:
        return n

    def step(self, ids: torch.Tensor, rows: int):
        return self.engine.eager_step(ids, rows)


class DecodeEngine:
    def __init__(self, model, max_cache_len: int, max_rows: int, prefill_chunk: int | None = None):
        """prefill_chunk: prompt tokens per prefill forward (None: the whole prompt in one forward; module docstring)."""
        check_transformers()  # the forward's cache argument is 5.24's: another release would decode without prompts
        self.model = model
        self.prefill_chunk = check_prefill_chunk(prefill_chunk, _prefiller(state_of(model)))
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_cache_len, self.max_rows = max_cache_len, max_rows
        adapter_for(model).check_supported(model.config, "hf")  # a config moecg would decode wrongly: refused now
        self.cache = RowCache(model.config, max_rows, max_cache_len, self.device, self.dtype)
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # [B_max] current tokens
        # decode_forward: the forward of decode calls (one token per row) in place of the model's, e.g. the fused step
        # or an Inductor-compiled forward that a strategy then captures; prefill always runs the plain model. It is
        # the policy's (set_policy); a caller may also set it directly to run a step eagerly with another forward.
        self.set_policy(None)

    # -- the step policy ----------------------------------------------------------------------------
    def set_policy(self, policy: StepPolicy | None) -> None:
        """Run decode steps by `policy` (None: the default EagerPolicy), with its decode_forward."""
        self.policy = policy if policy is not None else EagerPolicy(self)
        self.decode_forward = self.policy.decode_forward

    def rows_for(self, n: int) -> int:
        """Rows the policy runs for n real ones."""
        return self.policy.rows_for(n)

    def step_impl(self, ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step as the policy runs it: ids [B_max] -> (next ids [B], logits [B, V])."""
        return self.policy.step(ids, rows)

    # -- one forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """ids [B, S] -> last-position logits [B, V], eager, on the cache view of B rows."""
        state = state_of(self.model)
        ctx = state.rows(rows) if state is not None else null_context()
        call = self.decode_forward if self.decode_forward is not None and ids.shape[1] == 1 else self.model
        with ctx:
            # output_router_logits=False: a config asking for router logits would add the aux loss to every step
            out = call(input_ids=ids, cache=self.cache.view(rows), use_cache=True, logits_to_keep=1,
                       output_router_logits=False)
        return out.logits[:, -1]  # [B, V]

    def eager_step(self, ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B] -> (next ids [B], logits [B, V]): the function the `full` strategy captures."""
        logits = self.forward(ids[:rows, None], rows)  # [B, V]
        return logits.argmax(-1), logits

    @contextmanager
    def scratch(self):
        """Run warmups without polluting real state: cache lengths and drop counters come back as they were.

        Warmup writes K/V only at slots at or past the current length, which the causal mask hides and the
        next real step overwrites.
        """
        state = state_of(self.model)
        lengths = self.cache.save_lengths()
        counters = state.save() if state is not None else None
        try:
            yield
        finally:
            self.cache.restore_lengths(lengths)
            if state is not None:
                state.restore(counters)

    def _set_rows(self, n: int, rows: int) -> None:
        state = state_of(self.model)
        if state is not None:
            state.set_rows(n, rows)

    # -- the loop ---------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, new_tokens: int) -> None:
        need = prompt_len + new_tokens
        if need > self.max_cache_len:
            raise CacheOverflowError(
                f"prompt_len + new_tokens = {prompt_len} + {new_tokens} = {need} exceeds the KV cache "
                f"({self.max_cache_len} slots): lower new_tokens/prompt_len or raise max_cache_len"
            )

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """prompts [n, S] -> (first new ids [n], logits [n, V], rows run). Resets the cache first."""
        n, S = prompts.shape
        self.check_fits(S, 1)
        state = state_of(self.model)
        check_prefill_chunk(self.prefill_chunk, _prefiller(state))  # the dispatcher may have changed since __init__
        rows = self.rows_for(n)
        self.cache.reset()
        padded = torch.zeros(rows, S, dtype=torch.long, device=self.device)  # [B, S]
        padded[:n] = prompts.to(self.device)
        self._set_rows(n, rows)
        with state.prefill() if state is not None else null_context():
            for a, b in chunk_bounds(S, self.prefill_chunk):
                logits = self.forward(padded[:, a:b], rows)  # [B, V] of the chunk's last token
        return logits[:n].argmax(-1), logits[:n], rows

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int, lengths: list[int] | None = None,
                 keep_logits: bool | int = False, timing: bool = True, progress=None,
                 count_prefill: bool = True, force_tokens: torch.Tensor | None = None) -> GenerateResult:
        """Greedy decode `new_tokens` per row (row i stops after lengths[i] tokens, then leaves the batch).

        force_tokens [n, new_tokens]: teacher forcing. Each step's input is the forced token, not this run's
        argmax (which is still what `tokens` records), so two implementations can be compared step by step
        without one early disagreement making every later token differ.

        keep_logits: True keeps every row's logits per step, an int k the first k slots' (memory: V floats each).
        count_prefill: False keeps the prefill out of the drop counters (decode-only drop rates).
        """
        n, S = prompts.shape
        keep = n if keep_logits is True else int(keep_logits)
        if n > self.max_rows:
            raise ValueError(f"batch of {n} rows exceeds the engine's {self.max_rows} (raise max_rows)")
        if new_tokens < 1:
            raise ValueError(f"new_tokens={new_tokens}: must be >= 1")
        self.check_fits(S, new_tokens)
        if force_tokens is not None:
            if tuple(force_tokens.shape) != (n, new_tokens) or lengths is not None:
                raise ValueError(f"force_tokens must be [{n}, {new_tokens}] (one row per prompt) and takes no lengths")
            force_tokens = force_tokens.to(self.device)
        lengths = list(lengths) if lengths is not None else [new_tokens] * n
        if len(lengths) != n or any(not 1 <= x <= new_tokens for x in lengths):
            raise ValueError(f"lengths must give 1..{new_tokens} tokens for each of the {n} rows")
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        state = state_of(self.model)
        if state is not None and not count_prefill:
            state.counting = False
        try:
            first, first_logits, rows = self.prefill(prompts)
        finally:
            if state is not None:
                state.counting = True
        if cuda:
            torch.cuda.synchronize(self.device)
        prefill_ms = (time.perf_counter() - t0) * 1e3

        out = torch.full((n, new_tokens), -1, dtype=torch.long, device=self.device)  # [n, new]
        out[:, 0] = first
        order = torch.arange(n, device=self.device)  # slot -> original row
        order_host = list(range(n))
        logits_log = [first_logits[:keep].to("cpu", torch.float32, copy=True)] if keep else None
        rows_log = [torch.arange(n)[:keep]] if keep else None
        self.ids[:n] = first if force_tokens is None else force_tokens[:, 0]
        step_ms, step_rows, events = [], [], []
        for t in range(1, new_tokens):
            # requests that reached their length leave; survivors move to the front (no re-capture needed)
            alive = [i for i, r in enumerate(order_host) if lengths[r] > t]
            if len(alive) < len(order_host):
                alive_t = torch.tensor(alive, device=self.device)
                self.cache.compact(alive_t)
                self.ids[: len(alive)] = self.ids.index_select(0, alive_t)
                order = order.index_select(0, alive_t)
                order_host = [order_host[i] for i in alive]
            m = len(order_host)
            rows = self.rows_for(m)
            self.ids[m:rows] = 0
            self._set_rows(m, rows)
            if timing and cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            ts = time.perf_counter()
            nxt, logits = self.step_impl(self.ids, rows)
            if timing and cuda:
                ev[1].record()
                events.append(ev)
            elif timing:
                step_ms.append((time.perf_counter() - ts) * 1e3)
            out[order, t] = nxt[:m]
            self.ids[:m] = nxt[:m] if force_tokens is None else force_tokens[order, t]
            step_rows.append(rows)
            if keep:
                logits_log.append(logits[: min(m, keep)].to("cpu", torch.float32, copy=True))
                rows_log.append(torch.tensor(order_host[:keep]))
            if progress is not None:
                progress()
        if events:
            torch.cuda.synchronize(self.device)
            step_ms = [a.elapsed_time(b) for a, b in events]
        return GenerateResult(out.cpu(), step_ms, step_rows, prefill_ms, logits_log, rows_log)


def _prefiller(state):
    """The dispatcher the prefill runs (DispatchState.prefill swaps it in), None without one attached."""
    if state is None:
        return None
    return state.prefill_dispatcher if state.prefill_dispatcher is not None else state.dispatcher


@contextmanager
def null_context():
    yield
