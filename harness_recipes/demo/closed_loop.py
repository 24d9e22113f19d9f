"""Closed loop on the CPU: polar-serve -> mitmdump + addon -> a small agent -> polar-recon watch ->
PolarGRPOTrainer -> /polar/reload, for several iterations; the mean reward must rise. The schedule,
the task, sampling, multi-turn episodes, the held-out evaluation and the ablation arms are described
in the training guide, section "The closed loop", under "How it runs".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness_recipes.cache import tiny_model
from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.node.processes import running, venv_bin
from polar_contracts.control import EPISODE_HEADER, SERVE_VERSION_PATH, capability, control_headers, end_path
from polar_contracts.log.end_record import GROUP_ID
from trainer.grpo_config import PolarGRPOConfig
from trainer.grpo_trainer import PolarGRPOTrainer
from trainer.row_temperature import generation_default
from trainer.weight_sync import WeightSyncCallback


@dataclass
class LoopConfig:
    workdir: Path
    model_dir: Path | None = None
    steps: int = 8
    groups: int = 3  # groups per iteration (per training step)
    group_size: int = 4  # episodes per group = num_generations
    max_tokens: int = 4
    # None: not sent; the server applies the model's generation_config.json (recorded by the proxy)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    is_correction: bool = True  # TRL's vllm_importance_sampling_correction against the recorded logprobs
    # A sequence ratio, not polar-train's per-token default: the loop's rows are a few tokens long (where
    # a sequence mask costs nothing) and its ablations must show in the ratio: an off-by-one row
    # (shifted_mask) on the tiny model differs by ~0.04 nats a token, which a per-token truncation keeps
    # and a sequence product rejects (docs/training.md, Limitations).
    is_mode: str = "sequence_mask"
    learning_rate: float = 2e-3  # Adam's first steps move every weight by ~lr: 2e-2 at T=0.6 can lose the target (seed 1)
    calibration_samples: int = 32
    target_fraction: float = 0.35  # of whole episodes (every turn must contain the target)
    seed: int = 0  # sampling seeds (per episode) and the trainer's seed: the whole loop is reproducible
    prompt: str = "Name one thing."
    dialect: str = "vllm"
    max_policy_lag: int | None = None  # needs weight versions in the logs (docs/training.md)
    timeout: float = 120.0
    arm: str = "real"  # see ARMS
    turns: int = 2  # assistant turns per episode; the reward needs the target in every one
    init_seed: int | None = None  # serve/train cache.tiny_model(init_seed) (None: model_dir)
    train_prompts: tuple[str, ...] = ("Name one thing.", "Say a word.", "Pick something.")
    eval_prompts: tuple[str, ...] = ("Give me one example.", "Tell me an item.")
    followup: str = "Say it again."
    eval_samples: int = 16  # held-out episodes before and after training (0: no evaluation)
    target: str | None = None  # given: no calibration (every arm of a seed gets the same target)
    eval_before: bool = True  # the held-out evaluation at weight_version 0 (the same for every arm of a seed)


@dataclass
class LoopResult:
    target: str
    calibration_fraction: float
    rewards: list[float] = field(default_factory=list)  # mean reward per iteration
    versions: list[str] = field(default_factory=list)  # weight version each iteration sampled from
    syncs: list[dict] = field(default_factory=list)
    shards: int = 0
    seconds: float = 0.0
    is_stats: list[dict] = field(default_factory=list)  # per step: the IS ratio's logged statistics
    arm: str = "real"
    init_seed: int | None = None
    heldout_before: float | None = None  # mean held-out reward at weight_version 0
    heldout_after: float | None = None  # ... at weight_version `steps` (after the last sync)

    def train_gain(self) -> float:
        """Mean reward of the last two iterations minus the first's."""
        return sum(self.rewards[-2:]) / len(self.rewards[-2:]) - self.rewards[0]

    def summary(self) -> str:
        return (f"arm {self.arm} init {self.init_seed}: held-out {self.heldout_before} -> {self.heldout_after}; "
                f"target {self.target!r} (calibrated {self.calibration_fraction:.2f}); mean reward per iteration "
                f"{[round(r, 2) for r in self.rewards]}; versions {self.versions}; {self.shards} shards; "
                f"{len(self.syncs)} syncs; {self.seconds:.0f}s; IS ratio mean per step "
                f"{[round(s.get('importance_sampling_ratio/mean', float('nan')), 4) for s in self.is_stats]}")


# -- processes ------------------------------------------------------------------------------------
def http(method: str, url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 120.0):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


@contextlib.contextmanager
def stack(work: Path, model_dir: Path, dialect: str = "vllm", *, group_size: int | None = None,
          timeout: float = 120.0):
    """polar-serve + mitmdump/addon (+ ``polar-recon watch`` when group_size is given); yields the server's
    URL and the proxy's Proc (``.url``, ``.secret``: its control secret). Logs go to WORK/logs, shards to
    WORK/shards, process output to WORK/*.log."""
    logdir = work / "logs"
    recon_cmd = [venv_bin("polar-recon"), "watch", str(logdir), str(work / "shards"),
                 "--group-size", str(group_size), "--poll", "0.2"]
    with contextlib.ExitStack() as es:
        srv = es.enter_context(serve(model_dir, dialect=dialect, model_name=None,
                                     extra_args=["--weight-version", "0", "--threads", "1"],
                                     log=work / "serve.log", timeout=timeout))
        proxy = es.enter_context(capture_proxy(srv.url, logdir, confdir=work / "mitmconf", log=work / "mitmdump.log",
                                               sets={"polar_generation_config": str(model_dir)}, timeout=timeout))
        if group_size is not None:
            es.enter_context(running(recon_cmd, log=work / "recon.log"))
        yield srv.url, proxy


# -- the agent --------------------------------------------------------------------------------------
def answer_text(resp: dict) -> str:
    msg = resp["choices"][0]["message"]
    return (msg.get("content") or "") + (msg.get("reasoning") or msg.get("reasoning_content") or "")


def chat_body(cfg: LoopConfig, messages: list[dict] | None = None, **extra) -> dict:
    sampling = {k: v for k, v in (("temperature", cfg.temperature), ("top_k", cfg.top_k), ("top_p", cfg.top_p))
                if v is not None}
    return {"messages": messages or [{"role": "user", "content": cfg.prompt}], "max_tokens": cfg.max_tokens,
            **sampling, **extra}


def run_episode(cfg: LoopConfig, url: str, prompt: str, seed: int, headers: dict | None = None,
                **extra) -> list[dict]:
    """cfg.turns chat calls, each with the previous answers in its context; returns the responses."""
    msgs = [{"role": "user", "content": prompt}]
    out: list[dict] = []
    for k in range(cfg.turns):
        if k:
            msgs = msgs + [{"role": "assistant", "content": answer_text(out[-1])},
                           {"role": "user", "content": cfg.followup}]
        out.append(http("POST", url + "/v1/chat/completions", chat_body(cfg, msgs, seed=seed + 7919 * k, **extra),
                         headers))
    return out


def score(answers: list[str], target: str) -> float:
    """The reward: decided by the last turn alone (1 if its answer contains the target)."""
    return float(target in answers[-1])


def calibrate(cfg: LoopConfig, serve_url: str, tokenizer) -> tuple[str, float]:
    """Pick a target word for which about target_fraction of the untrained model's episodes (training
    prompts) score 1."""
    episodes, cands = [], Counter()
    for i in range(cfg.calibration_samples):
        prompt = cfg.train_prompts[i % len(cfg.train_prompts)]
        rs = run_episode(cfg, serve_url, prompt, cfg.seed * 100003 + 50000 + i, return_token_ids=True)
        episodes.append([answer_text(r) for r in rs])
        ch = rs[-1]["choices"][0]  # candidates from the turn that decides the reward
        for t in set(ch.get("token_ids") or ch.get("response_token_ids") or []):  # vLLM | SGLang names
            s = tokenizer.decode([t]).strip()
            # short fragments match by accident; a partial UTF-8 sequence ("\ufffd") shows in the text or
            # not depending on the next token, a reward the policy cannot learn
            if len(s) >= 2 and "\ufffd" not in s:
                cands[s] += 1
    if not cands:
        raise RuntimeError("calibration: no usable token in the sampled answers")
    frac = {s: sum(score(x, s) for x in episodes) / len(episodes) for s in cands}
    target = min(frac, key=lambda s: (abs(frac[s] - cfg.target_fraction), s))
    return target, frac[target]


def evaluate(cfg: LoopConfig, serve_url: str, target: str) -> float:
    """Mean reward of eval_samples held-out episodes (eval_prompts, unseen seeds) sampled from the server."""
    rewards = []
    for i in range(cfg.eval_samples):
        rs = run_episode(cfg, serve_url, cfg.eval_prompts[i % len(cfg.eval_prompts)], cfg.seed * 100003 + 70000 + i)
        rewards.append(score([answer_text(r) for r in rs], target))
    return sum(rewards) / len(rewards)


def run_agent(cfg: LoopConfig, proxy, serve_url: str, target: str, result: LoopResult,
              errors: list) -> None:
    """The episodes: each names itself by its capability, and is ended with the control secret."""
    proxy_url = proxy.url
    try:
        for it in range(cfg.steps):
            deadline = time.monotonic() + cfg.timeout
            while (v := http("GET", serve_url + SERVE_VERSION_PATH)["weight_version"]) != str(it):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"iteration {it}: server still at weight_version {v}")
                time.sleep(0.05)
            rewards = []
            for g in range(cfg.groups):
                gid = f"it{it:03d}-g{g}"
                prompt = cfg.train_prompts[(it * cfg.groups + g) % len(cfg.train_prompts)]
                for e in range(cfg.group_size):
                    ep = f"{gid}-e{e}"
                    seed = cfg.seed * 100003 + it * 1000 + g * 100 + e  # reproducible, distinct per episode
                    rs = run_episode(cfg, proxy_url, prompt, seed, {EPISODE_HEADER: capability(proxy.secret, ep)})
                    reward = score([answer_text(r) for r in rs], target)
                    http("POST", proxy_url + end_path(ep), {"reward": reward, "metadata": {GROUP_ID: gid}},
                         control_headers(proxy.secret))
                    rewards.append(reward)
            result.rewards.append(sum(rewards) / len(rewards))
            result.versions.append(v)
    except Exception as e:  # surfaced by the main thread
        errors.append(e)


# -- ablation arms --------------------------------------------------------------
ARMS = ("real", "shuffled_rewards", "zero_mask", "scrambled_ids", "lr0", "shifted_mask")


def derangement(n: int, rng: random.Random) -> list[int]:
    """A random permutation with no fixed point (Sattolo's algorithm: one cycle through all n)."""
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)
        p[i], p[j] = p[j], p[i]
    return p


def shift_right(xs: list, fill):
    return [fill, *xs[:-1]]


def apply_arm(arm: str, cols: dict[str, list], rng: random.Random) -> dict[str, list]:
    """The arm's transformation of one batch of TRL rows (ShardRollout's columns); "real" and "lr0" keep it."""
    if arm in ("real", "lr0"):
        return cols
    cols = {k: list(v) for k, v in cols.items()}
    if arm == "shuffled_rewards":
        eps = sorted({e for e, r in zip(cols["episode_id"], cols["reward"]) if e is not None and r is not None})
        by_ep = {e: r for e, r in zip(cols["episode_id"], cols["reward"]) if e is not None}
        new = {e: by_ep[eps[k]] for e, k in zip(eps, derangement(len(eps), rng))}
        cols["reward"] = [new.get(e, r) if e is not None else r for e, r in zip(cols["episode_id"], cols["reward"])]
    elif arm == "zero_mask":
        cols["env_mask"] = [[0] * len(m) for m in cols["env_mask"]]
    elif arm == "scrambled_ids":
        pos = [(i, j) for i, m in enumerate(cols["env_mask"]) for j, x in enumerate(m) if x]
        ids = [cols["completion_ids"][i][j] for i, j in pos]
        rng.shuffle(ids)
        cols["completion_ids"] = [list(c) for c in cols["completion_ids"]]
        for (i, j), t in zip(pos, ids):
            cols["completion_ids"][i][j] = t
    elif arm == "shifted_mask":
        cols["env_mask"] = [shift_right(m, 0) for m in cols["env_mask"]]
        cols["logprobs"] = [shift_right(lp, 0.0) for lp in cols["logprobs"]]
    else:
        raise ValueError(f"unknown arm {arm!r} (one of {', '.join(ARMS)})")
    return cols


class ArmRollout:
    """The one point where an arm touches the data: wraps the trainer's rollout_func (ShardRollout) and
    transforms the rows it returns before TRL scores and trains them (row order is kept, so the
    trainer's per-row sampling transforms still line up)."""

    def __init__(self, inner, arm: str, seed: int):
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r} (one of {', '.join(ARMS)})")
        self.inner, self.arm, self.rng = inner, arm, random.Random(seed)

    def __call__(self, prompts: list, trainer=None) -> dict[str, list]:
        return apply_arm(self.arm, self.inner(prompts, trainer), self.rng)


# -- the loop ---------------------------------------------------------------------------------------
def run_closed_loop(cfg: LoopConfig) -> LoopResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    t0 = time.monotonic()
    work = Path(cfg.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "shards"
    if cfg.arm not in ARMS:
        raise ValueError(f"unknown arm {cfg.arm!r} (one of {', '.join(ARMS)})")
    if cfg.model_dir is None:
        cfg.model_dir = tiny_model()
    if cfg.init_seed is not None:
        cfg.model_dir = tiny_model(cfg.init_seed)
    tok = AutoTokenizer.from_pretrained(str(cfg.model_dir))
    # The trainer's logprob temperature is the one the server sampled at (checked on every group).
    temperature = cfg.temperature if cfg.temperature is not None else generation_default(Path(cfg.model_dir))
    with stack(work, cfg.model_dir, cfg.dialect, group_size=cfg.group_size, timeout=cfg.timeout) as (serve_url,
                                                                                                  proxy):
        target, frac = (cfg.target, float("nan")) if cfg.target else calibrate(cfg, serve_url, tok)
        result = LoopResult(target, frac, arm=cfg.arm, init_seed=cfg.init_seed)
        if cfg.eval_samples and cfg.eval_before:
            result.heldout_before = evaluate(cfg, serve_url, target)
        errors: list = []
        agent = threading.Thread(target=run_agent, args=(cfg, proxy, serve_url, target, result, errors),
                                 daemon=True)
        agent.start()
        args = PolarGRPOConfig(
            output_dir=str(work / "ckpt"), shards=str(out), max_steps=cfg.steps,
            per_device_train_batch_size=cfg.groups * cfg.group_size, num_generations=cfg.group_size,
            learning_rate=0.0 if cfg.arm == "lr0" else cfg.learning_rate,  # the lr0 arm's one point
            temperature=temperature, beta=0.0, logging_steps=1, seed=cfg.seed,
            save_strategy="no", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
            disable_tqdm=True, shard_poll_interval=0.1, shard_wait_timeout=cfg.timeout,
            vllm_importance_sampling_correction=cfg.is_correction, vllm_importance_sampling_mode=cfg.is_mode,
            sync_server=serve_url, sync_steps=1, sync_keep=2,
            max_policy_lag=cfg.max_policy_lag)
        model = AutoModelForCausalLM.from_pretrained(str(cfg.model_dir), dtype=torch.float32)
        trainer = PolarGRPOTrainer(model=model, args=args, processing_class=tok)
        trainer.rollout_func = ArmRollout(trainer.rollout_func, cfg.arm, cfg.seed)  # the arm's one point
        try:
            trainer.train()
        except Exception:
            if errors:  # the agent failed first; the trainer then waited for shards in vain
                raise errors[0] from None
            raise
        agent.join(cfg.timeout)
        if errors:
            raise errors[0]
        sync = next(c for c in trainer.callback_handler.callbacks if isinstance(c, WeightSyncCallback))
        result.syncs = sync.syncs
        result.shards = trainer.shard_source.stats.shards_read
        result.is_stats = [{k.removeprefix("sampling/"): v for k, v in h.items() if k.startswith("sampling/")}
                           for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
        if cfg.eval_samples:  # after the last step's sync: the trained policy, on prompts it never saw
            deadline = time.monotonic() + cfg.timeout
            while (v := http("GET", serve_url + SERVE_VERSION_PATH)["weight_version"]) != str(cfg.steps):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"held-out evaluation: server at weight_version {v}, not {cfg.steps}")
                time.sleep(0.05)
            result.heldout_after = evaluate(cfg, serve_url, target)
    result.seconds = time.monotonic() - t0
    return result


def main(argv=None):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--max-policy-lag", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=None, help="sent explicitly (default: the model's)")
    ap.add_argument("--top-k", type=int, default=None, help="sent explicitly (default: the model's)")
    ap.add_argument("--top-p", type=float, default=None, help="sent explicitly (default: the model's)")
    ap.add_argument("--no-is-correction", action="store_true", help="train without the IS correction")
    ap.add_argument("--arm", choices=ARMS, default="real", help="the ablation arm (see above)")
    ap.add_argument("--turns", type=int, default=2, help="assistant turns per episode (reward needs all)")
    ap.add_argument("--init-seed", type=int, default=None, help="the tiny Qwen3 built with this seed")
    ap.add_argument("--eval-samples", type=int, default=16, help="held-out episodes before/after (0: none)")
    ap.add_argument("--target", default=None, help="the target word (default: calibrated)")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    r = run_closed_loop(LoopConfig(a.workdir, a.model, steps=a.steps, groups=a.groups, group_size=a.group_size,
                                   learning_rate=a.lr, seed=a.seed, temperature=a.temperature, top_k=a.top_k,
                                   top_p=a.top_p, is_correction=not a.no_is_correction,
                                   dialect=a.dialect, max_policy_lag=a.max_policy_lag, arm=a.arm, turns=a.turns,
                                   init_seed=a.init_seed, eval_samples=a.eval_samples, target=a.target))
    print(r.summary())
    return r


if __name__ == "__main__":
    main()
