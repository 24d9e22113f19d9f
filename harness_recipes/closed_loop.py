"""Closed loop on the CPU: polar-serve -> mitmdump + addon -> a small agent -> polar-recon watch ->
PolarGRPOTrainer -> /polar/reload, for several iterations; the mean reward must rise.

    .venv/bin/python -m harness_recipes.closed_loop --workdir /tmp/loop [--steps 8] [--group-size 4] [--groups 2]

Processes (all real, all on 127.0.0.1, all stopped by pid): polar-serve serving the tiny Qwen3 with
``--weight-version 0``; mitmdump in reverse mode with addon/polar_addon.py writing LOGDIR;
``polar-recon watch LOGDIR OUT --group-size G`` writing shards. In this process: the agent (a thread)
and the trainer (main thread).

Synchronous on-policy schedule: agent iteration k waits until the server serves weight_version k,
runs `groups` groups of G episodes (one chat call each, through the proxy, episode id in the
``x-polar-episode`` header), scores each answer and ends the episode with
``POST /polar/<episode>/end {"reward": r, "metadata": {"group_id": ...}}``. Recon turns finished
groups into shards; trainer step k+1 consumes iteration k's groups and syncs weights (version k+1).

The task (learnable from a random model): the answer must contain a target word. The target is the
decoded token that, before training, appears in about a third of the sampled answers (measured by
calling polar-serve directly, outside the proxy, so calibration never reaches the training data).

Sampling: Qwen3's defaults, the way harnesses get them: the agent's requests set no sampling field
(as Pi's), so the server applies the model's generation_config.json (the tiny Qwen3's: T=0.6, top_k=20,
top_p=0.95; a random tiny model is near-uniform over 151936 tokens, so without truncation no answer
would ever contain the target), and the proxy, given the model directory (``polar_generation_config``),
records those values on every row; polar-serve reports processed logprobs (vllm dialect) or SGLang's
scaled ones (sglang dialect). ``--temperature/--top-k/--top-p`` send explicit values instead.
The trainer runs WITH the importance-sampling correction (TRL's default sequence_mask): its old-policy
log-probs are taken under each row's recorded transform (trainer/sampling.py), so on-policy rows give
ratio 1 where the full softmax would give each token its kept mass (~e^-6.5 here) and zero every
advantage. ``--no-is-correction`` turns it off.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .cache import tiny_model
from .procs import running, venv_bin
from .stack import capture_proxy, serve


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
    learning_rate: float = 2e-2
    calibration_samples: int = 32
    target_fraction: float = 0.4
    seed: int = 0  # sampling seeds (per episode) and the trainer's seed: the whole loop is reproducible
    prompt: str = "Name one thing."
    dialect: str = "vllm"
    max_policy_lag: int | None = None  # needs weight versions in the logs (see the README)
    timeout: float = 120.0


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

    def summary(self) -> str:
        return (f"target {self.target!r} (calibrated {self.calibration_fraction:.2f}); mean reward per iteration "
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
    """polar-serve + mitmdump/addon (+ ``polar-recon watch`` when group_size is given); yields the two URLs.
    Logs go to WORK/logs, shards to WORK/shards, process output to WORK/*.log."""
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
        yield srv.url, proxy.url


# -- the agent --------------------------------------------------------------------------------------
def answer_text(resp: dict) -> str:
    msg = resp["choices"][0]["message"]
    return (msg.get("content") or "") + (msg.get("reasoning") or msg.get("reasoning_content") or "")


def chat_body(cfg: LoopConfig, **extra) -> dict:
    sampling = {k: v for k, v in (("temperature", cfg.temperature), ("top_k", cfg.top_k), ("top_p", cfg.top_p))
                if v is not None}
    return {"messages": [{"role": "user", "content": cfg.prompt}], "max_tokens": cfg.max_tokens, **sampling,
            **extra}


def calibrate(cfg: LoopConfig, serve_url: str, tokenizer) -> tuple[str, float]:
    """Pick a target word present in about target_fraction of the untrained model's answers."""
    texts, cands = [], Counter()
    for i in range(cfg.calibration_samples):
        r = http("POST", serve_url + "/v1/chat/completions",
                 chat_body(cfg, return_token_ids=True, seed=cfg.seed * 100003 + 50000 + i))
        texts.append(answer_text(r))
        ch = r["choices"][0]
        for t in set(ch.get("token_ids") or ch.get("response_token_ids") or []):  # vLLM | SGLang names
            s = tokenizer.decode([t]).strip()
            # short fragments match by accident; a partial UTF-8 sequence ("\ufffd") shows in the text or
            # not depending on the next token, a reward the policy cannot learn
            if len(s) >= 2 and "\ufffd" not in s:
                cands[s] += 1
    if not cands:
        raise RuntimeError("calibration: no usable token in the sampled answers")
    frac = {s: sum(s in x for x in texts) / len(texts) for s in cands}
    target = min(frac, key=lambda s: (abs(frac[s] - cfg.target_fraction), s))
    return target, frac[target]


def run_agent(cfg: LoopConfig, proxy_url: str, serve_url: str, target: str, result: LoopResult,
              errors: list) -> None:
    try:
        for it in range(cfg.steps):
            deadline = time.monotonic() + cfg.timeout
            while (v := http("GET", serve_url + "/polar/weight_version")["weight_version"]) != str(it):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"iteration {it}: server still at weight_version {v}")
                time.sleep(0.05)
            rewards = []
            for g in range(cfg.groups):
                gid = f"it{it:03d}-g{g}"
                for e in range(cfg.group_size):
                    ep = f"{gid}-e{e}"
                    seed = cfg.seed * 100003 + it * 1000 + g * 100 + e  # reproducible, distinct per episode
                    r = http("POST", proxy_url + "/v1/chat/completions", chat_body(cfg, seed=seed),
                             {"x-polar-episode": ep})
                    reward = float(target in answer_text(r))
                    http("POST", f"{proxy_url}/polar/{ep}/end", {"reward": reward, "metadata": {"group_id": gid}})
                    rewards.append(reward)
            result.rewards.append(sum(rewards) / len(rewards))
            result.versions.append(v)
    except Exception as e:  # surfaced by the main thread
        errors.append(e)


# -- the loop ---------------------------------------------------------------------------------------
def run_closed_loop(cfg: LoopConfig) -> LoopResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.grpo import PolarGRPOConfig, PolarGRPOTrainer
    from trainer.sampling_temperature import generation_default

    t0 = time.monotonic()
    work = Path(cfg.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "shards"
    if cfg.model_dir is None:
        cfg.model_dir = tiny_model()
    tok = AutoTokenizer.from_pretrained(str(cfg.model_dir))
    # The trainer's logprob temperature is the one the server sampled at (checked on every group).
    temperature = cfg.temperature if cfg.temperature is not None else generation_default(Path(cfg.model_dir))
    with stack(work, cfg.model_dir, cfg.dialect, group_size=cfg.group_size, timeout=cfg.timeout) as (serve_url,
                                                                                                  proxy_url):
        target, frac = calibrate(cfg, serve_url, tok)
        result = LoopResult(target, frac)
        errors: list = []
        agent = threading.Thread(target=run_agent, args=(cfg, proxy_url, serve_url, target, result, errors),
                                 daemon=True)
        agent.start()
        args = PolarGRPOConfig(
            output_dir=str(work / "ckpt"), shards=str(out), max_steps=cfg.steps,
            per_device_train_batch_size=cfg.groups * cfg.group_size, num_generations=cfg.group_size,
            learning_rate=cfg.learning_rate, temperature=temperature, beta=0.0, logging_steps=1, seed=cfg.seed,
            save_strategy="no", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
            disable_tqdm=True, shard_poll_interval=0.1, shard_wait_timeout=cfg.timeout,
            vllm_importance_sampling_correction=cfg.is_correction, sync_server=serve_url, sync_steps=1, sync_keep=2,
            max_policy_lag=cfg.max_policy_lag)
        model = AutoModelForCausalLM.from_pretrained(str(cfg.model_dir), dtype=torch.float32)
        trainer = PolarGRPOTrainer(model=model, args=args, processing_class=tok)
        try:
            trainer.train()
        except Exception:
            if errors:  # the agent failed first; the trainer then waited for shards in vain
                raise errors[0] from None
            raise
        agent.join(cfg.timeout)
        if errors:
            raise errors[0]
        from trainer.weight_sync import WeightSyncCallback
        sync = next(c for c in trainer.callback_handler.callbacks if isinstance(c, WeightSyncCallback))
        result.syncs = sync.syncs
        result.shards = trainer.shard_source.stats.shards_read
        result.is_stats = [{k.removeprefix("sampling/"): v for k, v in h.items() if k.startswith("sampling/")}
                           for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
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
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=None, help="sent explicitly (default: the model's)")
    ap.add_argument("--top-k", type=int, default=None, help="sent explicitly (default: the model's)")
    ap.add_argument("--top-p", type=float, default=None, help="sent explicitly (default: the model's)")
    ap.add_argument("--no-is-correction", action="store_true", help="train without the IS correction")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    r = run_closed_loop(LoopConfig(a.workdir, a.model, steps=a.steps, groups=a.groups, group_size=a.group_size,
                                   learning_rate=a.lr, seed=a.seed, temperature=a.temperature, top_k=a.top_k,
                                   top_p=a.top_p, is_correction=not a.no_is_correction,
                                   dialect=a.dialect, max_policy_lag=a.max_policy_lag))
    print(r.summary())
    return r


if __name__ == "__main__":
    main()
