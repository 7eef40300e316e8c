"""The results schema, defined once: results.json, the run summary, `moecg.analysis` and the README table all
read this list (`python -m moecg.schema` prints the README table; a test checks the README holds it).

Flags: `summary` rows of the printed run summary, `analysis` columns of `moecg.analysis`'s table, `axis` sweep
axes (always columns, filled from the config for failed jobs: `config` names the keys an axis is read from).
`PERCENTILES` are the percentiles every per-request latency is recorded at.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PERCENTILES = (50, 90, 99)  # of every per-request latency (serving, anchor): <latency>_p50, _p90, _p99


@dataclass(frozen=True)
class Field:
    name: str
    group: str
    doc: str
    summary: bool = False
    analysis: bool = False
    axis: bool = False
    config: tuple[str, ...] = ()  # axes: the config keys it is read from for a failed job (the first not null)


_S, _A, _X = "summary", "analysis", "axis"


def _f(name, group, doc, *flags, config=()):
    return Field(name, group, doc, _S in flags, _A in flags, _X in flags, tuple(config))


def _pct(name, group, doc, summary=None, analysis=None):
    """One field per PERCENTILES of one per-request latency."""
    first = PERCENTILES[0]
    return tuple(Field(f"{name}_p{p}", group, f"{doc}: p{p}" if p == first else f"p{p}", p == summary, p == analysis)
                 for p in PERCENTILES)


FIELDS: tuple[Field, ...] = (
    # what ran
    _f("model", "what", "preset name, or the checkpoint directory's name for model=local", _S, _A, _X,
       config=("model.preset", "model.pretrained_path")),
    _f("family", "what", "the model family (a key of moecg.models.zoo.FAMILIES, e.g. mixtral, deepseek_v3, gpt_oss)"),
    _f("num_layers", "what", "decoder layers"),
    _f("num_experts", "what", "routed experts per MoE layer"),
    _f("top_k", "what", "experts per token"),
    _f("dtype", "what", "activations, and the weights a format does not quantize (model.dtype)"),
    _f("weights", "what", "the weight format (model.weights): full (every weight in dtype) | fp8_block (e4m3 values, "
       "one fp32 scale per 128 x 128 block: experts, shared experts, dense MLPs and attention projections)",
       _S, _A, _X, config=("model.weights",)),
    _f("activations", "what", "how the block-FP8 GEMMs take their inputs (model.activations): full (as they are: "
       "W8A16) | fp8_dynamic (each token's 128-column blocks quantized to e4m3, one fp32 scale each: W8A8, the "
       "checkpoints' activation_scheme: dynamic; MLA's kv_b_proj excepted)", _S, _A, _X,
       config=("model.activations",)),
    _f("weight_bytes", "what", "bytes of all the model's parameters as stored (values + block scales)"),
    _f("attn_implementation", "what", "the attention HF's modules ran (model.attn_implementation, or eager where the "
       "family has no sdpa path: GPT-OSS's sinks)"),
    _f("device", "what", "cpu | cuda"),
    # how
    _f("strategy", "how", "eager | partial | layer | full | capacity | mixed", _S, _A, _X, config=("strategy.name",)),
    _f("strategy_layers", "how", "strategy=mixed: the per-layer scopes as given"),
    _f("dispatch", "how", "dynamic | dropless | fused | capacity", _S, _A, _X, config=("dispatch.name",)),
    _f("capacity_factor", "how", "dispatch=capacity only (null otherwise)", _S, _A, _X,
       config=("dispatch.capacity_factor",)),
    _f("drop_policy", "how", "dispatch=capacity only: probs | position", _A, _X, config=("dispatch.drop_policy",)),
    _f("prefill_dispatch", "how", "the eager prefill's dispatcher (dispatch.prefill)"),
    _f("router_skew", "how", "model.router_skew"),
    _f("kernels", "how", "capture.kernels: hf (HF's modules) | fused (moecg.fast's decode step)", _S),
    _f("kernel_backend", "how", "kernels=fused: which ops ran (triton | torch); null for hf"),
    _f("ep", "how", "parallel.ep: expert-parallel ranks, one process each (1: one process, today's path)", _S, _A, _X,
       config=("parallel.ep",)),
    _f("ep_backend", "how", "ep > 1: the torch.distributed backend that carried the all-to-alls (nccl | gloo)"),
    # workload
    _f("workload", "workload", "fixed (one batch started together) | poisson | trace (serving: requests join and "
       "leave, moecg.serving)", _S, _A, _X, config=("workload.name",)),
    _f("batch_size", "workload", "real rows (workload=fixed, on each rank with ep > 1; serving: null, see max_batch)",
       _S, _A, _X, config=("batch_size",)),
    _f("bucket", "workload", "rows a captured step runs (the batch padded up); null without graphs or when serving "
       "(see bucket_hist)", _S),
    _f("prompt_len", "workload", "prompt tokens per row (workload=fixed)"),
    _f("new_tokens", "workload", "tokens generated per row, the first by the prefill (workload=fixed)"),
    _f("max_cache_len", "workload", "KV cache slots per row"),
    _f("prefill_chunk", "workload", "prompt tokens per prefill forward (a one-token tail joins the chunk before it); "
       "null: the whole prompt in one forward, and always when serving"),
    _f("seed", "workload", "weights, router skew and random prompts"),
    _f("prompts", "workload", "random | heldout | file"),
    _f("capacity", "workload", "capacity only: mean C applied per MoE call during decode, from the device "
       "counters: Megatron's formula on the real tokens, whatever the bucket", _S),
    _f("capacity_buffer", "workload", "capacity only: slots per expert the decode buffers hold (C of the bucket)"),
    # serving (workload=poisson | trace; null for a fixed batch)
    _f("workload_rate", "serving", "poisson: mean arrivals per second (workload.rate)", _A, _X,
       config=("workload.rate",)),
    _f("workload_file", "serving", "trace: the file's name, without its directory"),
    _f("max_batch", "serving", "requests decoded at once at most (workload.max_batch); admission first come, first "
       "served", _S, _A, _X, config=("workload.max_batch",)),
    _f("n_requests", "serving", "requests served"),
    _f("serving_s", "serving", "seconds from the start of serving to the last request's last token"),
    _f("output_tokens", "serving", "tokens generated, every request (its first by its prefill)"),
    _f("output_tokens_per_s", "serving", "output_tokens / serving_s", _S, _A),
    *_pct("ttft_ms", "serving", "time to first token, per request: arrival to the end of its prefill "
          "(queueing + prefill)", summary=50),
    *_pct("tpot_ms", "serving", "time per output token, per request: (its last token - its first) / "
          "(output_len - 1)", summary=90, analysis=90),
    *_pct("e2e_ms", "serving", "end to end, per request: arrival to its last token", summary=90, analysis=90),
    _f("requests", "serving", "per request: id, arrival_s, prompt_len, output_len, queue_ms, prefill_ms, ttft_ms, "
       "tpot_ms, e2e_ms"),
    _f("decode_steps", "serving", "decode steps run"),
    _f("step_batch", "serving", "live requests in every decode step (step_ms holds each step's time)"),
    _f("batch_size_hist", "serving", "decode steps per live batch size {requests: steps}"),
    _f("bucket_hist", "serving", "decode steps per rows run {rows: steps} (the bucket with graphs, else the "
       "batch)"),
    _f("padding_waste", "serving", "pad rows / rows run, over the decode steps", _S),
    _f("drop_rate_by_batch", "serving", "dispatchers that drop: dropped / routed assignments per live batch size "
       "{requests: rate}, decode steps only"),
    _f("gpu_idle_share", "serving", "device time between consecutive decode steps that no prefill covers (gaps "
       "asleep for an arrival excluded) / decode step time: the host's scheduling cost (perf_counter gaps on CPU)",
       _S, _A),
    # anchor: transformers' continuous batching on the same requests in the same process (workload.anchor=true)
    _f("anchor_output_tokens_per_s", "anchor", "transformers generate_batch's engine (init_continuous_batching), "
       "same requests, arrivals and max_batch, greedy: output tokens / its serving time", _S, _A),
    _f("anchor_serving_s", "anchor", "its seconds from the start of serving to the last token"),
    *_pct("anchor_ttft_ms", "anchor", "its time to first token (per-token host timestamps)"),
    *_pct("anchor_tpot_ms", "anchor", "its time per output token", summary=90, analysis=90),
    *_pct("anchor_e2e_ms", "anchor", "its end to end latency"),
    _f("anchor_token_agreement", "anchor", "its greedy tokens equal to moecg's served tokens, over all tokens"),
    _f("anchor_cuda_graphs", "anchor", "whether its CUDA graphs were on (varlen, decode)"),
    _f("anchor_attn_implementation", "anchor", "the attention it ran (it may switch to flash or paged)"),
    # capture
    _f("captured", "capture", "whether CUDA (or emulated) graphs were captured", _S),
    _f("capture_backend", "capture", "cuda | emulate | none"),
    _f("compiled", "capture", "capture.compile took effect"),
    _f("capture_s", "capture", "seconds to capture every bucket", _S),
    _f("graph_mem_mib", "capture", "graph memory pool growth over all buckets", _S),
    _f("graphs", "capture", "graphs captured"),
    _f("warmup", "capture", "eager runs before each capture: capture.warmup, or with auto 0 after the fused step's "
       "dry pass (kernels=fused on Triton, capture.precompile on; 1 where it ran earlier in the process), else 3; "
       "null without graphs (capture_s differs)"),
    _f("capture_buckets", "capture", "per bucket: {capture_s, graph_mem_mib, replays, graphs}"),
    _f("pdl", "capture", "capture.pdl: programmatic dependent launch of the Triton kernels, as configured (auto: mode 2 "
       "on sm90+ where Triton has it, else 0 | 0 | 1 | 2); results equal, launch latency differs"),
    _f("preload", "capture", "capture.preload as configured: kernels=fused on Triton loads its kernels' constant "
       "weights before their PDL wait (the same bits; launch overlap differs)"),
    _f("overlap_shared", "capture", "capture.overlap_shared as configured: kernels=fused on CUDA runs a shared expert "
       "on a second stream beside the routed experts"),
    _f("fuse_router", "capture", "capture.fuse_router as configured: kernels=fused runs a router that is its own "
       "linear (with or without a bias) with the residual add and norm as one kernel"),
    _f("precompile", "capture", "capture.precompile as configured: kernels=fused on Triton compiles its kernels on a "
       "thread pool before the first warmup (capture_s differs)"),
    # latency
    _f("ms_per_token_p50", "latency", "median decode-step time (CUDA events on a GPU, after a warm generate; the "
       "first measure.skip_steps steps of each repeat dropped; serving: every step, whatever its batch)", _S, _A),
    _f("ms_per_token_p90", "latency", "90th percentile of the same steps", _S),
    _f("latency_spread", "latency", "p90 / p50 of the steps (the larger of the run's and its eager baseline's); "
       "serving: of the steps that ran the same rows, the largest over rows values with >= 5 steps (null if none)"),
    _f("latency_noisy", "latency", "latency_spread above 1.5: the machine was busy or the clock is coarse; "
       "re-run before quoting the latency", _S),
    _f("tokens_per_s", "latency", "batch_size x ep / p50 (every rank's rows; serving: see output_tokens_per_s)", _S),
    _f("step_ms", "latency", "every step of the first timed repeat (ep > 1: the slowest rank's, which every step "
       "statistic uses; serving: of the run)"),
    _f("prefill_ms", "latency", "the first timed repeat's prefill, wall clock (serving: per request in requests)"),
    _f("eager_ms_per_token_p50", "latency", "strategy=eager with the same dispatch, same run (workload=fixed)", _S),
    _f("speedup_vs_eager", "latency", "eager p50 / p50; null where the run executed the baseline's own path "
       "(no graphs and HF's modules: nothing to compare)", _S, _A),
    # memory
    _f("peak_mem_mib", "memory", "peak memory of the run: CUDA allocator peak on a GPU, the process's peak "
       "resident set on CPU (see peak_mem_kind); the largest rank's with ep > 1"),
    _f("peak_mem_kind", "memory", "cuda_allocated | process_rss"),
    _f("memory_estimate_mib", "memory", "the run plan's estimate (weights + KV caches + transients), checked "
       "against free memory before the model is built"),
    _f("build_s", "memory", "seconds to build (or load) the model"),
    # floor
    _f("floor_ms", "floor", "HBM floor: bytes one step must read (non-expert weights + experts one counted step "
       "hits, all E for a dispatcher that reads every expert, + live KV) / bandwidth; null where the bandwidth "
       "is unknown, and when serving. ep > 1: the slowest rank's (its own experts that any rank hits), + "
       "exchange_floor_ms", _S),
    _f("floor_ratio", "floor", "ms_per_token_p50 / floor_ms", _S),
    _f("kv_bytes_per_token", "floor", "KV cache bytes one token adds, all layers: each layer's cached elements "
       "(FamilyAdapter.kv_shapes; MLA its latent, kv_lora_rank + qk_rope_head_dim; standard attention K and V, "
       "2 x kv heads x head_dim) x layers x the dtype's bytes; the floor reads it per live context token (a sliding "
       "layer only inside its window)"),
    _f("hbm_bandwidth_gbps", "floor", "the bandwidth used: measured per device (moecg.floor), or "
       "measure.hbm_bandwidth_gbps; null where unknown (CPUs)"),
    _f("bandwidth_source", "floor", "device table | config | unknown"),
    _f("exchange_floor_ms", "floor", "ep > 1: the all-to-all bytes one step sends from a rank (its static buffers, "
       "there and back) / nvlink_bandwidth_gbps; null with ep 1 or an unknown bandwidth", _S),
    _f("nvlink_bandwidth_gbps", "floor", "ep > 1: NVLink GB/s per direction for exchange_floor_ms: moecg.floor's "
       "device table (a datasheet figure) or measure.nvlink_bandwidth_gbps"),
    # drops (decode steps; the prefill is not counted)
    _f("drop_rate", "drops", "dropped / routed assignments over decode steps", _S, _A),
    _f("dropped_prob_mass", "drops", "routing weight dropped / routed", _S),
    _f("tokens_lost_all_rate", "drops", "tokens that lost all K experts / tokens"),
    _f("per_layer_drop_rate", "drops", "per MoE layer"),
    _f("per_expert_drop_rate", "drops", "per expert, all layers"),
    _f("routed_assignments", "drops", "token-expert assignments of real rows (every rank's, each counted at its "
       "source)"),
    _f("dropped_assignments", "drops", "of those, dropped"),
    # load
    _f("expert_load_imbalance", "load", "max/mean expert load, mean over layers (1 = balanced, E/K = one hot "
       "expert set)", _S),
    _f("per_layer_load_imbalance", "load", "per MoE layer"),
    # fidelity
    _f("token_agreement_vs_eager", "fidelity", "greedy tokens equal to dropless eager on the same prompts (serving: "
       "the first measure.fidelity_rows requests, each decoded alone)", _S, _A),
    _f("token_agreement_forced_vs_eager", "fidelity", "teacher-forced: every step fed eager's token (workload=fixed)",
       _S),
    _f("max_logit_diff_vs_eager", "fidelity", "over steps before a row's first divergence, first "
       "measure.fidelity_rows rows", _S),
    # quality
    _f("heldout_bpb", "quality", "byte-level models: teacher-forced bits per byte of the shipped held-out text "
       "under this dispatch", _S),
    _f("heldout_bpb_delta_vs_dropless", "quality", "heldout_bpb minus dropless's", _S, _A),
    # environment
    _f("device_name", "env", "GPU name or CPU"),
    _f("torch_version", "env", ""),
    _f("transformers_version", "env", ""),
    _f("moecg_version", "env", ""),
    _f("git_sha", "env", "commit (MOECG_GIT_SHA where the tree has no .git)"),
    _f("timestamp", "env", "UTC"),
    _f("status", "env", "ok | failed", _A),
    _f("config", "env", "the resolved Hydra config"),
)

# Written only by failed jobs, beside status, config and the axes they could read.
FAILED_FIELDS: tuple[Field, ...] = (
    Field("error", "failure", "one line: what failed and the fix"),
    Field("phase", "failure", "the phase it failed in (plan, parallel, build, reference, baseline, capture, timed, "
          "fidelity, floor, quality; serving: anchor, warm, serve)"),
    Field("traceback", "failure", "the full traceback"),
)

NAMES = tuple(f.name for f in FIELDS)
BY_NAME = {f.name: f for f in FIELDS + FAILED_FIELDS}
SUMMARY = tuple(f.name for f in FIELDS if f.summary)
SERVING = tuple(f.name for f in FIELDS if f.group in ("serving", "anchor"))  # null for workload=fixed
ANALYSIS = tuple(f.name for f in FIELDS if f.analysis)
AXES = tuple(f.name for f in FIELDS if f.axis)


class SchemaError(KeyError):
    pass


def ok_record(values: dict) -> dict:
    """A results dict in schema order; every field present (null where it does not apply), nothing else."""
    missing = [n for n in NAMES if n not in values]
    extra = [k for k in values if k not in BY_NAME]
    if missing or extra:
        raise SchemaError(f"results do not match moecg.schema: missing {missing}, unknown {extra}")
    return {n: values[n] for n in NAMES}


def axes_from_config(config: Mapping) -> dict:
    """Every sweep axis read from a (resolved, plain) config: what a failed job's record carries."""
    def get(key):
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        return node

    return {f.name: next((v for v in map(get, f.config) if v is not None), None) for f in FIELDS if f.axis}


def failed_record(error: str, phase: str, traceback: str, config: dict, axes: dict) -> dict:
    rec = {k: v for k, v in axes.items() if k in NAMES}
    rec.update(status="failed", error=error, phase=phase, traceback=traceback, config=config)
    return rec


def markdown_table() -> str:
    """The README's results-schema table."""
    lines = ["| field | group | meaning |", "|---|---|---|"]
    for f in FIELDS + FAILED_FIELDS:
        doc = f.doc.replace("|", "\\|")  # a bare | would end the table cell
        lines.append(f"| `{f.name}` | {f.group} | {doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
