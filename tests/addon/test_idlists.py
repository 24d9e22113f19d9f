"""idlists.PromptCache: the same parsed answer as orjson, whatever the previous list was."""
from __future__ import annotations

import json
import random
from array import array

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from addon.idlists import PromptCache, parse_ids


def vllm_answer(prompt: list[int], spaced: bool = False) -> bytes:
    obj = {"id": "c", "choices": [{"index": 0, "message": {"content": 'say "prompt_token_ids":[1,2]'},
                                   "token_ids": [5, 6]}], "prompt_token_ids": prompt}
    return json.dumps(obj).encode() if spaced else orjson.dumps(obj)


def plain(obj):
    if isinstance(obj, array):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


def test_growing_prompts_reuse_and_match_orjson():
    rng = random.Random(0)
    cache = PromptCache()
    prompt = [rng.randrange(151000) for _ in range(3000)]
    for _turn in range(12):
        for spaced in (False, True):
            raw = vllm_answer(prompt, spaced)
            got = cache.loads("e", raw)
            assert isinstance(got["prompt_token_ids"], array)
            assert plain(got) == orjson.loads(raw)
        prompt = prompt + [rng.randrange(151000) for _ in range(rng.randrange(1, 500))]
    assert cache.hits > 0


@pytest.mark.parametrize("prev,new", [
    ([12] * 2000, [123] * 2000),  # a number that is a prefix of another
    ([7] * 3000, [7] * 1500),  # a shorter list
    ([1, 2, 3] * 1000, [9] + [1, 2, 3] * 1000),  # differs at once
    ([5] * 2000, [5] * 2000 + [55]),
])
def test_edge_cases_match_orjson(prev, new):
    cache = PromptCache()
    for ids in (prev, new, prev):
        raw = vllm_answer(ids)
        assert plain(cache.loads("e", raw)) == orjson.loads(raw)


def test_sglang_choice_level_and_fallbacks():
    cache = PromptCache()
    ids = list(range(5000))
    sg = orjson.dumps({"choices": [{"index": 0, "prompt_token_ids": ids, "response_token_ids": [1]}]})
    got = cache.loads("s", sg)
    assert isinstance(got["choices"][0]["prompt_token_ids"], array) and plain(got) == orjson.loads(sg)
    # the key twice (n=2), nested elsewhere, small lists, not ints: parsed whole, same result
    two = orjson.dumps({"choices": [{"prompt_token_ids": ids}, {"prompt_token_ids": ids}]})
    nested = orjson.dumps({"x": {"prompt_token_ids": ids}})
    floats = orjson.dumps({"prompt_token_ids": [0.5] * 3000})
    small = orjson.dumps({"prompt_token_ids": [1, 2]})
    for raw in (two, nested, floats, small):
        got = cache.loads("s", raw)
        assert got == orjson.loads(raw) and not any(isinstance(v, array) for v in got.values())
    with pytest.raises(orjson.JSONDecodeError):
        cache.loads("s", b'{"prompt_token_ids":[' + b"1," * 3000 + b"2]")  # truncated answer


def test_bounded():
    cache = PromptCache(max_episodes=2)
    for e in "abc":
        cache.loads(e, vllm_answer(list(range(3000))))
    assert list(cache._last) == ["b", "c"]


@pytest.mark.parametrize("api,dialect", [("chat", "vllm"), ("chat", "sglang"), ("completions", "vllm"),
                                         ("completions", "sglang")])
def test_finish_body_with_cache_logs_the_same_ids(api, dialect):
    """Through call.finish_body: the row's prompt ids and the harness's bytes are the same with
    and without the cache, twice in a row (the second call reuses the first list)."""
    from addon import call as calls
    from addon.server_dialects import plan_request

    prompt = list(range(100000, 103000))
    ch = {"index": 0, "logprobs": None, "finish_reason": "stop"}
    if api == "chat":
        ch["message"] = {"role": "assistant", "content": "hi"}
    else:
        ch["text"] = "hi"
    if dialect == "vllm" and api == "chat":
        body = {"id": "x", "choices": [dict(ch, token_ids=[7])], "prompt_token_ids": prompt}
    elif dialect == "sglang" and api == "chat":
        body = {"id": "x", "choices": [dict(ch, prompt_token_ids=prompt, response_token_ids=[7])]}
    else:
        body = {"id": "x", "choices": [dict(ch, prompt_token_ids=prompt, token_ids=[7])]}
    raw = orjson.dumps(body)
    cache = PromptCache()
    outs = []
    for use in (None, cache, cache):
        c = calls.CapturedCall("e", 0, api, dialect, 0.0, b"")
        c.plan = plan_request(api, dialect, {})
        c.prompt_cache = use
        out = calls.finish_body(c, 200, raw)
        (row,) = c.cap.rows()
        assert row["prompt_ids"].tolist() == prompt and row["completion_ids"].tolist() == [7]
        outs.append(out)
    assert outs[0] == outs[1] == outs[2] and b"100000" not in outs[0]
    assert cache.hits == len(prompt)


_small = st.lists(st.integers(0, 200), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), _small), min_size=1, max_size=6), st.integers(1200, 1400))
def test_any_sequence_of_lists_matches_orjson(steps, base_len):
    """Each answer keeps a random prefix of the previous list and appends random ids (numbers
    that extend the previous last number, shorter lists, identical lists...)."""
    cache = PromptCache()
    prompt = [i % 97 for i in range(base_len)]
    for keep_tail_cut, extra in steps:
        prompt = prompt[: max(0, len(prompt) - keep_tail_cut)] + extra
        raw = vllm_answer(prompt)
        assert plain(cache.loads("e", raw)) == orjson.loads(raw)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=3000), st.sampled_from([",", ", "]))
def test_parse_ids_big_and_small_tails_match_orjson(ids, sep):
    tail = sep.join(map(str, ids)).encode()
    got = parse_ids(tail)
    assert got is not None and got.tolist() == ids


@pytest.mark.parametrize("tail", [
    ",".join(["7"] * 1500 + [str(2**31)]).encode(),  # past int32 (big tail: the simdjson path)
    ",".join(["7"] * 1500 + [str(2**64)]).encode(),  # past 64 bits
    ",".join(["7"] * 1500).encode() + b",,1",  # not a list
    ",".join(["7"] * 1500).encode() + b",",
    b"1," + str(2**31).encode(),  # small tail: the orjson path
    b"1,,2",
])
def test_parse_ids_refuses_what_is_not_an_int32_list(tail):
    assert parse_ids(tail) is None


def test_sglang_streamed_sglext_input_ids_are_cached_and_match_orjson():
    cache = PromptCache()
    ids = list(range(200000, 204000))
    for _turn in range(3):
        for spaced in (False, True):
            obj = {"id": "c", "choices": [], "sglext": {"input_ids": ids, "output_ids": [[5, 6]]}}
            raw = json.dumps(obj).encode() if spaced else orjson.dumps(obj)
            got = cache.loads("g", raw)
            assert isinstance(got["sglext"]["input_ids"], array)
            assert plain(got) == orjson.loads(raw)
        ids = ids + [7, 8, 9]
    assert cache.hits > 0
    # a message that merely mentions the key (inside a string: its quotes are escaped) is not cut
    raw = orjson.dumps({"choices": [{"delta": {"content": '"input_ids":[' + "1," * 3000}}]})
    assert cache.loads("g", raw) == orjson.loads(raw)


def test_harness_that_asks_for_sglext_input_ids_gets_them_as_json_with_a_warm_cache():
    """A harness that sets return_input_ids_in_sglext keeps sglext.input_ids in its stream: the
    proxy must not turn that list into an array (it re-serializes the chunk without the output
    ids it added), also when the same episode's previous call filled the prompt cache."""
    from addon import call as calls

    ids = list(range(300000, 304000))
    cache = PromptCache()
    for turn in range(2):
        c = calls.CapturedCall("e", turn, "chat", "sglang", 0.0, b"")
        c.prompt_cache = cache
        calls.prepare(c, json.dumps({"messages": [], "stream": True, "return_input_ids_in_sglext": True}).encode(), {})
        t = calls.start_response(c, 200, "text/event-stream")
        chunk = {"id": "c", "choices": [], "sglext": {"input_ids": ids, "output_ids": [[5, 6]]}}
        out = b"".join(t(b"data: " + orjson.dumps(chunk) + b"\n\n"))
        assert out == b"data: " + orjson.dumps({"id": "c", "choices": [], "sglext": {"input_ids": ids}}) + b"\n\n"
        assert not c.cap.notes
