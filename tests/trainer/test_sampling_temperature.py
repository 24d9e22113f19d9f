"""The trainer computes its logprobs at the temperature the server sampled with.

The demo's 0.25 nat/token mismatch: Pi sends no temperature, so polar-serve (like vLLM and SGLang)
applied the model's generation_config.json default (0.6 for Qwen3), while TRL's logprobs used its
default temperature 1.0; the sequence-level IS mask then dropped every sequence. Here a call goes
through the real stack with Pi's real sampling fields (none), and the trainer's own logprobs of the
same tokens are compared with the served ones.
"""
from __future__ import annotations

import json
import urllib.request

import pyarrow.parquet as pq
import pytest
import torch

from harness_recipes.node.local_stack import capture_proxy, serve
from polar_contracts.control import capability, control_headers
from polar_recon.build import Options, build
from tests.trainer.shardkit import write_shard
from tests.trainer.test_grpo_trainer import config, trainer, unpad
from trainer.row_exclusions import ExcludedShareError
from trainer.row_temperature import TemperatureMismatch, check_rows, generation_default, logprob_temperature

# What Pi 0.73 sends besides messages/tools (recorded in a demo capture log): no sampling fields.
PI_FIELDS = {"model": "polar-model", "stream": True, "stream_options": {"include_usage": True}, "store": False,
             "max_completion_tokens": 16384}
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
SCRIPT = {"turns": [{"reasoning": "The user wants a greeting file.",
                     "tool_calls": [{"tool": "bash", "arguments": {"command": "echo hi > hello.txt"}}]}],
          "fallback": {"content": "Done: hello.txt contains hi."}}


def pi_call(proxy: str, episode: str, task: str) -> None:
    """One pi-shaped call naming ``episode`` (its capability, on a proxy with a control secret)."""
    body = {**PI_FIELDS, "messages": [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": task}], "tools": [BASH]}
    req = urllib.request.Request(proxy + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "x-polar-episode": episode})
    with urllib.request.urlopen(req, timeout=120) as r:
        text = r.read().decode()
    assert "data: [DONE]" in text, text[-500:]


def end(proxy: str, episode: str, reward: float, group: str, secret: str | None = None) -> None:
    req = urllib.request.Request(f"{proxy}/polar/{episode}/end", method="POST",
                                 data=json.dumps({"reward": reward, "metadata": {"group_id": group}}).encode(),
                                 headers={"Content-Type": "application/json", **control_headers(secret)})
    urllib.request.urlopen(req, timeout=30).read()


@pytest.fixture(scope="module")
def pi_shards(tmp_path_factory, tiny_dir):
    served_default = json.loads((tiny_dir / "generation_config.json").read_text()).get("temperature")
    assert served_default == 0.6, f"{tiny_dir}: expected Qwen3's generation_config temperature 0.6, got {served_default}"
    work = tmp_path_factory.mktemp("pi")
    script = work / "script.json"
    script.write_text(json.dumps(SCRIPT))
    # The server loads the model through a link that is gone by the first call, as a model on another
    # machine: the proxy cannot read its generation_config.json (addon/sampling_discovery.py)
    link = work / "model-elsewhere"
    link.symlink_to(tiny_dir, target_is_directory=True)
    with serve(link, script=script) as srv, capture_proxy(srv.url, work / "logs") as proxy:
        link.unlink()
        for e in range(2):
            pi_call(proxy.url, capability(proxy.secret, f"g0-e{e}"), f"Task {e}: create hello.txt containing hi.")
            end(proxy.url, f"g0-e{e}", float(e), "g0", proxy.secret)
    rep = build(work / "logs", work / "shards", Options(group_size=2))
    assert sorted(rep.built) == ["g0-e0", "g0-e1"] and not rep.errors, rep
    # The proxy ran without polar_generation_config, could not read the served model's defaults and
    # could not probe the scripted server: the rows say temperature null (the server's default
    # applied, sampling_source saying why it is unknown) and logprobs_mode null (unknown), as shards
    # of older builds do. With the IS correction on the trainer refuses an unknown mode (tested below),
    # so the temperature tests read a copy that names what the scripted server's logprobs are (its
    # forced tokens' log-softmax at the temperature, before any truncation: checked token by token in
    # the first test): "scaled".
    (src,) = (work / "shards").glob("shard-*.parquet")
    rows = pq.read_table(src).to_pylist()
    assert {r["logprobs_mode"] for r in rows} == {None}, rows
    assert all(r["sampling_source"].startswith("unknown: the server serves") for r in rows), rows[0]
    write_shard(work / "scaled", 1, [dict(r, logprobs_mode="scaled") for r in rows])
    return work


def test_unknown_logprobs_mode_is_excluded_then_stops_with_the_fix(pi_shards, tiny_dir, tmp_path):
    t = trainer(tiny_dir, config(tmp_path, shards=str(pi_shards / "shards"), learning_rate=0.0, temperature=0.6,
                                 per_device_train_batch_size=2, excluded_share_window=10))
    with pytest.raises(ExcludedShareError, match="logprobs_unknown: 100.0% .*unknown mode.*--logprobs-mode "
                                                 "processed_logprobs"):
        t.train()


def test_trainer_logprobs_equal_served_ones_at_the_sampling_temperature(pi_shards, tiny_dir, tmp_path):
    rows = pq.read_table(next((pi_shards / "scaled").glob("shard-*.parquet"))).to_pylist()
    assert [r["temperature"] for r in rows] == [None, None]  # Pi set none: the server's default applied
    # TRL's default IS mode (polar's is token_truncate): a temperature gap of 0.25 nat/token would mask
    # every sequence
    cfg = config(tmp_path, shards=str(pi_shards / "scaled"), learning_rate=0.0, temperature=0.6,
                 per_device_train_batch_size=2, vllm_importance_sampling_mode="sequence_mask")
    t = trainer(tiny_dir, cfg)
    t.train()
    got = t.gens[0]
    pi_old = t._policy_logps(got)
    for i, r in enumerate(rows):
        u = unpad(got, i)
        m = torch.tensor(u["env_mask"]).bool()
        served = u["logps"][m]
        assert len(served) > 20  # the scripted reasoning + tool call
        diff = (pi_old[i][: len(u["env_mask"])][m] - served).abs()
        assert diff.max() < 1e-3, (r["episode_id"], diff)
    st = got["is_stats"]
    assert st["clipped_frac"] == 0.0 and st["min"] == pytest.approx(1.0, abs=0.05), st
    # ...and at TRL's default temperature the same tokens are what the demo reported: far off
    ids = torch.cat([got["prompt_ids"], got["completion_ids"]], 1)[:1]
    with torch.no_grad():
        logits = t.model(ids).logits[0, got["prompt_ids"].shape[1] - 1:-1].float()
    at1 = torch.log_softmax(logits, -1).gather(-1, got["completion_ids"][0][:, None])[:, 0]
    m = got["completion_mask"][0].bool() & got["tool_mask"][0].bool()
    assert (at1[m] - got["sampling_per_token_logps"][0][m]).mean().abs() > 0.05


def test_trainer_stops_on_a_temperature_other_than_the_servers(pi_shards, tiny_dir, tmp_path):
    # Each row is a counted exclusion (temperature_mismatch); all of them: the share stops the run, naming
    # the temperature to pass.
    t = trainer(tiny_dir, config(tmp_path, shards=str(pi_shards / "scaled"), learning_rate=0.0,
                                 per_device_train_batch_size=2, excluded_share_window=10))  # TRL's T: 1.0
    with pytest.raises(ExcludedShareError, match=r"temperature_mismatch: 100\.0% \(sampled at temperature 0\.6 "
                                                 r"\(the server's default\).*pass --temperature 0\.6"):
        t.train()
    assert t.shard_rollout.stats.rows_excluded == {"temperature_mismatch": 2}
    # a server that ran another model: its default given explicitly
    cfg = config(tmp_path, shards=str(pi_shards / "scaled"), learning_rate=0.0, served_default_temperature=1.0,
                 per_device_train_batch_size=2,
                 max_steps=1)
    trainer(tiny_dir, cfg).train()


def test_logprob_temperature_rules(tiny_dir):
    assert generation_default(str(tiny_dir)) == 0.6 and generation_default(object()) == 1.0
    assert logprob_temperature(None, 0.6) == 0.6 and logprob_temperature(0.8, 0.6) == 0.8
    assert logprob_temperature(0.0, 0.6) == 1.0  # greedy: servers report unscaled logprobs
    check_rows([{"episode_id": "a", "temperature": 0.0}, {"episode_id": "b"}], 1.0, 0.6, "g")  # no column: unchecked
    with pytest.raises(TemperatureMismatch, match="Train these groups separately"):
        check_rows([{"episode_id": "a", "temperature": 0.7}, {"episode_id": "b", "temperature": None}], 1.0, 0.6, "g")
