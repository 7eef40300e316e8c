"""Ragged decode (HF-module paths): every row of the decode batch has its own length.

Dims: B rows run (a bucket, >= m), m live rows, B_max slots, S prompt tokens, L cache slots, H kv heads, Dh head dim.

`RaggedCache` is a transformers `Cache` of `RaggedLayer`s: linear [B_max, H, L, Dh] key/value buffers plus ONE
device length tensor `lengths` [B_max] int64 shared by every layer and every row view (views of the first B rows,
fixed addresses, as RowCache). A layer's `update` writes row b's new keys at slots lengths[b] .. lengths[b]+S-1
(index_put with device indices: no host sync, graph-safe) and returns the whole buffers; the length is advanced
once per step by the engine, not per layer.

The engine hands the HF model its own `position_ids` (lengths[:B, None]) and a 4D attention mask
[B, 1, S, L] = (slot <= position) built on the device from `lengths` inside the step, so a captured step
recomputes both on replay. transformers 5.24's masking_utils returns a 4D mask as is (_preprocess_mask_arguments'
early exit) and every family here (the three originals and the five newer ones, tests/test_ragged.py) only reads
cache.get_seq_length() when position_ids is None; sdpa takes the
boolean mask, eager attention an additive one (built to match config._attn_implementation).

Sliding windows (on the linear cache, as RowCache): Mixtral and Qwen3-MoE slide every layer by one window, so one
windowed 4D mask serves all layers; Qwen2-MoE (and GPT-OSS) accept a {layer type: mask} dict and pick each layer's
mask by config.layer_types, so ragged decode passes that dict. Anything else is refused (ragged_windows).

Slots: requests join with `add` (an eager one-row prefill into a free slot: positions 0..S-1, then lengths[r] = S)
or `add_many` (one eager forward over several right-padded prompts into consecutive free slots) and leave with
`remove` (the last live row moves into the freed slot: K/V rows, length, current token and generated tokens), so the
live rows stay 0..m-1 and a step runs in the smallest bucket holding m; pad rows (m..B-1) keep
length 0, do not advance, and are masked in routing (DispatchState.set_rows(m, B)).

Host syncs: every step's tokens go to a device buffer per slot (`tok_buf` [B_max, L], `n_tok` [B_max]); the host
only counts them (a request's output length is known on the host, so no stop condition needs the values).
`step(sync=False)` / `add(..., sync=False)` / `remove(id, sync=False)` never read the device: remove hands back a
device copy of the request's tokens, read when the caller likes (moecg.serving reads them after the run).
The default `sync=True` keeps the host dict API (`step()` -> {request id: token}, `tokens[id]`).
"""
from __future__ import annotations


import torch
from transformers.cache_utils import Cache, StaticLayer

from moecg.dispatch import state_of
from moecg.engine import CacheOverflowError, DecodeEngine, kv_shape, null_context
from moecg.models.adapter import adapter_for


class RaggedLayer(StaticLayer):
    """A linear StaticLayer whose writes follow each row's own length (`lengths` [B] int64, shared, not advanced here)."""

    def __init__(self, max_cache_len: int, lengths: torch.Tensor):
        super().__init__(max_cache_len)
        self.lengths = lengths  # [B] view of the engine's [B_max] tensor

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states [B, H, S, Dh]: row b's token s goes to slot lengths[b] + s
        B, S = key_states.shape[0], key_states.shape[-2]
        pos = self.lengths[:B, None] + torch.arange(S, device=key_states.device)  # [B, S]
        rows = torch.arange(B, device=key_states.device)[:, None].expand(B, S)  # [B, S]
        # [B, L, H, Dh] views: index_put over (row, slot) writes [B, S, H, Dh]
        self.keys.transpose(1, 2).index_put_((rows, pos), key_states.transpose(1, 2))
        self.values.transpose(1, 2).index_put_((rows, pos), value_states.transpose(1, 2))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        raise RuntimeError("a RaggedCache has one length per row: pass position_ids (RaggedEngine does)")


class RaggedCache:
    """Key/value buffers for `max_rows` slots, one shared lengths tensor, and `Cache` views of the first B rows
    (`view(B)`) or of one slot (`slot(r)`, for its prefill)."""

    def __init__(self, config, max_rows: int, max_cache_len: int, device, dtype):
        self.config, self.max_rows, self.max_cache_len = config, max_rows, max_cache_len
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)  # [B_max]
        (hk, dk), (hv, dv) = kv_shape(config)
        n = config.num_hidden_layers
        self.keys = [torch.zeros(max_rows, hk, max_cache_len, dk, dtype=dtype, device=device) for _ in range(n)]
        self.values = [torch.zeros(max_rows, hv, max_cache_len, dv, dtype=dtype, device=device) for _ in range(n)]
        self._views: dict[int, Cache] = {}
        self._slots: dict[int, Cache] = {}
        self.full = self.view(max_rows)

    def _make(self, sl: slice) -> Cache:
        layers = []
        for k, v in zip(self.keys, self.values):
            layer = RaggedLayer(self.max_cache_len, self.lengths[sl])
            # what StaticLayer.lazy_initialization sets, on views instead of fresh buffers
            layer.keys, layer.values = k[sl], v[sl]  # [B, H, L, Dh] views, fixed addresses
            layer.device = k.device
            layer.batch_size, layer.num_heads, _, layer.k_head_dim = layer.keys.shape
            layer.v_head_dim = layer.values.shape[-1]
            layer.cumulative_length = layer.cumulative_length.to(k.device)  # unused: lengths is the counter
            layer.is_initialized = True
            layers.append(layer)
        return Cache(layers=layers)

    def view(self, rows: int) -> Cache:
        if rows not in self._views:
            if rows > self.max_rows:
                raise ValueError(f"{rows} rows exceed the cache's {self.max_rows}")
            self._views[rows] = self._make(slice(0, rows))
        return self._views[rows]

    def slot(self, r: int, k: int = 1) -> Cache:
        """Slots r .. r+k-1 (a prefill's rows)."""
        if (r, k) not in self._slots:
            if r + k > self.max_rows:
                raise ValueError(f"slots {r}..{r + k - 1} exceed the cache's {self.max_rows}")
            self._slots[(r, k)] = self._make(slice(r, r + k))
        return self._slots[(r, k)]

    # the interface Capture and DecodeEngine.scratch use
    def reset(self) -> None:
        self.lengths.zero_()
        for t in (*self.keys, *self.values):
            t.zero_()

    def save_lengths(self):
        return self.lengths.clone()

    def restore_lengths(self, saved) -> None:
        self.lengths.copy_(saved)

    def move(self, src: int, dst: int, n: int | None = None) -> None:
        """Copy slot src's K/V rows and length into slot dst (device copies); n: only its first n cache slots (the
        rest are unread: the mask hides slots at or past a row's length, and decode writes before it reads)."""
        n = self.max_cache_len if n is None else n
        for t in (*self.keys, *self.values):
            t[dst, :, :n].copy_(t[src, :, :n])
        self.lengths[dst] = self.lengths[src]


def ragged_windows(config, attn_implementation: str):
    """How the 4D mask carries sliding windows -> (kind, window): ("none", 0) one causal mask; ("all", w) one mask
    windowed to w for every layer; ("layer_types", w) a {layer type: mask} dict (Qwen2-MoE and GPT-OSS take one
    and pick each layer's mask by config.layer_types). Refuses what a 4D mask cannot express. Reads only the config,
    so the run plan asks it before any model is built."""
    adapter = adapter_for(config)
    windows = adapter.attention_windows(config)
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"ragged decode builds its own 4D attention mask: attn_implementation="
                         f"{attn_implementation!r} is not supported (use sdpa or eager)")
    if not any(windows):
        return "none", 0
    if all(w == windows[0] for w in windows):
        return "all", windows[0]
    if adapter.windows == "layer_types" and len({w for w in windows if w}) == 1:
        return "layer_types", max(windows)
    raise ValueError(f"ragged decode does not support these sliding windows per layer ({windows}): "
                     f"{adapter.family}'s model takes one attention mask for every layer")


class RaggedEngine(DecodeEngine):
    """Greedy serving-like decode: requests join (`add`) and leave (`remove`) between steps (`step`).

    Capture strategies apply through moecg.capture.Capture as on DecodeEngine (its step policy, set_policy; and
    eager_step, scratch, cache.reset/save_lengths/restore_lengths); apply the capture before the first `add`
    (capturing resets the cache).
    """

    def __init__(self, model, max_cache_len: int, max_rows: int):
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_cache_len, self.max_rows = max_cache_len, max_rows
        adapter_for(model).check_supported(model.config, "hf")
        self._windows = ragged_windows(model.config, model.config._attn_implementation)
        self.cache = RaggedCache(model.config, max_rows, max_cache_len, self.device, self.dtype)
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # [B_max] current tokens
        self.live = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # [B_max] 1: a live row
        self.tok_buf = torch.zeros(max_rows, max_cache_len, dtype=torch.long, device=self.device)  # [B_max, L]
        self.n_tok = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # [B_max] tokens in tok_buf
        self._rows_ar = torch.arange(max_rows, device=self.device)  # [B_max]
        self._plen = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # [B_max] a batched prefill's lengths
        self._slots_ar = torch.arange(max_cache_len, device=self.device)  # [L]
        self._additive = model.config._attn_implementation == "eager"
        self.set_policy(None)  # EagerPolicy, no decode_forward
        # host bookkeeping: slot i holds request order[i]; host copies of each request's length
        self.order: list = []
        self.host_len: dict = {}
        self.n_generated: dict = {}  # request id -> tokens generated so far (host count, no sync)
        self.tokens: dict = {}  # request id -> generated tokens (first from the prefill); sync=True calls only
        self.last_logits: torch.Tensor | None = None  # [m, V] of the last step (or prefill for add)
        self.step_rows: list[int] = []

    @property
    def decode_forward(self):
        return self._decode_forward

    @decode_forward.setter
    def decode_forward(self, fn):
        # the fused step (moecg.fast.FastDecode, per_row_positions) reads each row's position from RaggedLayer.lengths
        self._decode_forward = fn

    # -- forwards ---------------------------------------------------------------------------------------
    def _mask(self, pos: torch.Tensor):
        """pos [B, S] absolute positions -> [B, 1, S, L] mask: a row's query at p sees slots k <= p (and, in a
        sliding layer of window w, k > p - w: HF's sliding_window_causal_mask_function); a dict per layer type
        where layers differ."""
        slots, p = self._slots_ar[None, None, :], pos[:, :, None]  # [1, 1, L], [B, S, 1]
        causal = slots <= p  # [B, S, L]
        kind, w = self._windows
        if kind == "none":
            return self._form(causal)
        windowed = self._form(causal & (slots > p - w))
        if kind == "all":
            return windowed
        return {"full_attention": self._form(causal), "sliding_attention": windowed}

    def _form(self, m: torch.Tensor) -> torch.Tensor:
        """[B, S, L] bool -> [B, 1, S, L]: bool for sdpa, additive for eager attention."""
        m = m[:, None]
        if self._additive:
            m = torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill_(~m, torch.finfo(self.dtype).min)
        return m

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, cache: Cache, lengths: torch.Tensor, decode: bool, keep=1) -> torch.Tensor:
        """ids [B, S] on `cache` (rows with lengths [B]) -> logits [B, V] at the last position, or at each row's
        position keep [B, 1] (a right-padded batch of prompts)."""
        S = ids.shape[1]
        pos = lengths[:, None] + torch.arange(S, device=self.device)  # [B, S]
        call = self.decode_forward if decode and self.decode_forward is not None else self.model
        # the fused step reads each row's position from the cache and masks in its kernels: no 4D mask to build
        mask = None if getattr(call, "per_row_positions", False) else self._mask(pos)
        out = call(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                   logits_to_keep=keep, output_router_logits=False)
        return out.logits[:, -1]

    def forward(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        state = state_of(self.model)
        with state.rows(rows) if state is not None else null_context():
            return self._run(ids, self.cache.view(rows), self.cache.lengths[:rows], ids.shape[1] == 1)

    def eager_step(self, ids: torch.Tensor, rows: int):
        """ids [B_max] -> (next ids [B], logits [B, V]); live rows' lengths advance by one (in place, on device)."""
        logits = self.forward(ids[:rows, None], rows)
        self.cache.lengths[:rows].add_(self.live[:rows])
        return logits.argmax(-1), logits

    # -- requests ---------------------------------------------------------------------------------------
    @property
    def n_live(self) -> int:
        return len(self.order)

    @torch.no_grad()
    def add(self, request_id, prompt_ids, max_new_tokens: int | None = None, sync: bool = True) -> int:
        """Prefill `prompt_ids` [S] into a free slot (eagerly, one row) -> the slot. Its first token is in tok_buf
        (and, with sync=True, in tokens[id]). A prompt already on the device is not copied again."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
        S = prompt.numel()
        self._check_request(request_id, S, max_new_tokens)
        if self.n_live >= self.max_rows:
            raise ValueError(f"all {self.max_rows} slots are busy: remove a finished request first (or raise max_rows)")
        r = self.n_live
        state = state_of(self.model)
        if state is not None:
            state.set_rows(1, 1)
        self.cache.lengths[r] = 0
        with (state.prefill() if state is not None else null_context()), \
                (state.rows(1) if state is not None else null_context()):
            logits = self._run(prompt.to(self.device)[None], self.cache.slot(r), self.cache.lengths[r:r + 1], False)
        self.cache.lengths[r] = S
        self._admitted(r, [request_id], [S], logits, sync)
        return r

    @torch.no_grad()
    def add_many(self, request_ids, prompts, max_new_tokens=None, sync: bool = True) -> list[int]:
        """Prefill several requests in one forward (eagerly) into consecutive free slots -> their slots.

        The prompts [S_j] are right-padded to the longest: row j's real tokens sit at positions 0..S_j-1 and its
        logits are taken at S_j-1 (logits_to_keep per row); the pad tokens' keys land in slots >= S_j, which the mask
        hides until decode overwrites them, one slot per step, before reading. Pad tokens are routed like real ones:
        a prefill dispatcher that drops (capacity) would let them take capacity, so callers prefill such requests
        one by one (moecg.serving does). A single request is `add`."""
        ids = list(request_ids)
        k = len(ids)
        news = list(max_new_tokens) if max_new_tokens is not None else [None] * k
        if k == 1:
            return [self.add(ids[0], prompts[0], news[0], sync=sync)]
        toks = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        lens = [t.numel() for t in toks]
        for rid, S, n in zip(ids, lens, news):
            if ids.count(rid) > 1:
                raise ValueError(f"request {rid!r} is already running")
            self._check_request(rid, S, n)
        if self.n_live + k > self.max_rows:
            raise ValueError(f"{k} requests need {k} free slots and {self.max_rows - self.n_live} are free: remove "
                             "finished requests first (or raise max_rows)")
        r = self.n_live
        S_max = max(lens)
        padded = torch.zeros(k, S_max, dtype=torch.long, device=self.device)  # [k, S_max]
        for j, t in enumerate(toks):
            padded[j, :lens[j]] = t.to(self.device)
            self._plen[r + j] = lens[j]  # a host scalar into a device tensor: no sync
        keep = (self._plen[r:r + k] - 1)[:, None]  # [k, 1] each row's last real position
        state = state_of(self.model)
        if state is not None:
            state.set_rows(k, k)
        self.cache.lengths[r:r + k] = 0
        with (state.prefill() if state is not None else null_context()), \
                (state.rows(k) if state is not None else null_context()):
            logits = self._run(padded, self.cache.slot(r, k), self.cache.lengths[r:r + k], False, keep)  # [k, V]
        self.cache.lengths[r:r + k] = self._plen[r:r + k]
        self._admitted(r, ids, lens, logits, sync)
        return list(range(r, r + k))

    def _check_request(self, request_id, S: int, max_new_tokens: int | None) -> None:
        """A request `add`/`add_many` can take: not running already, and its prompt + new tokens fit a row's cache."""
        if request_id in self.host_len:
            raise ValueError(f"request {request_id!r} is already running")
        need = S + (max_new_tokens if max_new_tokens is not None else 1)
        if S < 1 or need > self.max_cache_len:
            raise CacheOverflowError(
                f"request {request_id!r}: prompt of {S} tokens + {max_new_tokens or 1} new = {need} exceeds the KV "
                f"cache ({self.max_cache_len} slots per row): shorten it or raise max_cache_len")

    def _admitted(self, r: int, ids: list, lens: list[int], logits: torch.Tensor, sync: bool) -> None:
        """Requests `ids` were prefilled into slots r.. (lengths already set): first tokens from `logits` [k, V]
        into the current ids and the token buffer, and the host bookkeeping (one host read with sync=True)."""
        k = len(ids)
        first = logits.argmax(-1)  # [k]
        self.live[r:r + k] = 1
        self.ids[r:r + k] = first
        self.tok_buf[r:r + k, 0] = first
        self.n_tok[r:r + k] = 1
        host = first.tolist() if sync else None
        for j, rid in enumerate(ids):
            self.order.append(rid)
            self.host_len[rid] = lens[j]
            self.n_generated[rid] = 1
            if sync:
                self.tokens[rid] = [host[j]]
        self.last_logits = logits

    def remove(self, request_id, sync: bool = True):
        """The request leaves; the last live row moves into its slot. Returns its generated tokens: a list (one host
        read), or with sync=False a device tensor [n] (a copy, no sync)."""
        r = self.order.index(request_id)
        n = self.n_generated.pop(request_id)
        toks = self.tok_buf[r, :n].clone()  # [n]
        last = self.n_live - 1
        if r != last:
            self.cache.move(last, r, self.host_len[self.order[last]])
            self.ids[r] = self.ids[last]
            n_last = self.n_generated[self.order[last]]
            self.tok_buf[r, :n_last] = self.tok_buf[last, :n_last]
            self.n_tok[r] = self.n_tok[last]
            self.order[r] = self.order[last]
        self.order.pop()
        self.cache.lengths[last] = 0
        self.live[last] = 0
        self.ids[last] = 0
        self.n_tok[last] = 0
        del self.host_len[request_id]
        self.tokens.pop(request_id, None)
        return toks.tolist() if sync else toks

    @torch.no_grad()
    def step(self, sync: bool = True) -> dict | None:
        """One greedy decode step for every live request -> {request id: next token}; with sync=False the tokens
        stay on the device (tok_buf) and nothing is returned: no host sync."""
        m = self.n_live
        if m == 0:
            return {} if sync else None
        full = [rid for rid in self.order if self.host_len[rid] >= self.max_cache_len]
        if full:
            raise CacheOverflowError(f"requests {full} filled their {self.max_cache_len} cache slots: remove them "
                                     "before the next step (or raise max_cache_len)")
        rows = self.rows_for(m)
        self.ids[m:rows] = 0
        self._set_rows(m, rows)
        nxt, logits = self.step_impl(self.ids, rows)
        self.ids[:m] = nxt[:m]
        # row b's token goes to tok_buf[b, n_tok[b]]: device indices, so the host never reads a count
        self.tok_buf.index_put_((self._rows_ar[:m], self.n_tok[:m]), nxt[:m])
        self.n_tok[:m] += 1
        self.last_logits = logits[:m]
        self.step_rows.append(rows)
        for rid in self.order:
            self.host_len[rid] += 1
            self.n_generated[rid] += 1
        if not sync:
            return None
        out = {}
        for rid, t in zip(self.order, nxt[:m].tolist()):
            self.tokens[rid].append(t)
            out[rid] = t
        return out

    def generate(self, *args, **kwargs):
        raise TypeError("RaggedEngine decodes requests: use add / step / remove (DecodeEngine.generate for batches)")
