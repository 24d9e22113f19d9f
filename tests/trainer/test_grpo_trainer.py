"""PolarGRPOTrainer on real TRL 1.16, CPU, tiny Qwen3: inputs equal the shards, training moves the
weights, the IS correction reaches the loss, group-size policy, cursor across a real resume."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainer.shardkit import row, synthetic_seq, write_shard
from trainer.grpo_config import PolarGRPOConfig
from trainer.grpo_trainer import PolarGRPOTrainer
from trainer.shard_source import CURSOR_FILE

# Rows sampled at temperature 1 from the full softmax, processed logprobs (what Sampler() does).
PLAIN = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "logprobs_mode": "processed"}


class Recording(PolarGRPOTrainer):
    """Keeps a copy of every batch TRL built (before its shuffle), with the IS statistics."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not hasattr(self, "gens"):
            self.gens = []
        snap = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in out.items()}
        snap["is_stats"] = dict(self.polar_is_stats)
        snap["rows"] = [None if x["polar_pad"] else (x["episode_id"], x["segment"]) for x in inputs]
        self.gens.append(snap)
        return out


def config(tmp_path: Path, **kw) -> PolarGRPOConfig:
    base = dict(output_dir=str(tmp_path / "out"), shards=str(tmp_path / "shards"), max_steps=1,
                per_device_train_batch_size=4, num_generations=2, learning_rate=1e-6, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
                shard_wait_timeout=20, shard_poll_interval=0.05, seed=0, disable_tqdm=True)
    base.update(kw)
    return PolarGRPOConfig(**base)


def trainer(tiny_dir, cfg, cls=Recording, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    return cls(model=model, args=cfg, processing_class=tok, **kw)


def real_groups(sampler, n_groups: int, tag: str, turns=(1, 2)) -> list[dict]:
    rows = []
    for g in range(n_groups):
        for e in range(2):
            seq = sampler.episode(f"{tag} task {g}: say something", turns=turns[e % len(turns)], n_tokens=5)
            rows.append(row(seq, f"{tag}{g}-e{e}", f"{tag}{g}", reward=float(e == g % 2), group_size=2,
                            **sampler.columns))
    return rows


def unpad(out: dict, i: int) -> dict:
    pm, cm = out["prompt_mask"][i].bool(), out["completion_mask"][i].bool()
    return {"prompt": out["prompt_ids"][i][pm].tolist(), "completion": out["completion_ids"][i][cm].tolist(),
            "env_mask": out["tool_mask"][i][cm].tolist(), "logps": out["sampling_per_token_logps"][i][cm]}


def test_trainer_inputs_are_the_shard_tensors(tmp_path, tiny_dir, sampler):
    rows = real_groups(sampler, 2, "t")
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0))
    t.train()
    out = t.gens[0]
    assert out["prompt_ids"].shape[0] == 4
    for i, r in enumerate(rows):  # rollout order == shard order (consecutive rows = one group)
        got, p = unpad(out, i), r["prompt_len"]
        assert got["prompt"] == r["input_ids"][:p]
        assert got["completion"] == r["input_ids"][p:]
        assert got["env_mask"] == r["loss_mask"][p:]
        assert 0 in got["env_mask"] or r["n_calls"] == 1  # multi-turn rows carry masked tool tokens
        assert torch.equal(got["logps"], torch.tensor(r["logprobs"][p:], dtype=torch.float32))
    # The trainer's own logprobs of those tokens (pi_old) match the recorded behaviour logprobs, so
    # prompt/completion boundaries and the mask are aligned token for token: the IS ratio is 1.
    st = out["is_stats"]
    assert st["logp_diff_max"] < 1e-3, st
    assert st["mean"] == pytest.approx(1.0, abs=1e-3)
    # Group-normalised advantages follow the shard rewards (reward 1 above reward 0 in each group).
    adv = out["advantages"]
    adv = adv if adv.dim() == 1 else adv[:, 0]
    for g in range(2):
        hi, lo = (2 * g, 2 * g + 1) if rows[2 * g]["reward"] > rows[2 * g + 1]["reward"] else (2 * g + 1, 2 * g)
        assert adv[hi] > 0 > adv[lo]


def test_training_steps_change_weights(tmp_path, tiny_dir, sampler):
    write_shard(tmp_path / "shards", 1, real_groups(sampler, 4, "a"))
    write_shard(tmp_path / "shards", 2, real_groups(sampler, 2, "b"))
    t = trainer(tiny_dir, config(tmp_path, max_steps=3, learning_rate=1e-2))
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    changed = [n for n, p in t.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(changed) >= len(before) // 2, changed
    logs = [h for h in t.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    for key in ("sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/clipped_frac",
                "polar/shard_load_s", "polar/landing_to_batch_s", "reward"):
        assert key in logs[0], (key, sorted(logs[0]))
    assert t.shard_source.stats.groups_out == 6
    assert t.shard_source.cursor.consumed == ["shard-000001.parquet", "shard-000002.parquet"]


def shifted(rows: list[dict], shifts: list[float]) -> list[dict]:
    """Behaviour logprobs lowered by `shift` on each trainable token: pi_old/mu = exp(shift) per token."""
    out = []
    for r, s in zip(rows, shifts):
        lp = [x - s if m else x for x, m in zip(r["logprobs"], r["loss_mask"])]
        out.append(dict(r, logprobs=lp))
    return out


@pytest.mark.parametrize("mode,clip_min,clip_max,shifts,expected", [
    ("token_truncate", None, 3.0, [math.log(2), math.log(10), math.log(0.5), 0.0], [2.0, 3.0, 0.5, 1.0]),
    ("token_mask", 0.6, 3.0, [math.log(2), math.log(10), math.log(0.5), 0.0], [2.0, 0.0, 0.0, 1.0]),
])
def test_is_correction_reaches_the_advantages(tmp_path, tiny_dir, sampler, mode, clip_min, clip_max, shifts,
                                              expected):
    rows = real_groups(sampler, 2, "is", turns=(1,))
    write_shard(tmp_path / "plain" / "shards", 1, rows)
    write_shard(tmp_path / "shift" / "shards", 1, shifted(rows, shifts))
    base = trainer(tiny_dir, config(tmp_path / "plain", learning_rate=0.0, vllm_importance_sampling_correction=False))
    base.train()
    t = trainer(tiny_dir, config(tmp_path / "shift", learning_rate=0.0, vllm_importance_sampling_mode=mode,
                                 vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max))
    t.train()
    a_raw = base.gens[0]["advantages"]
    a = t.gens[0]["advantages"]
    assert a_raw.dim() == 1 and a.dim() == 2  # (B,) without correction, (B, T) with a token mode
    for i, want in enumerate(expected):
        m = t.gens[0]["completion_mask"][i].bool()
        assert torch.allclose(a[i][m], a_raw[i] * want, rtol=2e-3, atol=1e-5), (i, a[i][m], a_raw[i], want)
    n_out = sum(w != s for w, s in zip(expected, [math.exp(s) for s in shifts]))
    assert t.gens[0]["is_stats"]["clipped_frac"] == pytest.approx(n_out / 4, abs=0.01)


def test_sequence_mask_zeroes_whole_rows(tmp_path, tiny_dir, sampler):
    rows = real_groups(sampler, 2, "sq", turns=(1,))
    # 5 trainable tokens each: total log-ratio 5*0.1 -> 1.65 (kept), 5*0.5 -> 12.2 (> 3: masked).
    write_shard(tmp_path / "shards", 1, shifted(rows, [0.1, 0.5, 0.0, -0.5]))
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, vllm_importance_sampling_mode="sequence_mask"))  # TRL's
    t.train()
    a = t.gens[0]["advantages"]
    assert a.shape[1] == 1
    st = t.gens[0]["is_stats"]
    assert st["clipped_frac"] == pytest.approx(0.25)  # exp(-2.5)=0.08 stays: no clip_min by default
    assert a[1, 0] == 0.0 and a[0, 0] != 0.0
    assert t.exclusions.excluded_tokens == {"is_ratio_high": 5}  # the masked row's tokens, counted


def test_default_token_truncate_keeps_every_token(tmp_path, tiny_dir, sampler):
    """The default (token_truncate, clip_max 3): per-token ratios, clamped, none zeroed, nothing counted."""
    rows = real_groups(sampler, 2, "tt", turns=(1,))
    write_shard(tmp_path / "shards", 1, shifted(rows, [0.1, 0.5, 0.0, -0.5]))
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0))
    t.train()
    out = t.gens[0]
    a, m = out["advantages"], out["completion_mask"] * out["tool_mask"]
    assert a.shape[1] > 1 and bool((a[m.bool()] != 0).all())
    st = out["is_stats"]
    assert st["masked_frac"] == 0.0 and st["lost_token_share"] == 0.0 and st["max"] <= 3.0
    assert st["min"] == pytest.approx(math.exp(-0.5), rel=1e-3) and sum(t.exclusions.excluded_tokens.values()) == 0


def test_group_size_policy_pad_and_skip(tmp_path, tiny_dir):
    p = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n
    s = lambda k, n=3: synthetic_seq(p, [100 + k + j for j in range(n)])  # noqa: E731
    a = [row(s(0), "A-e0", "A", 1.0), row(s(1), "A-e1", "A", 0.0, segment=0),
         row(s(2), "A-e1", "A", 0.0, segment=1), row(s(3), "A-e2", "A", 0.5)]  # 3 episodes, 4 rows
    b = [row(s(4), "B-e0", "B", 1.0), row(s(5), "B-e1", "B", 0.0)]  # 2 rows: 2 padding rows
    lone = [row(s(6), "L-e0", "L", 1.0), row(s(7), "L-e0", "L", 1.0, segment=1)]  # one episode: skipped
    write_shard(tmp_path / "shards", 1, a + lone + b)
    t = trainer(tiny_dir, config(tmp_path, per_device_train_batch_size=8, num_generations=4, learning_rate=0.0,
                                 vllm_importance_sampling_correction=False))
    t.train()
    out = t.gens[0]
    adv, tm = out["advantages"], out["tool_mask"] * out["completion_mask"]
    assert [len(unpad(out, i)["completion"]) for i in range(8)] == [3, 3, 3, 3, 3, 3, 1, 1]
    assert tm[6:].sum() == 0 and torch.all(adv[6:] == 0)  # padding rows: nothing to train, no advantage
    assert adv[4] > 0 > adv[5] and adv[4] == pytest.approx(-adv[5])  # baseline over the 2 real rows only
    # Segments of one episode carry its reward: rows 1 and 2 (episode A-e1) get the same advantage.
    assert adv[1] == adv[2]
    assert t.shard_rollout.stats.rows_padded == 2 and t.shard_rollout.stats.skipped == {"too_few_episodes": 1}

    c = [dict(r, group_id="C") for r in b]
    write_shard(tmp_path / "skip" / "shards", 1, b + a + c)
    t2 = trainer(tiny_dir, config(tmp_path / "skip", per_device_train_batch_size=4, num_generations=4,
                                  learning_rate=0.0, group_size_policy="skip", vllm_importance_sampling_correction=False))
    t2.train()
    assert t2.shard_rollout.stats.skipped == {"size_mismatch": 1}
    assert unpad(t2.gens[0], 0)["completion"] == s(0)["input_ids"][len(p):]


def test_checkpoint_cursor_and_resume(tmp_path, tiny_dir):
    p = [151644, 872, 198, 151645, 198, 151644, 77091, 198]
    rows = [row(synthetic_seq(p, [300 + 10 * g + e, 7]), f"g{g}-e{e}", f"g{g}", float(e), group_size=2, **PLAIN)
            for g in range(6) for e in range(2)]
    write_shard(tmp_path / "shards", 1, rows[:6])
    write_shard(tmp_path / "shards", 2, rows[6:])
    cfg = dict(max_steps=2, save_strategy="steps", save_steps=1, learning_rate=1e-3)
    t = trainer(tiny_dir, config(tmp_path, **cfg))
    t.train()
    ck1 = json.loads((tmp_path / "out" / "checkpoint-1" / CURSOR_FILE).read_text())
    assert ck1 == {"consumed": [], "current": "shard-000001.parquet", "group_offset": 2}
    ck2 = json.loads((tmp_path / "out" / "checkpoint-2" / CURSOR_FILE).read_text())
    assert ck2 == {"consumed": ["shard-000001.parquet"], "current": "shard-000002.parquet", "group_offset": 1}
    # Resume from checkpoint-1 in a fresh trainer: the next groups are g2, g3 (not g0 again, not g4).
    t2 = trainer(tiny_dir, config(tmp_path, **cfg))
    t2.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    trained = [rows_completion[0] for rows_completion in
               (unpad(t2.gens[0], i)["completion"] for i in range(4))]
    assert trained == [320, 321, 330, 331]


def test_config_refuses_misaligned_checkpoints_and_vllm(tmp_path):
    with pytest.raises(ValueError, match="middle of a rollout batch"):
        config(tmp_path, save_strategy="steps", save_steps=1, steps_per_generation=2)
    config(tmp_path, save_strategy="steps", save_steps=2, steps_per_generation=2)
    with pytest.raises(ValueError, match="set max_steps"):
        config(tmp_path, max_steps=-1)
    with pytest.raises(ValueError, match="group_size_policy"):
        config(tmp_path, group_size_policy="truncate")
    with pytest.raises(ValueError, match="server_logits_dtype"):
        config(tmp_path, server_logits_dtype="int8")
    assert config(tmp_path, server_logits_dtype="bfloat16").server_logits_dtype == "bfloat16"


def test_train_grpo_script_and_resume(tmp_path, tiny_dir):
    from trainer.train_grpo import train as main

    p = [151644, 872, 198, 151645, 198, 151644, 77091, 198]
    rows = [row(synthetic_seq(p, [500 + 10 * g + e, 7]), f"g{g}-e{e}", f"g{g}", float(e), group_size=2, **PLAIN)
            for g in range(6) for e in range(2)]
    write_shard(tmp_path / "shards", 1, rows)
    argv = ["--shards", str(tmp_path / "shards"), "--model", str(tiny_dir), "--output_dir", str(tmp_path / "ckpt"),
            "--num_generations", "2", "--per_device_train_batch_size", "4", "--use_cpu", "--bf16", "false",
            "--gradient_checkpointing", "false", "--report_to", "none", "--save_steps", "1", "--shard_wait_timeout",
            "10", "--disable_tqdm", "true", "--vllm_importance_sampling_mode", "token_truncate"]
    t = main(argv + ["--max_steps", "1"])
    assert t.args.vllm_importance_sampling_mode == "token_truncate" and t.state.global_step == 1
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    t2 = main(argv + ["--max_steps", "2", "--resume"])  # continues at step 1 with groups g2, g3
    assert t2.state.global_step == 2
    assert json.loads((tmp_path / "ckpt" / "checkpoint-2" / CURSOR_FILE).read_text())["group_offset"] == 4
    with pytest.raises(SystemExit, match="--shards OUT is required"):
        main(["--model", str(tiny_dir), "--output_dir", str(tmp_path / "x"), "--max_steps", "1", "--use_cpu",
              "--bf16", "false"])


def test_polar_train_on_a_machine_without_gpu_exits_0(tmp_path, tiny_dir, monkeypatch, capfd):
    """The README's polar-train line (no --use_cpu, no --bf16) on a machine without an accelerator trains on
    the CPU in fp32 and says so in one line; the console script's value is 0 (sys.exit(main()))."""
    import trainer.cpu_fallback
    from trainer.train_grpo import main

    monkeypatch.setattr(trainer.cpu_fallback, "accelerator_present", lambda: False)  # also on a GPU machine
    p = [151644, 872, 198, 151645, 198, 151644, 77091, 198]
    rows = [row(synthetic_seq(p, [500 + 10 * g + e, 7]), f"g{g}-e{e}", f"g{g}", float(e), group_size=2, **PLAIN)
            for g in range(2) for e in range(2)]
    write_shard(tmp_path / "shards", 1, rows)
    rc = main(["--shards", str(tmp_path / "shards"), "--model", str(tiny_dir), "--output_dir", str(tmp_path / "ckpt"),
               "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size", "4",
               "--gradient_checkpointing", "false", "--report_to", "none", "--shard_wait_timeout", "10",
               "--disable_tqdm", "true"])
    assert rc == 0
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    err = capfd.readouterr().err
    assert err.count("polar-train: no GPU found: training on the CPU in fp32") == 1, err[-2000:]
    cfg = config(tmp_path, use_cpu=False, bf16=None)
    assert (cfg.use_cpu, cfg.bf16) == (True, False) and "no GPU found" in capfd.readouterr().err
    kept = config(tmp_path, use_cpu=True, bf16=False)  # chosen by the user: untouched, no line
    assert (kept.use_cpu, kept.bf16) == (True, False) and "no GPU" not in capfd.readouterr().err


def test_polar_train_help_and_bad_model(tmp_path, capsys, monkeypatch):
    """--help shows Polar's options first and fits a screen or two; --help-all is TRL's full list; a bad
    --model names the problem instead of Hugging Face's repo-id traceback."""
    from trainer.train_grpo import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("usage: polar-train --shards OUT --model DIR") and len(out) < 400, len(out)
    head = "\n".join(out[:40])
    for name in ("--model", "--resume", "--shards", "--shard_wait_timeout"):
        assert name in head, name
    text = "\n".join(out)
    for name in ("--sync_secret_file", "--max_policy_lag", "--temperature", "--learning_rate", "--use_cpu"):
        assert f"  {name} (default:" in text, name
    total = int(next(line for line in out if line.startswith("--help-all: all ")).split()[2])
    assert total > 150  # TRL 1.16: some 227
    with pytest.raises(SystemExit) as info:
        main(["--help-all"])
    assert info.value.code == 0
    full = capsys.readouterr().out
    assert full.count("\n") > 1000 and "--vllm_importance_sampling_mode" in full and "--sync_secret_file" in full
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["--shards", str(tmp_path), "--output_dir", str(tmp_path / "o"), "--max_steps", "1", "--use_cpu",
            "--bf16", "false", "--report_to", "none"]
    with pytest.raises(SystemExit, match=r"--model \./no/such/model: no such directory"):
        main(base + ["--model", "./no/such/model"])
    with pytest.raises(SystemExit, match=r"not a Hugging Face model directory \(no config.json"):
        main(base + ["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--model bad name!: cannot load the policy \(not a local model directory"):
        main(base + ["--model", "bad name!"])


def test_vespo_reads_the_ratio_instead_of_scaled_advantages(tmp_path, tiny_dir, sampler):
    rows = real_groups(sampler, 2, "vespo", turns=(1,))
    write_shard(tmp_path / "shards", 1, shifted(rows, [math.log(2), math.log(10), 0.0, 0.0]))
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, loss_type="vespo",
                                 vllm_importance_sampling_mode="token_truncate"))
    t.train()
    out = t.gens[0]
    assert out["advantages"].dim() == 1  # untouched: TRL's vespo loss applies the ratio itself
    ratio, m = out["importance_sampling_ratio"], out["completion_mask"].bool()
    for i, want in enumerate([2.0, 3.0, 1.0, 1.0]):
        assert torch.allclose(ratio[i][m[i]], torch.full_like(ratio[i][m[i]], want), rtol=2e-3)
    with pytest.raises(ValueError, match="vespo loss needs a token_"):
        config(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
