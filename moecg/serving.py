"""Serving: a workload's requests replayed in real time on a RaggedEngine, and what it measured.

Dims: B rows a step runs (its bucket), m live requests, B_max slots, S prompt tokens, L cache slots.

One iteration of `serve`: admit the requests whose arrival time has passed, first come first served, while fewer
than max_batch are live (prefilled eagerly: consecutive admissions together in one right-padded forward of at most
`prefill_tokens` padded tokens, RaggedEngine.add_many; one by one when the prefill dispatcher drops, since pad tokens
would take capacity, or with prefill_tokens=0); run one decode step for the live ones;
let the finished ones leave (output lengths are known on the host, so no token is read to decide). Nothing in the
loop reads the device: tokens stay in the engine's device buffer until a request leaves (a device copy, read after
the run), and every timestamp is a CUDA event on a GPU (perf_counter on CPU), resolved after the run against a
reference event recorded at a synced host instant (`Clock`). The host may run ahead of the GPU by `lookahead`
steps (it waits on the end event of the step that many back, never drains the queue), so an arrival joins at
most that many steps late. With no live request the loop sleeps until the next arrival.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from moecg.dispatch import state_of
from moecg.ragged import RaggedEngine
from moecg.report import percentile
from moecg.schema import PERCENTILES


# -- time -------------------------------------------------------------------------------------------------------
class Clock:
    """Seconds since `start()`: the host's perf_counter for `now()`; `mark()` stamps device work where it runs in
    the stream (a CUDA event) and `seconds(mark)` resolves it after `finish()`, in the same host time base."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.t0, self.ref = 0.0, None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()
        if self.cuda:  # recorded on an idle stream at t0: it completes within a launch latency of t0
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter() - self.t0

    def wait(self, mark) -> None:
        """Block the host until the device reached `mark` (one event, not the whole queue)."""
        if self.cuda:
            mark.synchronize()

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, mark) -> float:
        return self.ref.elapsed_time(mark) / 1e3 if self.cuda else mark


# -- records ----------------------------------------------------------------------------------------------------
@dataclass
class RequestTimes:
    """One request's life in seconds since serving started (device times where the device did the work)."""

    id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    admit_s: float | None = None  # its prefill starts
    first_s: float | None = None  # its prefill ends: the first token
    finish_s: float | None = None  # the step that gave its last token ends


@dataclass
class Step:
    start_s: float
    end_s: float
    batch: int  # live requests (m)
    rows: int  # rows run (B: the bucket with graphs)
    after_wait: bool = False  # the loop slept for an arrival just before (no request was live)


@dataclass
class Timeline:
    requests: list[RequestTimes]
    steps: list[Step]
    prefills: list[tuple[float, float]]  # (start_s, end_s) of every prefill
    tokens: dict = field(default_factory=dict)  # request id -> generated tokens
    drops_by_batch: dict | None = None  # m -> (routed, dropped) assignments over the steps with m live requests


class DropsByBatch:
    """Routed and dropped assignments per live batch size, accumulated on the device after each step (a few tiny
    kernels, no sync) from the DispatchState counters; read once after the run."""

    def __init__(self, state, max_rows: int):
        self.state = state
        dev = state.routed.device
        self.acc = torch.zeros(max_rows + 1, 2, dtype=torch.long, device=dev)  # [B_max + 1, (routed, dropped)]
        self.last = torch.zeros(2, dtype=torch.long, device=dev)

    def after_step(self, m: int) -> None:
        tot = torch.stack((self.state.routed.sum(), self.state.dropped.sum()))  # [2]
        self.acc[m].add_(tot - self.last)
        self.last.copy_(tot)

    def read(self) -> dict:
        acc = self.acc.cpu().tolist()
        return {m: tuple(v) for m, v in enumerate(acc) if v[0]}


@contextmanager
def _not_counting(state):
    """Prefills stay out of the drop counters (decode-only rates, as count_prefill=False for a fixed batch)."""
    if state is None:
        yield
        return
    prev, state.counting = state.counting, False
    try:
        yield
    finally:
        state.counting = prev


# -- the loop ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def serve(engine, requests, prompts, max_batch: int, *, prefill_tokens: int = 8192, lookahead: int = 2,
          progress=None) -> Timeline:
    """Serve `requests` (moecg.workload.Request, ascending arrival_s) with their `prompts` ([S] ids each) on
    `engine` (a RaggedEngine, captures applied), at most max_batch at once -> the Timeline, tokens included."""
    if max_batch > engine.max_rows:
        raise ValueError(f"max_batch={max_batch} exceeds the engine's {engine.max_rows} slots")
    if engine.n_live:
        raise ValueError("the engine has live requests: serve starts from an empty batch")
    prompt_of = {r.id: p.to(engine.device) for r, p in zip(requests, prompts)}  # uploaded before the clock starts
    state = state_of(engine.model)
    drops = DropsByBatch(state, engine.max_rows) if state is not None and state.dispatcher.drops else None
    prefiller = (state.prefill_dispatcher or state.dispatcher) if state is not None else None
    budget = 0 if prefiller is not None and prefiller.drops else prefill_tokens
    clock = Clock(engine.device)
    out_len = {r.id: r.output_len for r in requests}
    marks: dict = {}  # id -> [prefill start, prefill end, last step end]
    steps, prefills, out = [], [], {}
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.id)))
    waited = False
    engine.step_rows.clear()

    def leave(rid, mark):
        marks[rid][2] = mark
        out[rid] = engine.remove(rid, sync=False)  # a device copy of its tokens
        if progress is not None:
            progress()

    clock.start()
    while pending or engine.n_live:
        now = clock.now()
        admitted = []
        while pending and pending[0].arrival_s <= now and engine.n_live + len(admitted) < max_batch:
            admitted.append(pending.popleft())
        for group in prefill_groups(admitted, budget):
            a = clock.mark()
            with _not_counting(state):
                engine.add_many([r.id for r in group], [prompt_of[r.id] for r in group],
                                [r.output_len for r in group], sync=False)
            b = clock.mark()
            prefills.append((a, b))
            for r in group:
                marks[r.id] = [a, b, None]
            for r in group:
                if r.output_len == 1:
                    leave(r.id, b)
        if not engine.n_live:
            if pending:
                time.sleep(max(0.0, pending[0].arrival_s - clock.now()))
                waited = True
            continue
        if lookahead and len(steps) >= lookahead:
            clock.wait(steps[-lookahead][1])  # keep `lookahead` steps queued, no more
        m = engine.n_live
        s = clock.mark()
        engine.step(sync=False)
        e = clock.mark()
        steps.append((s, e, m, engine.step_rows[-1], waited))
        waited = False
        if drops is not None:
            drops.after_step(m)
        for rid in [rid for rid in engine.order if engine.n_generated[rid] >= out_len[rid]]:
            leave(rid, e)
    clock.finish()

    sec = clock.seconds
    times = []
    for r in requests:
        a, b, f = marks[r.id]
        times.append(RequestTimes(r.id, r.arrival_s, r.prompt_len, r.output_len, sec(a), sec(b), sec(f)))
    return Timeline(times, [Step(sec(s), sec(e), m, rows, w) for s, e, m, rows, w in steps],
                    [(sec(a), sec(b)) for a, b in prefills], {rid: t.tolist() for rid, t in out.items()},
                    drops.read() if drops is not None else None)


def prefill_groups(requests, budget: int) -> list[list]:
    """Consecutive requests (admission order) in groups whose right-padded prompts (rows x longest) stay within
    `budget` tokens; budget 0: one request per group."""
    groups: list[list] = []
    for r in requests:
        g = groups[-1] if groups else None
        if g and budget and (len(g) + 1) * max(r.prompt_len, *(x.prompt_len for x in g)) <= budget:
            g.append(r)
        else:
            groups.append([r])
    return groups


@torch.no_grad()
def warm(engine, prompt, steps: int = 2) -> None:
    """One request in and out before timing: lazy initialisation (kernels picked for the prefill, allocator state)
    happens here, not in the first served request. Counters and the step log are left as they were."""
    state = state_of(engine.model)
    saved = state.save() if state is not None else None
    engine.add("__warm__", prompt, steps + 1, sync=False)
    for _ in range(steps):
        engine.step(sync=False)
    engine.remove("__warm__", sync=False)
    if state is not None:
        state.restore(saved)
    engine.step_rows.clear()


@torch.no_grad()
def decode_alone(model, requests, prompts, max_cache_len: int) -> dict:
    """Every request decoded by itself (a one-slot RaggedEngine, greedy, eager, whatever dispatcher is attached)
    -> {id: tokens}: what each request's served tokens should equal."""
    eng = RaggedEngine(model, max_cache_len, 1)
    out = {}
    for r, p in zip(requests, prompts):
        eng.add(r.id, p, r.output_len, sync=False)
        for _ in range(r.output_len - 1):
            eng.step(sync=False)
        out[r.id] = eng.remove(r.id)
    return out


# -- metrics ----------------------------------------------------------------------------------------------------


def _pcts(name: str, xs) -> dict:
    xs = [x for x in xs if x is not None]
    return {f"{name}_p{p}": (percentile(xs, p / 100) if xs else None) for p in PERCENTILES}


def request_metrics(requests: list[RequestTimes], start_s: float = 0.0) -> dict:
    """Per-request latencies and their percentiles (ms), output tokens/s over the span from start_s to the last
    token. TTFT: arrival to the first token (queueing + prefill); TPOT: (last - first token) / (output_len - 1),
    requests of one token have none; e2e: arrival to the last token."""
    rows = []
    for r in requests:
        tpot = (r.finish_s - r.first_s) / (r.output_len - 1) * 1e3 if r.output_len > 1 else None
        rows.append({"id": r.id, "arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len,
                     "queue_ms": (r.admit_s - r.arrival_s) * 1e3 if r.admit_s is not None else None,
                     "prefill_ms": (r.first_s - r.admit_s) * 1e3 if r.admit_s is not None else None,
                     "ttft_ms": (r.first_s - r.arrival_s) * 1e3, "tpot_ms": tpot,
                     "e2e_ms": (r.finish_s - r.arrival_s) * 1e3})
    span = max(r.finish_s for r in requests) - start_s
    tokens = sum(r.output_len for r in requests)
    out = {"n_requests": len(requests), "serving_s": span, "output_tokens": tokens,
           "output_tokens_per_s": tokens / span if span > 0 else None}
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out.update(_pcts(k, [row[k] for row in rows]))
    out["requests"] = rows
    return out


def gpu_idle_share(steps: list[Step], prefills: list[tuple[float, float]]) -> float | None:
    """Device time between consecutive decode steps (one's end to the next one's start) that no prefill covers,
    as a share of the decode steps' own time. Gaps the loop spent asleep for an arrival (no live request) do not
    count: nothing was there to run. What remains is the host's scheduling (and slot moves) between steps."""
    busy = sum(s.end_s - s.start_s for s in steps)
    if not steps or busy <= 0:
        return None
    idle = 0.0
    for prev, nxt in zip(steps, steps[1:]):
        if nxt.after_wait:
            continue
        lo, hi = prev.end_s, nxt.start_s
        covered = sum(max(0.0, min(pe, hi) - max(ps, lo)) for ps, pe in prefills if pe > lo and ps < hi)
        idle += max(0.0, (hi - lo) - covered)
    return idle / busy


STEADY_MIN_STEPS = 5  # steps of one rows-run value needed before their spread says anything


def rows_spread(steps: list[Step]) -> float | None:
    """p90 / p50 of the decode steps that ran the same rows, the largest over the rows values with at least
    STEADY_MIN_STEPS steps: a step's cost is set by its rows (the bucket, or the live batch without graphs), so
    steps of one rows value that differ say the machine was busy. None when no rows value has enough steps."""
    by_rows: dict[int, list[float]] = {}
    for s in steps:
        by_rows.setdefault(s.rows, []).append(s.end_s - s.start_s)
    spreads = [percentile(ts, 0.9) / percentile(ts, 0.5) for ts in by_rows.values()
               if len(ts) >= STEADY_MIN_STEPS and percentile(ts, 0.5) > 0]
    return max(spreads) if spreads else None


def step_metrics(steps: list[Step], prefills, drops_by_batch: dict | None) -> dict:
    """Histograms of live batch sizes and rows run, padding waste (pad rows / rows run), step latency p50/p90,
    drop rate per batch size (dispatchers that drop), GPU idle share, the spread of steps of equal rows."""
    batch_hist, rows_hist = {}, {}
    for s in steps:
        batch_hist[s.batch] = batch_hist.get(s.batch, 0) + 1
        rows_hist[s.rows] = rows_hist.get(s.rows, 0) + 1
    ms = [(s.end_s - s.start_s) * 1e3 for s in steps]
    rows_run = sum(s.rows for s in steps)
    return {
        "decode_steps": len(steps), "step_ms": ms, "step_batch": [s.batch for s in steps],
        "ms_per_token_p50": percentile(ms, 0.5) if ms else None,
        "ms_per_token_p90": percentile(ms, 0.9) if ms else None,
        "batch_size_hist": {str(k): v for k, v in sorted(batch_hist.items())},
        "bucket_hist": {str(k): v for k, v in sorted(rows_hist.items())},
        "padding_waste": (rows_run - sum(s.batch for s in steps)) / rows_run if rows_run else None,
        "drop_rate_by_batch": None if drops_by_batch is None else
        {str(m): (d / r if r else 0.0) for m, (r, d) in sorted(drops_by_batch.items())},
        "gpu_idle_share": gpu_idle_share(steps, prefills),
        "latency_spread": rows_spread(steps),
    }
