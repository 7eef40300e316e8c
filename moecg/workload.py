"""Workloads (`workload=`): the requests a run decodes. `fixed` is today's batch (batch_size rows of prompt_len
tokens, new_tokens each, started together; the default); `poisson` draws seeded arrivals and lengths; `trace` reads
a JSONL or CSV file of `arrival_s, prompt_len, output_len` per request (a sample ships: moecg/data/sample_trace.jsonl).

Dims: S prompt tokens, V vocab. Host-side only: the run plan resolves every request and its prompt ids and checks
them before any CUDA work; a bad trace is refused with the file, the line, the field and the fix. Arrival times are
seconds from the start of serving (real time: moecg.serving admits a request once the wall clock passes it);
`output_len` counts every generated token, the first from the request's prefill, as new_tokens does for `fixed`.
"""
from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from moecg.config.readers import PlanError, as_bool, as_float, as_int, plain
from moecg.config.workload import WORKLOADS
from moecg.quality import heldout_prompts

NAMES = tuple(WORKLOADS)  # fixed | poisson | trace
KEYS = {n: tuple(f.name for f in fields(cls)) for n, cls in WORKLOADS.items()}  # what each reads; others are refused
TRACE_FIELDS = ("arrival_s", "prompt_len", "output_len")
MAX_REQUESTS = 100_000  # workload=poisson: requests in one run
MAX_ARRIVAL_S = 86_400  # workload=poisson: the expected arrival span (n_requests / rate), served in real time
SAMPLE_TRACE = Path(__file__).resolve().parent / "data" / "sample_trace.jsonl"
_EXAMPLE = '{"arrival_s": 0.25, "prompt_len": 32, "output_len": 16}'


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float  # seconds after serving starts
    prompt_len: int
    output_len: int  # tokens generated, the first by the prefill
    line: int | None = None  # trace line, for error messages


@dataclass(frozen=True)
class WorkloadPlan:
    name: str  # fixed | poisson | trace
    requests: tuple[Request, ...] = ()
    prompts: tuple = field(default=(), repr=False, compare=False)  # per request: [S] int64 host tensor
    max_batch: int | None = None  # requests decoded at once at most (serving only)
    prefill_tokens: int = 0  # padded prompt tokens one batched prefill may hold (0: one request per prefill)
    rate: float | None = None  # poisson: requests per second
    file: str | None = None  # trace: the file's name, without its directory (results carry no machine paths)
    seed: int | None = None
    anchor: bool = False  # also serve the requests with transformers' continuous batching (moecg.anchor)

    @property
    def serving(self) -> bool:
        return self.name != "fixed"

    @property
    def n_requests(self) -> int:
        return len(self.requests)

    def describe(self) -> str:
        if not self.serving:
            return "workload=fixed"
        src = f"{self.rate:g} req/s" if self.name == "poisson" else self.file
        p = [r.prompt_len for r in self.requests]
        o = [r.output_len for r in self.requests]
        return (f"workload={self.name} ({src}): {self.n_requests} requests, prompts {min(p)}-{max(p)}, outputs "
                f"{min(o)}-{max(o)} tokens, max_batch {self.max_batch}{', anchor' if self.anchor else ''}")


FIXED = WorkloadPlan("fixed")


# -- resolution (called by moecg.plan.resolve_plan) ------------------------------------------------------------------
def workload_name(w) -> str:
    name = "fixed" if w is None else w.get("name", "fixed")
    if name not in NAMES:
        raise PlanError(f"workload={name!r}: choose one of {', '.join(NAMES)}")
    return name


def resolve_workload(w, *, vocab: int, prompts_kind: str, max_cache_len, max_positions: int | None,
                     default_seed: int) -> tuple[WorkloadPlan, int | None]:
    """The workload config -> (plan, KV cache slots per row). `max_cache_len` None: the longest request's
    prompt_len + output_len. A fixed workload returns (FIXED, max_cache_len) untouched."""
    name = workload_name(w)
    d = plain(w)
    if name == "fixed":
        extra = [k for k in d if k not in KEYS["fixed"]]
        if extra:
            raise PlanError(f"workload.{extra[0]} does not apply to workload=fixed (it reads batch_size, prompt_len, "
                            "new_tokens): drop it, or pick workload=poisson or workload=trace")
        return FIXED, max_cache_len
    unknown = [k for k in d if k not in KEYS[name]]
    if unknown:
        raise PlanError(f"workload.{unknown[0]}: not a key of workload={name} (its keys: "
                        f"{', '.join(k for k in KEYS[name] if k != 'name')}): fix the spelling or drop it")
    c = WORKLOADS[name](**d)  # a key left out takes the workload's default
    seed = default_seed if c.seed is None else as_int(c.seed, "workload.seed", None, 0)
    max_batch = as_int(c.max_batch, "workload.max_batch", 1, 8)
    prefill_tokens = as_int(c.prefill_tokens, "workload.prefill_tokens", 0, 8192)
    anchor = as_bool(c.anchor, "workload.anchor")
    if prompts_kind == "file":
        raise PlanError(f"prompts=file gives fixed-length rows; workload={name} draws each request's prompt: use "
                        "prompts=random (or heldout on byte-level models)")
    rate = file = None
    if name == "poisson":
        rate = as_float(c.rate, "workload.rate", 0.0, strict=True, example=4.0)
        n = as_int(c.n_requests, "workload.n_requests", 1, 32)
        if n > MAX_REQUESTS:  # every request's prompt is drawn in the plan
            raise PlanError(f"workload.n_requests={n}: at most {MAX_REQUESTS} requests in one run (every prompt is "
                            f"drawn up front): lower workload.n_requests")
        if n / rate > MAX_ARRIVAL_S:
            raise PlanError(f"workload.rate={rate:g}: {n} requests would arrive over about {n / rate:.3g} s, served in "
                            f"real time (at most {MAX_ARRIVAL_S} s): raise workload.rate (e.g. workload.rate=4)")
        requests = poisson_requests(rate, n, c.prompt_len, c.output_len, seed)
        where = lambda r: "workload.prompt_len/output_len"  # noqa: E731
        shorten = "lower workload.prompt_len/output_len"
    else:
        given = c.file
        path = SAMPLE_TRACE if given in (None, "", "sample") else Path(str(given)).expanduser()
        file = path.name
        requests = read_trace(path, str(given) if given not in (None, "", "sample") else path.name)
        where = lambda r: f"workload.file={given if given else path.name}, line {r.line}"  # noqa: E731
        shorten = "shorten the request"
    need = max(r.prompt_len + r.output_len for r in requests)
    if max_cache_len is None:
        cache = need
        if max_positions and cache > max_positions:
            r = next(r for r in requests if r.prompt_len + r.output_len > max_positions)
            raise PlanError(f"{where(r)}: prompt_len + output_len = {r.prompt_len + r.output_len} exceeds the model's "
                            f"max_position_embeddings={max_positions}: {shorten}")
    else:
        cache = as_int(max_cache_len, "max_cache_len", 1, need)
        long = [r for r in requests if r.prompt_len + r.output_len > cache]
        if long:
            r = long[0]
            raise PlanError(f"{where(r)}: prompt_len + output_len = {r.prompt_len + r.output_len} exceeds "
                            f"max_cache_len={cache} (the KV cache per row): raise max_cache_len (or leave it null) or "
                            f"{shorten}")
        if max_positions and cache > max_positions:
            raise PlanError(f"max_cache_len={cache} exceeds the model's max_position_embeddings={max_positions}: "
                            f"lower it (at most {max_positions})")
    prompts = tuple(request_prompt(prompts_kind, r, seed, vocab) for r in requests)
    return WorkloadPlan(name, tuple(requests), prompts, max_batch, prefill_tokens, rate, file, seed, anchor), cache


# -- poisson -------------------------------------------------------------------------------------------------------
def _length_sampler(spec, key: str):
    """An integer, [low, high] (uniform, inclusive) or {choices: [a, b, ...]} -> rng -> length."""
    fix = (f"workload.{key}={spec!r}: give an integer, [low, high] (uniform, inclusive) or {{choices: [a, b]}} of "
           f"integers >= 1 (e.g. workload.{key}=[16,64])")
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    if ok(spec):
        return lambda rng: spec
    if isinstance(spec, (list, tuple)) and len(spec) == 2 and all(map(ok, spec)) and spec[0] <= spec[1]:
        lo, hi = spec
        return lambda rng: rng.randint(lo, hi)
    if isinstance(spec, dict) and list(spec) == ["choices"] and isinstance(spec["choices"], (list, tuple)) \
            and spec["choices"] and all(map(ok, spec["choices"])):
        choices = list(spec["choices"])
        return lambda rng: rng.choice(choices)
    raise PlanError(fix)


def poisson_requests(rate: float, n: int, prompt_len, output_len, seed: int) -> list[Request]:
    """n requests of a Poisson process of `rate` per second (exponential gaps, the first after one gap); lengths
    drawn per request. One seeded generator, in request order: the same seed gives the same list."""
    p, o = _length_sampler(prompt_len, "prompt_len"), _length_sampler(output_len, "output_len")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(Request(i, t, p(rng), o(rng)))
    return out


# -- traces --------------------------------------------------------------------------------------------------------
def read_trace(path: Path, shown: str) -> list[Request]:
    """A JSONL (one object per line) or CSV (a header row) of arrival_s, prompt_len, output_len -> requests."""
    head = f"workload.file={shown}"
    if not path.is_file():
        raise PlanError(f"{head}: no such file (a .jsonl or .csv with {', '.join(TRACE_FIELDS)} per request; "
                        f"null for the shipped sample)")
    kind = path.suffix.lower()
    if kind not in (".jsonl", ".csv"):
        raise PlanError(f"{head}: unknown trace format {kind or '(no suffix)'!r}: name it .jsonl (one object per line, "
                        f"e.g. {_EXAMPLE}) or .csv (header {','.join(TRACE_FIELDS)})")
    rows: list[tuple[int, dict]] = []
    text = path.read_text(errors="replace")
    if kind == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlanError(f"{head}, line {n}: not JSON ({e.msg}): write one object per line, e.g. "
                                f"{_EXAMPLE}") from None
            if not isinstance(obj, dict):
                raise PlanError(f"{head}, line {n}: a JSON object per line is needed, e.g. {_EXAMPLE}")
            rows.append((n, obj))
    else:
        reader = csv.DictReader(text.splitlines())
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [f for f in TRACE_FIELDS if f not in header]
        if missing:
            raise PlanError(f"{head}, line 1: the CSV header lacks {', '.join(missing)}: the first row names the "
                            f"columns, {','.join(TRACE_FIELDS)}")
        for rec in reader:
            rows.append((reader.line_num, {k.strip(): (v.strip() if isinstance(v, str) else v)
                                           for k, v in rec.items() if k is not None}))
    if not rows:
        raise PlanError(f"{head}: no requests in the file (one line per request, e.g. {_EXAMPLE})")
    out, prev = [], None
    for i, (n, rec) in enumerate(rows):
        where = f"{head}, line {n}"
        unknown = [k for k in rec if k not in TRACE_FIELDS]
        if unknown:
            raise PlanError(f"{where}: unknown field {unknown[0]!r}: a request has {', '.join(TRACE_FIELDS)}")
        missing = [f for f in TRACE_FIELDS if rec.get(f) in (None, "")]
        if missing:
            raise PlanError(f"{where}: field {missing[0]!r} missing: every request needs {', '.join(TRACE_FIELDS)} "
                            f"(e.g. {_EXAMPLE})")
        t = _number(rec["arrival_s"], where, "arrival_s")
        if t < 0:
            raise PlanError(f"{where}: arrival_s={t:g} is negative: times are seconds from the start of serving (>= 0)")
        if prev is not None and t < prev[1]:
            raise PlanError(f"{where}: arrival_s={t:g} is earlier than line {prev[0]}'s {prev[1]:g}: sort the trace by "
                            "arrival_s")
        lengths = [_length(rec[f], where, f) for f in ("prompt_len", "output_len")]
        out.append(Request(i, t, *lengths, line=n))
        prev = (n, t)
    return out


def _number(v, where: str, key: str) -> float:
    try:
        x = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise PlanError(f"{where}: {key}={v!r} is not a finite number of seconds")
    return x


def _length(v, where: str, key: str) -> int:
    try:
        n = int(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else None
    except ValueError:
        n = None
    if n is None and isinstance(v, float) and v.is_integer():
        n = int(v)
    if n is None:
        raise PlanError(f"{where}: {key}={v!r} is not an integer number of tokens")
    if n < 1:
        raise PlanError(f"{where}: {key}={n} must be >= 1 token")
    return n


# -- prompts -------------------------------------------------------------------------------------------------------
def request_prompt(kind: str, r: Request, seed: int, vocab: int) -> torch.Tensor:
    """[S] int64 prompt ids for request r: seeded per request, so a request's prompt does not depend on the others."""
    if kind == "heldout":
        if vocab != 256:
            raise PlanError(f"prompts=heldout gives byte ids, and this model's vocab is {vocab}: use a byte-level "
                            "model (*_stdlib) or prompts=random")
        return heldout_prompts(1, r.prompt_len, seed * 100_003 + r.id)[0]
    g = torch.Generator().manual_seed(seed * 100_003 + r.id)
    return torch.randint(0, vocab, (r.prompt_len,), generator=g)  # [S]
