"""End to end: the four recorded harness request streams (Codex / Responses, Claude Code / Messages,
Qwen Code and Pi / chat) through the real mitmdump + addon to polar-serve (tiny Qwen3, real
tokenizer, scripted replies), each episode ended with its reward, then `polar-recon build` and
`polar-recon drift` on the logs the proxy wrote."""
from __future__ import annotations

import json

import httpx
import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from polar_contracts.log.reader import read_episode
from polar_recon.cli import main
from tests.addon.procs import mitmdump
from tests.support.servers import polar_serve, tiny_model_dir

from .logs import REPO

# replies equal to what the recorded sessions got: the replayed histories resend what was sampled
SCRIPT = REPO / "tests" / "recon" / "harness_fixture_script.json"
FIXTURES = REPO / "tests" / "fixtures" / "harness-requests"
HARNESSES = ["codex", "claude-code", "qwen-code", "pi"]


def replay_harnesses(work, logdir) -> dict[str, str]:
    """Send each harness's recorded calls, in order, as one episode; end it with a reward."""
    episodes = {}
    with polar_serve(tiny_model_dir(), "vllm", script=SCRIPT) as srv:
        with mitmdump(work, logdir, upstream=srv.base_url, sets={"polar_dialect": "auto"}) as px:
            model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            with httpx.Client(timeout=300) as c:
                for k, h in enumerate(HARNESSES):
                    ep = f"e2e-{h}"
                    for line in (FIXTURES / f"{h}.jsonl").read_text().splitlines():
                        rec = json.loads(line)
                        body = {**rec["body"], "model": model}
                        with c.stream("POST", px.url + rec["path"], json=body, headers={"x-polar-episode": ep}) as r:
                            raw = b"".join(r.iter_raw())
                            assert r.status_code == 200, (h, raw[:500])
                    r = c.post(f"{px.url}/polar/{ep}/end", json={"reward": float(k), "metadata": {"harness": h}})
                    assert r.status_code == 200, r.text
                    episodes[h] = ep
    return episodes


@pytest.fixture(scope="module")
def proxied_logs(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-recon")
    logdir = work / "logs"
    return work, logdir, replay_harnesses(work, logdir)


def test_build_from_proxy_logs_is_token_faithful(proxied_logs):
    work, logdir, episodes = proxied_logs
    out = work / "out"
    r = CliRunner().invoke(main, ["build", str(logdir), str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    df = pl.concat([pl.read_parquet(p) for p in sorted(out.glob("shard-*.parquet"))])
    assert set(df["episode_id"]) == set(episodes.values())
    for h, ep in episodes.items():
        log = read_episode(logdir / f"{ep}.arrow")
        assert log.finished and log.reward == float(HARNESSES.index(h))
        rows = df.filter(pl.col("episode_id") == ep)
        calls = {row["call_index"]: row for row in log.calls.iter_rows(named=True)}
        trained = []
        for row in rows.iter_rows(named=True):
            ids, mask, lps = (np.asarray(row[c]) for c in ("input_ids", "loss_mask", "logprobs"))
            assert ids[: row["prompt_len"]].tolist() == calls[min(calls)]["prompt_ids"] or row["segment"] > 0
            assert row["reward"] == log.reward
            trained.append((ids[mask == 1], lps[mask == 1]))
        got_ids = np.concatenate([t[0] for t in trained])
        got_lps = np.concatenate([t[1] for t in trained])
        # every sampled id (calls not auxiliary, not failed) is trained exactly once, with its logprob
        want = [c for c in calls.values() if not c["auxiliary"] and c["error"] is None]
        assert sorted(got_ids.tolist()) == sorted(sum((c["completion_ids"] for c in want), []))
        assert np.isclose(np.sort(got_lps), np.sort(np.concatenate([c["completion_logprobs"] for c in want]))).all()


def test_drift_on_the_four_harnesses(proxied_logs, capsys):
    work, logdir, episodes = proxied_logs
    r = CliRunner().invoke(main, ["drift", str(logdir), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    with capsys.disabled():
        print("\n[drift on the four harness fixtures through proxy + polar-serve] " + json.dumps(d))
    assert d["episodes"] == 4 and set(d["links_by_harness"]) == set(HARNESSES)
    for h in HARNESSES:
        kinds = d["links_by_harness"][h]
        assert sum(kinds.values()) == len((FIXTURES / f"{h}.jsonl").read_text().splitlines())
        # the recorded histories resend exactly what the script makes polar-serve sample (reasoning
        # included, no stray whitespace), so every later call extends its parent token for token...
        assert kinds == {"FORK": 1, "CLEAN": 2}, (h, kinds)
    # ...and the text baseline, rendered as the server renders (content parts joined, Responses and
    # Messages translated by the addon), reproduces them: this checks the baseline, not the harnesses
    assert d["retokenize_differing_tokens"] == 0 and d["trainable_tokens"] > 0
