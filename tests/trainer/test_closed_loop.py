"""The issue's proofs with every part real: polar-serve, mitmdump + the addon, polar-recon, TRL.

1. Shards built by polar-recon from real proxy logs: the trainer's input ids, masks and old (behaviour)
   logprobs are, tensor by tensor, the shard's and the proxy log's; sampled at temperature 1 without
   truncation the trainer's own logprobs equal the server's, so the importance ratio is 1.
2. The closed loop (harness_recipes/closed_loop.py), with Qwen3's truncated sampling (the server's
   generation_config: T=0.6, top_k=20, top_p=0.95, recorded on every row by the proxy) and the
   importance-sampling correction ON (TRL's sequence_mask): every step's ratio is 1 (on-policy, the
   truncation-aware pi_old), nothing masked, and the mean reward rises clearly above its start.
"""
from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from harness_recipes.closed_loop import LoopConfig, answer_text, http, run_closed_loop, stack
from harness_recipes.procs import venv_bin
from tests.trainer.test_grpo_trainer import config, trainer, unpad

SAMPLING = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}  # mu == the trainer's pi


def episode(proxy: str, ep: str, gid: str, reward: float, calls: int) -> None:
    msgs = [{"role": "user", "content": f"Task {gid}: name a colour."}]
    r: dict = {}  # the previous call's answer
    for k in range(calls):
        if k:
            msgs += [{"role": "assistant", "content": answer_text(r)}, {"role": "user", "content": "Another one."}]
        r = http("POST", proxy + "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, **SAMPLING},
                 {"x-polar-episode": ep})
    http("POST", f"{proxy}/polar/{ep}/end", {"reward": reward, "metadata": {"group_id": gid}})


def test_trainer_inputs_equal_proxy_logs(tmp_path, tiny_dir):
    from polar_recon.logreader import read_log

    with stack(tmp_path, tiny_dir) as (_, proxy):
        for g in range(2):
            for e in range(2):
                episode(proxy, f"g{g}-e{e}", f"g{g}", float(e), calls=2 - g)  # g0: two calls, g1: one
    out = tmp_path / "shards"
    build = subprocess.run([venv_bin("polar-recon"), "build", str(tmp_path / "logs"), str(out),
                            "--group-size", "2"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    rows = pq.read_table(next(out.glob("shard-*.parquet"))).to_pylist()
    t = trainer(tiny_dir, config(tmp_path, shards=str(out), learning_rate=0.0, temperature=1.0))
    t.train()
    got = t.gens[0]
    assert got["prompt_ids"].shape[0] == len(rows) == 4, [r["episode_id"] for r in rows]
    pi_old = t._policy_logps(got)
    realigned = 0
    for i, r in enumerate(rows):
        u, p = unpad(got, i), r["prompt_len"]
        assert u["prompt"] == r["input_ids"][:p] and u["completion"] == r["input_ids"][p:]
        assert u["env_mask"] == r["loss_mask"][p:]
        assert torch.equal(u["logps"], torch.tensor(r["logprobs"][p:], dtype=torch.float32))
        # Against the proxy's own record of the two calls: trainable tokens = the sampled ids, in order,
        # their logprobs = the server's; the prompt = what the server tokenized for the first call.
        calls = read_log(tmp_path / "logs" / f"{r['episode_id']}.arrow")
        calls = calls.filter(calls["kind"] == "call") if "kind" in calls.columns else calls
        sampled = [x for ids in calls["completion_ids"].to_list() for x in ids]
        sampled_lp = [x for lps in calls["completion_logprobs"].to_list() for x in lps]
        train_ids = [x for x, m in zip(u["completion"], u["env_mask"]) if m]
        train_lp = u["logps"][torch.tensor(u["env_mask"]).bool()]
        assert train_ids == sampled, r["episode_id"]
        assert torch.equal(train_lp, torch.tensor(sampled_lp, dtype=torch.float32))
        assert u["prompt"] == calls["prompt_ids"].to_list()[0]
        assert (0 in u["env_mask"]) == (len(calls) == 2)  # the second turn's user message sits inside, masked
        # The trainer's own logprobs (pi_old) of the sampled tokens: sampled at temperature 1 without
        # truncation, the first call's equal the server's, so sequence boundaries are aligned token for
        # token. The second call's equal them too unless recon had to realign the first assistant turn
        # (the server then conditioned on the re-rendered turn, the training row on the sampled ids).
        diff = (pi_old[i][torch.tensor(u["env_mask"] + [0] * (pi_old.shape[1] - len(u["env_mask"]))).bool()]
                - train_lp).abs()
        n1 = len(calls["completion_ids"].to_list()[0])
        assert diff[:n1].max() < 1e-3, (r["episode_id"], diff)
        if r["n_realign"] == 0:
            assert diff.max() < 1e-3, (r["episode_id"], diff)
        realigned += r["n_realign"] > 0
    print(f"{realigned}/4 rows realigned; IS stats {got['is_stats']}", file=sys.stderr)
    assert realigned <= 2  # the one-call episodes are exact end to end
    if not realigned:  # the usual case: every trainable token's ratio is 1
        st = got["is_stats"]
        assert st["logp_diff_max"] < 1e-3 and st["mean"] == pytest.approx(1.0, abs=1e-3), st


@pytest.mark.parametrize("dialect,mode", [("vllm", "processed"), ("sglang", "scaled")])
def test_closed_loop_reward_rises(tmp_path, tiny_dir, dialect, mode):
    cfg = LoopConfig(tmp_path, tiny_dir, steps=6, groups=3, group_size=4, dialect=dialect)
    assert cfg.is_correction and cfg.temperature is cfg.top_k is cfg.top_p is None  # the server's defaults
    r = run_closed_loop(cfg)
    print(r.summary(), file=sys.stderr)
    rows = [x for f in sorted((tmp_path / "shards").glob("shard-*.parquet")) for x in pq.read_table(f).to_pylist()]
    assert rows and all((x["temperature"], x["top_k"], x["top_p"], x["min_p"], x["logprobs_mode"],
                         x["sampling_unsupported"]) == (0.6, 20, 0.95, 0.0, mode, None) for x in rows), rows[0]
    assert len(r.is_stats) == 6  # the correction ran at every step...
    for st in r.is_stats:  # ...on-policy, truncation-aware: ratio 1, nothing masked
        assert st["importance_sampling_ratio/clipped_frac"] == 0.0, st
        assert abs(st["importance_sampling_ratio/mean"] - 1) < 1e-3, st
        assert st["sampling_logp_difference/mean"] < 1e-3, st
    assert r.versions == [str(k) for k in range(6)]  # each iteration sampled the newest weights
    assert [s["weight_version"] for s in r.syncs] == [str(k) for k in range(1, 7)]
    start, end = r.rewards[0], sum(r.rewards[-2:]) / 2
    assert end >= start + 0.3 and end >= 0.75, r.summary()
