"""Train small byte-level MoE models on the Python stdlib's source, save them as moecg checkpoints.

Dims: B batch rows, S sequence length, V vocab (256 bytes), E experts, L layers.
Random-weight MoE models route almost uniformly and barely react to dropped tokens; these trained ones have
routers that specialise, so capacity drops cost measurable bits per byte. One plain PyTorch loop: AdamW,
linear warmup then cosine decay, bf16 autocast on CUDA, HF's router load-balancing loss added to the
cross entropy. The schedule runs on progress = max(step / --steps, elapsed / --minutes), so a time budget
still anneals the learning rate to zero and stops on time.

DeepSeek-V3-style routers (a `e_score_correction_bias` buffer: deepseek_v3_stdlib) balance without an aux loss
instead (DeepSeek-V3, arXiv 2412.19437, sec. 2.1.2): after every optimizer step each MoE layer's bias moves by
b_e += gamma * sign(mean load - load_e), the loads counted from the router's real top-k choices on the step's
batch (`BiasBalancer`, gamma = --bias-update-speed). The bias only picks experts; the combine weights stay the
unbiased scores. The sequence-wise balance loss is there (--seq-aux-alpha) but off by default.

    PYTHONPATH=. python experiments/train_stdlib.py --device cuda --minutes 1.5       # every model, one H200
    PYTHONPATH=. python experiments/train_stdlib.py --model deepseek_v3_stdlib --device cuda --minutes 1.5 \
        --out /tmp/stdlib_ck                                                           # one model
    PYTHONPATH=. python experiments/train_stdlib.py --model mixtral_stdlib --device cpu --steps 30 \
        --batch-size 8 --seq-len 64 --eval-max-bytes 4096 --out /tmp/ck                # a smoke run

Writes <out>/<name>/{config.json, model.safetensors (bf16), card.json, MODEL_CARD.md}.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import moecg
from moecg.data import heldout_bytes, split_sizes, train_bytes
from moecg.models import build_model
from moecg.models.adapter import ADAPTERS
from moecg.models.zoo import FAMILIES, PRESETS, family_of_config, make_config
from moecg.quality import heldout_bpb, heldout_expert_load
from moecg.report import write_json

# Shapes for ~4-5M parameters (8-10 MB in bf16) live in moecg/models/zoo.py PRESETS (*_stdlib), the same
# presets `model=mixtral_stdlib` loads the shipped weights into.
STDLIB_PRESETS = {name: PRESETS[name] for name in ("mixtral_stdlib", "qwen2_moe_stdlib", "deepseek_v3_stdlib")}
# What card.json records as `heldout_prefix`, and what tests/test_stdlib.py re-evaluates: CPU, fp32.
PREFIX = dict(max_bytes=16384, seq_len=256, batch_size=16)
EVAL_CAPACITY_FACTOR = 0.5


def stdlib_config(name: str, **overrides):
    if name not in STDLIB_PRESETS:
        raise ValueError(f"--model {name!r}: choose one of {sorted(STDLIB_PRESETS)} or all")
    return make_config(name, overrides=overrides)


class DummyWandb:
    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


def lr_at(progress: float, lr: float, warmup: float) -> float:
    if progress < warmup:
        return lr * progress / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def model_class(config):
    return FAMILIES[family_of_config(config)][1]


# -- DeepSeek-V3 auxiliary-loss-free load balancing ------------------------------------------------------------
def bias_update(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """One DeepSeek-V3 bias step: b_e + gamma * sign(mean_e' load_e' - load_e), over the last dim.

    bias [..., E]; load [..., E]: assignments routed to each expert in the step's batch. An overloaded expert's
    bias falls by gamma, an underloaded one's rises by gamma, one exactly at the mean keeps its bias.
    """
    load = load.to(bias.dtype)
    return bias + gamma * torch.sign(load.mean(-1, keepdim=True) - load)


def seq_balance_loss(logits: torch.Tensor, idx: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss of one layer, before its alpha (eqs. 17-20).

    logits [B*S, E] router logits, idx [B*S, K] chosen experts. Per sequence: sum_e f_e * P_e with
    f_e = E / (K*S) * (tokens choosing e) and P_e = mean over tokens of s_e / sum_e' s_e' (s = sigmoid(logits));
    mean over the B sequences. 1 when balanced, E/K when every token picks the same K experts.
    """
    T, E = logits.shape
    K, S = idx.shape[-1], T // batch
    s = logits.float().sigmoid()
    p = (s / s.sum(-1, keepdim=True)).view(batch, S, E).mean(1)  # [B, E]
    f = torch.zeros(batch, E, device=logits.device).scatter_add_(
        1, idx.reshape(batch, S * K), torch.ones(batch, S * K, device=logits.device)) * (E / (K * S))  # [B, E]
    return (f * p).sum(-1).mean()


def score_correction_routers(model) -> list:
    """Routers with a routing-only bias buffer (DeepSeek-V3's `e_score_correction_bias`), in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)
            and "e_score_correction_bias" in m._buffers]


class BiasBalancer:
    """Aux-loss-free balancing of the routers that have `e_score_correction_bias` (HF keeps it a buffer: no grad).

    A forward hook on each router adds its top-k choices (out[2], [T, K], the real choices: group-limited, biased)
    to a per-layer load [L, E] while the router is in training mode; `update()`, after each optimizer step, applies
    `bias_update` to every layer and clears the loads. No host sync: everything stays on the device.
    While attached the routers run with autocast off: HF's router casts to fp32 itself (and DeepSeek-V3 gates in
    fp32), which autocast would otherwise override, so training routes as the fp32 router of the saved model does.
    """

    def __init__(self, routers: list, gamma: float, seq_aux_alpha: float = 0.0):
        if not routers:
            raise ValueError("BiasBalancer: no router with an e_score_correction_bias buffer")
        bias = routers[0].e_score_correction_bias
        self.routers, self.gamma, self.seq_aux_alpha = routers, gamma, seq_aux_alpha
        self.load = torch.zeros(len(routers), bias.numel(), device=bias.device)  # [L, E] this step's assignments
        self.last_load = torch.zeros_like(self.load)  # [L, E] the previous step's, for logging
        self._seq: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(partial(self._hook, i)) for i, r in enumerate(routers)]
        for r in routers:
            r.forward = _autocast_off(r.forward, bias.device.type)  # an instance attribute; remove() deletes it

    def _hook(self, i, router, args, out):
        if not router.training:
            return  # held-out evaluation during training does not move the bias
        logits, _, idx = out  # [T, E], [T, K] combine weights, [T, K] expert ids
        self.load[i].index_add_(0, idx.flatten(), torch.ones(idx.numel(), device=idx.device))
        if self.seq_aux_alpha:
            self._seq.append(seq_balance_loss(logits, idx, batch=args[0].shape[0] if args[0].dim() == 3 else 1))

    def take_loss(self) -> torch.Tensor | float:
        """seq_aux_alpha * (sum over layers of the sequence-wise loss) of the forwards since the last call, or 0."""
        seq, self._seq = self._seq, []
        return self.seq_aux_alpha * torch.stack(seq).sum() if seq else 0.0

    @torch.no_grad()
    def update(self) -> None:
        for r, load in zip(self.routers, self.load):
            r.e_score_correction_bias.copy_(bias_update(r.e_score_correction_bias, load, self.gamma))
        self.load, self.last_load = self.last_load, self.load
        self.load.zero_()

    def reset(self) -> None:
        self.load.zero_()
        self._seq = []

    def stats(self) -> dict:
        """Host numbers for a log line (syncs): the last step's load imbalance (max/mean, mean over layers), |bias|."""
        imb = self.last_load.max(-1).values / self.last_load.mean(-1).clamp_min(1e-9)
        bias = torch.stack([r.e_score_correction_bias for r in self.routers])
        return {"load_imbalance_train": imb.mean().item(), "bias_absmax": bias.abs().max().item()}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for r in self.routers:
            r.__dict__.pop("forward", None)


def _autocast_off(forward, device_type: str):
    def fp32_forward(*args, **kwargs):
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)
    return fp32_forward


def train(config, data: torch.Tensor, *, steps: int, batch_size: int, seq_len: int, lr: float = 2e-3,
          warmup: float = 0.05, weight_decay: float = 0.1, minutes: float | None = None, device="cpu",
          seed: int = 0, log_every: int = 100, logger=None, eval_data: torch.Tensor | None = None,
          bias_update_speed: float = 1e-3, seq_aux_alpha: float = 0.0):
    """Train a fresh model of `config` on random windows of `data` ([N] uint8).

    Routers with `e_score_correction_bias` (DeepSeek-V3 style) are balanced by `BiasBalancer` (gamma =
    bias_update_speed, sequence-wise loss weight seq_aux_alpha); the others by HF's aux loss (router_aux_loss_coef).
    Returns (model in eval mode, history, steps run, wall seconds of the loop).
    """
    device = torch.device(device)
    logger = logger or DummyWandb()
    torch.manual_seed(seed)
    config.output_router_logits = True  # HF then returns the load-balancing loss as out.aux_loss
    with device:
        model = model_class(config)(config).float()  # fp32 master weights; autocast does the bf16 math
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0}],
                            lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    data = data.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0  # DeepSeek-V3 modeling has no aux loss: 0
    routers = score_correction_routers(model)
    balancer = BiasBalancer(routers, bias_update_speed, seq_aux_alpha) if routers else None

    def batch():
        starts = torch.randint(data.numel() - seq_len - 1, (batch_size, 1), device=device, generator=gen)
        return data[starts + torch.arange(seq_len + 1, device=device)].long()  # [B, S+1]

    def loss_of(w):
        with autocast:
            out = model(input_ids=w[:, :-1], use_cache=False)  # logits [B, S, V]
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), w[:, 1:].flatten())
        aux = out.aux_loss.float() if out.aux_loss is not None else torch.zeros((), device=device)
        # DeepSeek-V3's sequence-wise loss, already weighted by its alpha (0 unless --seq-aux-alpha)
        bal = balancer.take_loss() if balancer is not None else 0.0
        return ce, aux, bal

    if device.type == "cuda":
        # HF's default experts path is grouped_mm; should this torch build reject it in training (fp32 weights
        # under autocast), fall back to HF's eager loop rather than lose the run.
        try:
            ce, aux, bal = loss_of(batch())
            (ce + coef * aux + bal).backward()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"experts_implementation={model.config._experts_implementation} failed in training ({e!r}); "
                  "using eager", flush=True)
            model.set_experts_implementation("eager")
        model.zero_grad(set_to_none=True)
        if balancer is not None:
            balancer.reset()  # the probe's loads are not a training step's

    history, t0, step = [], time.perf_counter(), 0
    budget_s = minutes * 60 if minutes else None
    while True:
        progress = max(step / steps, (time.perf_counter() - t0) / budget_s if budget_s else 0.0)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, lr, warmup)
        ce, aux, bal = loss_of(batch())
        opt.zero_grad(set_to_none=True)
        (ce + coef * aux + bal).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if balancer is not None:
            balancer.update()
        step += 1
        if step % log_every == 0 or step == 1:
            rec = {"step": step, "s": round(time.perf_counter() - t0, 1), "lr": opt.param_groups[0]["lr"],
                   "bpb_train": ce.item() / math.log(2), "aux_loss": aux.item()}
            if balancer is not None:
                rec.update(balancer.stats(), seq_aux_loss=float(bal.detach() if torch.is_tensor(bal) else bal))
            if eval_data is not None:
                model.eval()
                with autocast:
                    rec["bpb_heldout_32k"] = heldout_bpb(model, eval_data, max_bytes=32768)
                model.train()
            history.append(rec)
            logger.log(rec, step=step)
            print(json.dumps(rec), flush=True)
    wall = time.perf_counter() - t0
    if balancer is not None:
        balancer.remove()
    model.eval()
    config.output_router_logits = False  # inference (and graph capture) should not record router logits
    return model, history, step, wall


def save_bf16(model, model_dir: Path) -> None:
    """save_pretrained in bfloat16, except what the family keeps in fp32 even when loaded in bf16
    (`_keep_in_fp32_modules_strict`: DeepSeek-V3's router weight and e_score_correction_bias)."""
    keep = sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    pattern = re.compile("|".join(rf"(^|\.){re.escape(k)}($|\.)" for k in keep)) if keep else None
    saved = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]
             if pattern and pattern.search(n)}
    model.to(torch.bfloat16)
    for n, t in saved.items():  # put the fp32 values back (`.to` replaces buffer tensors: look them up again)
        owner, _, attr = n.rpartition(".")
        mod = model.get_submodule(owner)
        if attr in mod._parameters:
            mod._parameters[attr].data = t
        else:
            mod._buffers[attr] = t
    model.save_pretrained(model_dir)
    (model_dir / "generation_config.json").unlink(missing_ok=True)  # not needed to load; 4 files a model


def load(model_dir: Path, device: str):
    """The checkpoint in fp32 through `build_model`, as users load it."""
    return build_model(pretrained_path=str(model_dir), device=device, dtype="fp32").model


def evaluate(model_dir: Path, device: str, max_bytes: int | None, seed: int) -> dict:
    """Numbers for the card. Trained: the saved bf16 weights, evaluated in fp32. Random: same shape, seeded."""
    from moecg.dispatch import attach, detach, make_dispatcher

    out = {"eval_bytes": max_bytes}
    trained = load(model_dir, device)
    out["heldout"] = heldout_expert_load(trained, max_bytes=max_bytes)  # counted through `dynamic`
    torch.manual_seed(seed)
    config = trained.config
    with torch.device(device):
        rand = model_class(config)(config).float().eval()
    out["random_init"] = {"seed": seed, "heldout": heldout_expert_load(rand, max_bytes=max_bytes)}
    routers = score_correction_routers(trained)
    if routers:  # what the learned bias buys: the same trained weights routed with the bias zeroed
        out["e_score_correction_bias"] = [r.e_score_correction_bias.tolist() for r in routers]
        for r in routers:
            r.e_score_correction_bias.zero_()
        out["bias_zeroed"] = {"heldout": heldout_expert_load(trained, max_bytes=max_bytes)}
    # The test's check: CPU, fp32, a prefix, through build_model exactly as a user loads it.
    cpu = load(model_dir, "cpu")
    prefix = dict(PREFIX, device="cpu", dtype="fp32", bpb=heldout_bpb(cpu, **PREFIX))
    attach(cpu, make_dispatcher("capacity", capacity_factor=EVAL_CAPACITY_FACTOR))
    prefix[f"bpb_capacity_{EVAL_CAPACITY_FACTOR}"] = heldout_bpb(cpu, **PREFIX)
    detach(cpu)
    out["heldout_prefix"] = prefix
    return out


def write_card(model_dir: Path, card: dict) -> None:
    write_json(model_dir / "card.json", card, indent=1)
    h, r, p = card["heldout"], card["random_init"]["heldout"], card["heldout_prefix"]
    cap = f"bpb_capacity_{EVAL_CAPACITY_FACTOR}"
    d = card["data"]
    lb = card.get("load_balancing")
    evaluated = "all of" if card["eval_bytes"] is None else f"the first {card['eval_bytes']} bytes of"
    lines = [
        f"# {card['name']}",
        "",
        f"A {card['family']} MoE ({card['params'] / 1e6:.2f}M parameters, {card['config']['num_hidden_layers']} "
        f"layers, hidden {card['config']['hidden_size']}, {card['num_experts']} experts, top-{card['top_k']}) "
        "trained by moecg on bytes of the Python standard library's source (vocab 256, one token per byte). "
        "Weights saved in bfloat16. Written by `experiments/train_stdlib.py`; `card.json` has the same numbers.",
        "",
        "## Training",
        f"- command: `{card['command']}`",
        f"- data: local CPython {d['python']} stdlib, train split {d['train_bytes']:,} bytes ({d['train_files']} "
        f"files); held-out split {d['heldout_local_bytes']:,} bytes, evaluated on the shipped "
        f"`moecg/data/heldout.txt` ({d['heldout_shipped_bytes']:,} bytes, {d['heldout_shipped_files']} files)",
        f"- {card['steps']} steps x {card['batch_size']} x {card['seq_len']} bytes = {card['tokens_seen']:,} "
        f"tokens, AdamW lr {card['lr']} cosine, router aux loss coef {card['router_aux_loss_coef']}",
        f"- device: {card['device']}, torch {card['torch']}, training loop {card['train_wall_s']:.0f} s"
        + (f", whole run with evaluation {card['total_wall_s']:.0f} s" if "total_wall_s" in card else ""),
        "",
        *(_balancing_lines(card) if lb else []),
        f"## Held-out quality ({evaluated} the shipped held-out text, fp32, windows of 256)",
        "| model | bits per byte | expert-load imbalance (max/mean load, mean over layers) |",
        "|---|---|---|",
        f"| trained | {h['bpb']:.4f} | {h['expert_load_imbalance']:.3f} |",
        *([f"| trained, e_score_correction_bias zeroed | {card['bias_zeroed']['heldout']['bpb']:.4f} | "
           f"{card['bias_zeroed']['heldout']['expert_load_imbalance']:.3f} |"] if "bias_zeroed" in card else []),
        f"| random init, same shape | {r['bpb']:.4f} | {r['expert_load_imbalance']:.3f} |",
        "",
        f"First {p['max_bytes']} bytes on CPU, batch {p['batch_size']} (what tests/test_stdlib.py checks): "
        f"{p['bpb']:.4f} bpb with HF's experts, {p[cap]:.4f} with `capacity` at capacity_factor "
        f"{EVAL_CAPACITY_FACTOR}.",
        "",
    ]
    (model_dir / "MODEL_CARD.md").write_text("\n".join(lines))


def _balancing_lines(card: dict) -> list[str]:
    lb, c = card["load_balancing"], card["config"]
    seq = (f"DeepSeek-V3's sequence-wise balance loss at alpha {lb['seq_aux_alpha']}" if lb["seq_aux_alpha"]
           else "DeepSeek-V3's sequence-wise balance loss off (alpha 0; `--seq-aux-alpha` turns it on)")
    return [
        "## Routing and load balancing",
        f"- router: sigmoid scores, group-limited top-{card['top_k']} of {card['num_experts']} routed experts "
        f"(n_group {c['n_group']}, topk_group {c['topk_group']}), {c['n_shared_experts']} shared expert, top-k "
        f"weights renormalised (norm_topk_prob {c['norm_topk_prob']}) and scaled by routed_scaling_factor "
        f"{c['routed_scaling_factor']}; the first {c['first_k_dense_replace']} layer(s) dense",
        f"- auxiliary-loss-free balancing (DeepSeek-V3): after every optimizer step each MoE layer's "
        f"`e_score_correction_bias` moves by b_e += {lb['bias_update_speed']} * sign(mean load - load_e), loads = "
        "assignments the router chose (group-limited, biased top-k) on that step's batch; the bias only picks "
        "experts, the combine weights are the unbiased scores",
        f"- no auxiliary loss (router_aux_loss_coef {card['router_aux_loss_coef']}); {seq}",
        "- the router ran in fp32 during training (autocast off for it), as HF's router and DeepSeek-V3 compute it; "
        "its weight and the bias are saved in fp32, everything else in bfloat16",
        "",
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all", help=f"one of {sorted(STDLIB_PRESETS)} or all")
    ap.add_argument("--steps", type=int, default=20000, help="step budget (the schedule ends at steps or minutes)")
    ap.add_argument("--minutes", type=float, default=None, help="training-loop time budget per model")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--eval-max-bytes", type=int, default=None, help="card numbers on a prefix (default: all)")
    ap.add_argument("--out", default=str(Path(moecg.__file__).resolve().parent / "checkpoints"))
    ap.add_argument("--wandb", action="store_true", help="log to wandb in offline mode (./wandb)")
    ap.add_argument("--bias-update-speed", type=float, default=1e-3,
                    help="DeepSeek-V3-style routers: gamma of the aux-loss-free bias update (per optimizer step)")
    ap.add_argument("--seq-aux-alpha", type=float, default=0.0,
                    help="DeepSeek-V3-style routers: weight of the sequence-wise balance loss (default 0: off)")
    args = ap.parse_args(argv)

    names = sorted(STDLIB_PRESETS) if args.model == "all" else [args.model]
    for name in names:
        stdlib_config(name)  # bad --model fails before any data or CUDA work
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    sizes = split_sizes()
    data = torch.frombuffer(bytearray(train_bytes()), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(heldout_bytes()), dtype=torch.uint8)
    print(json.dumps(sizes), flush=True)
    for name in names:
        logger = DummyWandb()
        if args.wandb:
            import wandb
            logger = wandb.init(project="moecg", name=name, tags=[name, "train_stdlib"], mode="offline",
                                config=vars(args))
        config = stdlib_config(name)
        t_model = time.perf_counter()
        model, history, steps, wall = train(config, data, steps=args.steps, batch_size=args.batch_size,
                                            seq_len=args.seq_len, lr=args.lr, minutes=args.minutes, device=device,
                                            seed=args.seed, log_every=args.log_every, logger=logger, eval_data=held,
                                            bias_update_speed=args.bias_update_speed,
                                            seq_aux_alpha=args.seq_aux_alpha)
        model_dir = Path(args.out) / name
        model_dir.mkdir(parents=True, exist_ok=True)
        balanced = bool(score_correction_routers(model))
        save_bf16(model, model_dir)
        card = {
            "name": name, "family": family_of_config(config), "config": STDLIB_PRESETS[name],
            "params": sum(p.numel() for p in model.parameters()),
            "num_experts": ADAPTERS[family_of_config(config)].num_experts(config), "top_k": config.num_experts_per_tok,
            "data": sizes, "steps": steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "tokens_seen": steps * args.batch_size * args.seq_len, "lr": args.lr,
            "router_aux_loss_coef": getattr(config, "router_aux_loss_coef", 0.0), "device": _device_name(device),
            "torch": torch.__version__, "train_wall_s": round(wall, 1), "command": command, "weights_dtype": "bfloat16",
        }
        if balanced:
            card["router_aux_loss_coef"] = 0.0  # HF's DeepSeek-V3 modeling computes no aux loss whatever the config
            card["weights_dtype"] = "bfloat16 (router weight and e_score_correction_bias float32)"
            card["load_balancing"] = {"method": "aux-loss-free bias update (DeepSeek-V3)",
                                      "bias_update_speed": args.bias_update_speed, "seq_aux_alpha": args.seq_aux_alpha,
                                      "router_dtype_in_training": "float32"}
        del model
        card.update(evaluate(model_dir, device, args.eval_max_bytes, args.seed))
        card["total_wall_s"] = round(time.perf_counter() - t_model, 1)
        card["history"] = history
        write_card(model_dir, card)
        h, r = card["heldout"], card["random_init"]["heldout"]
        print(f"saved {model_dir}: held-out bpb {h['bpb']:.4f}, imbalance {h['expert_load_imbalance']:.3f} "
              f"(random init: {r['bpb']:.3f} bpb, {r['expert_load_imbalance']:.3f}); {card['total_wall_s']:.0f} s",
              flush=True)
        logger.finish()


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


if __name__ == "__main__":
    main()
