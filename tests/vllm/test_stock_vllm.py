"""A vLLM started the usual way behind a proxy given no option: the real vLLM 0.32
(``stock_vllm``: its default ``--generation-config auto`` on the tiny Qwen3, whose
generation_config.json says T=0.6, top_k=20, top_p=0.95; default raw logprobs; no
VLLM_SERVER_DEV_MODE, so it names no weight version), requests without sampling fields, as Pi and
others send them.

- Every row records the values the server applied, discovered from the server (vLLM's /v1/models
  ``root`` -> generation_config.json), with ``sampling_source`` saying so; the proxied answer is the
  one vLLM gives the same request with those values spelled out (same seed).
- Every row names a weight version from the first call: the proxy's own (``proxy:<start>-0``).
- polar-recon builds the shards and real TRL GRPO steps run on them. Raw logprobs (vLLM's default)
  cannot serve as the behaviour policy of an importance ratio, so the steps run without the
  correction; with it on, the trainer stops naming that cause and its fix (``--logprobs-mode
  processed_logprobs``), never "no complete group". (With processed logprobs and no option, the
  corrected ratio is 1: tests/vllm/test_is_ratio_vllm.py.)
- Completions with ``echo``: the row with the harness's own logprobs holds the completion's part of
  vLLM's prompt+completion logprobs; without them the row is an error saying why.
"""
from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from harness_recipes.node.local_stack import capture_proxy
from polar_contracts.log.reader import read_log
from polar_contracts.weight_versions import is_proxy_version
from polar_recon.build import Options, build
from tests.conftest import VLLM_MODEL_NAME
from tests.trainer.test_grpo_trainer import config, trainer
from trainer.row_exclusions import ExcludedShareError

from .capture_support import assert_same_answer, differs_only_in_chunking
from .capture_support import post as post_raw

QWEN3 = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
GROUPS, GROUP_SIZE, MAX_TOKENS = 4, 2, 6  # top_p < 1 sorts the vocabulary per token on vLLM's CPU path
PROMPT = "The capital of France is"


def post(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"null")


def chat(g: int, e: int, **extra) -> dict:
    return {"model": VLLM_MODEL_NAME, "max_tokens": MAX_TOKENS, "seed": 100 * g + e,
            "messages": [{"role": "user", "content": f"Task {g}: name a colour."}], **extra}


@pytest.fixture(scope="module")
def captured(stock_vllm, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("stock")
    answers = {}
    with capture_proxy(stock_vllm.url, work / "logs", control_secret=None, log=work / "mitmdump.log") as px:
        for g in range(GROUPS):
            for e in range(GROUP_SIZE):
                ep = f"g{g}-e{e}"
                answers[ep] = post(px.url, "/v1/chat/completions", chat(g, e), {"x-polar-episode": ep})
                post(px.url, f"/polar/{ep}/end", {"reward": float(e), "metadata": {"group_id": f"g{g}"}})
        state = post_get(px.url + "/polar/@weights")
    rep = build(work / "logs", work / "shards", Options(group_size=GROUP_SIZE))
    assert len(rep.built) == GROUPS * GROUP_SIZE and not rep.errors, rep
    rows = [r for ep in answers for r in read_log(work / "logs" / f"{ep}.arrow").iter_rows(named=True)
            if r["kind"] == "call"]
    return SimpleNamespace(url=stock_vllm.url, work=work, answers=answers, rows=rows, state=state,
                           shards=work / "shards", model=tiny_model)


def post_get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_every_row_records_what_the_stock_server_applied(captured):
    src = f"discovered: vllm GET /v1/models root -> {Path(captured.model) / 'generation_config.json'}"
    assert len(captured.rows) == GROUPS * GROUP_SIZE
    for r in captured.rows:
        assert r["error"] is None, r["error"]
        assert {k: r[k] for k in QWEN3} == QWEN3, r
        assert r["sampling_source"] == src and r["sampling_unsupported"] is None
        assert r["logprobs_mode"] == "raw"  # vLLM's default (the probe)
    shard_rows = pq.read_table(captured.shards).to_pylist()
    assert len(shard_rows) == GROUPS * GROUP_SIZE
    assert all({k: s[k] for k in (*QWEN3, "sampling_source")} == {**QWEN3, "sampling_source": src}
               for s in shard_rows), shard_rows[0]
    # what the proxy recorded is what vLLM applied: the same request with the values spelled out,
    # straight to vLLM, gives the same answer (same seed)
    for ep, got in list(captured.answers.items())[:2]:
        g, e = int(ep[1]), int(ep[4])
        direct = post(captured.url, "/v1/chat/completions", chat(g, e, **QWEN3))
        assert got["choices"][0]["message"] == direct["choices"][0]["message"], (got, direct)


def test_every_row_names_a_weight_version_from_the_first_call(captured):
    """Stock vLLM names none (its /weight_info is a dev route): the proxy names it, the same name on
    every row, the one the trainer reads at its start (GET /polar/@weights), never null."""
    versions = {r["weight_version"] for r in captured.rows}
    assert len(versions) == 1 and is_proxy_version(v := versions.pop()) and v.endswith("-0"), versions
    assert captured.state["server_kind"] is None and captured.state["weight_version"] == v
    assert {s["weight_version"] for s in pq.read_table(captured.shards).to_pylist()} == {v}


def test_grpo_steps_run_on_the_shards(captured, tmp_path):
    """Real TRL GRPO steps on the shards (temperature 0.6, checked against every row's recorded
    temperature; raw logprobs: without the IS correction). Nothing excluded, two optimizer steps."""
    t = trainer(captured.model, config(tmp_path, shards=str(captured.shards), temperature=0.6, max_steps=2,
                                       per_device_train_batch_size=4, num_generations=GROUP_SIZE,
                                       vllm_importance_sampling_correction=False, max_excluded_share=0.0,
                                       excluded_share_window=1))
    t.train()
    assert t.state.global_step == 2
    assert sum(t.shard_rollout.stats.rows_excluded.values()) == 0, t.shard_rollout.stats.rows_excluded
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), t.state.log_history
    assert t.shard_rollout.stats.groups == 4


def test_with_the_correction_raw_logprobs_stop_with_the_cause_and_the_fix(captured, tmp_path):
    t = trainer(captured.model, config(tmp_path, shards=str(captured.shards), temperature=0.6, max_steps=1,
                                       per_device_train_batch_size=4, num_generations=GROUP_SIZE,
                                       excluded_share_window=10))
    with pytest.raises(ExcludedShareError, match=r"logprobs_raw: .*--logprobs-mode processed_logprobs"):
        t.train()
    # (the sampling itself was known: raw logprobs are the only reason)
    assert set(t.shard_rollout.stats.rows_excluded) == {"logprobs_raw"}


# -- completions with echo ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def echo_proxy(stock_vllm, tmp_path_factory):
    work = tmp_path_factory.mktemp("stock-echo")
    with capture_proxy(stock_vllm.url, work / "logs", control_secret=None, log=work / "mitmdump.log",
                       sets={"polar_dialect": "vllm"}) as px:
        yield SimpleNamespace(url=px.url, vllm=stock_vllm.url, logdir=work / "logs")


def _through_both(p, body: dict, stream: bool, episode: str) -> tuple[bytes, bytes, str]:
    for _ in range(5):  # a new pair while the two streams differ only in where vLLM cut the chunks
        st_d, direct = post_raw(p.vllm + "/v1/completions", {**body, "stream": stream})
        st_p, proxied = post_raw(p.url + "/v1/completions", {**body, "stream": stream}, episode=f"{episode}")
        assert st_d == st_p == 200, (direct, proxied)
        if not differs_only_in_chunking(proxied, direct):
            break
        episode += "x"
    return proxied, direct, episode


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_with_the_harness_logprobs_keeps_the_completions_share(echo_proxy, stream):
    """vLLM's echo logprobs cover prompt + completion (the first prompt token's is null): the row
    holds exactly the completion's, equal to what vLLM gives the same generation without echo."""
    body = {"model": VLLM_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 1}
    proxied, direct, ep = _through_both(echo_proxy, body, stream, f"echo-lp-{int(stream)}")
    assert_same_answer(proxied, direct)
    (r,) = [x for x in read_log(echo_proxy.logdir / f"{ep}.arrow").iter_rows(named=True) if x["kind"] == "call"]
    truth = post(echo_proxy.vllm, "/v1/completions", {**{k: v for k, v in body.items() if k != "echo"},
                                                       "logprobs": 0, "return_token_ids": True})["choices"][0]
    assert r["error"] is None, r["error"]
    assert r["prompt_ids"] == truth["prompt_token_ids"] and r["completion_ids"] == truth["token_ids"]
    assert r["completion_logprobs"] == pytest.approx(truth["logprobs"]["token_logprobs"], abs=1e-5)
    assert len(r["prompt_ids"]) > 1  # (so the prompt's logprobs were really there to split off)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_without_logprobs_is_an_error_row_saying_why(echo_proxy, stream):
    body = {"model": VLLM_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True}
    proxied, direct, ep = _through_both(echo_proxy, body, stream, f"echo-{int(stream)}")
    assert_same_answer(proxied, direct)  # the harness gets vLLM's answer, echoed prompt and all
    (r,) = [x for x in read_log(echo_proxy.logdir / f"{ep}.arrow").iter_rows(named=True) if x["kind"] == "call"]
    assert r["error"].startswith("no logprobs: completions with echo") and '"logprobs": 0' in r["error"]
    assert r["completion_ids"] is None and r["completion_logprobs"] is None
