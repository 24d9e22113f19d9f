"""Linking and the token strategy on logs rendered with the real Qwen3 chat template."""
import json

import numpy as np
import pytest

from polar_contracts.log.arrays import read_calls
from polar_contracts.log.writer import EpisodeWriter
from polar_contracts.prefix import common_prefix
from polar_recon.link import AUX, CLEAN, ERROR, FORK, REALIGN, RETRY, link_calls, segments
from polar_recon.strategies import per_call_sequences, token_sequences
from polar_recon.tokens import TurnMarkers

from . import logs as L

M = TurnMarkers.load(str(L.TOKENIZER_DIR))


def kinds_of(path, exclude_retries=False):
    ep = read_calls(path)
    nodes = link_calls(ep.calls, M, exclude_retries=exclude_retries)
    chains = segments(nodes)
    return ep, nodes, chains


def assert_faithful(ep, nodes, seqs, recorded):
    """Every trainable token is a sampled id with its own logprob; every kept call trains once."""
    by_index = {r.call_index: r for r in recorded}
    trained = []
    for s in seqs:
        ids, mask, lps = s.input_ids, s.loss_mask.astype(bool), s.logprobs
        assert len(ids) == len(mask) == len(lps)
        comp = np.concatenate([np.asarray(by_index[c].completion_ids, np.int32) for c in s.calls])
        lp = np.concatenate([np.asarray(by_index[c].logprobs, np.float32) for c in s.calls])
        assert np.array_equal(ids[mask], comp)
        assert np.array_equal(lps[mask], lp)
        assert not lps[~mask].any()
        first = by_index[s.calls[0]]
        assert np.array_equal(ids[: s.prompt_len], first.prompt_ids)  # the first prompt, as the model saw it
        # the context before each later completion: a tail of that call's prompt starting right after a
        # turn's <|im_end|>, with as many turns before it as the model saw
        starts = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8)])) == 1)
        ends = np.flatnonzero(np.diff(np.concatenate([mask.astype(np.int8), [0]])) == -1) + 1
        assert len(starts) == len(s.calls)
        for k in range(1, len(s.calls)):
            prompt = np.asarray(by_index[s.calls[k]].prompt_ids)
            ctx = ids[ends[k - 1]:starts[k]]
            assert 0 < len(ctx) <= len(prompt) and np.array_equal(prompt[len(prompt) - len(ctx):], ctx)
            assert prompt[len(prompt) - len(ctx) - 1] == M.end
            assert np.count_nonzero(ids[:starts[k]] == M.start) == np.count_nonzero(prompt == M.start)
        trained += s.calls
    assert sorted(trained) == sorted(r.call_index for r in recorded if r.kept)


def divergence_text(ep, k):
    """Decoded tokens around where call k's prompt leaves call k-1's prompt+completion."""
    tok = L.tokenizer()
    prev = np.concatenate([ep.calls[k - 1].prompt, ep.calls[k - 1].completion])
    n = common_prefix(prev, ep.calls[k].prompt)
    return n - len(ep.calls[k - 1].prompt), tok.decode(prev[n:n + 6].tolist()), tok.decode(ep.calls[k].prompt[n:n + 6].tolist())


def test_clean_chain(tmp_path):
    conv = L.episode(tmp_path, "e", lambda c: L.two_tool_turns(c, reasoning=("Write it.", "Check it.")), harness="tidy")
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, CLEAN, CLEAN]
    assert chains == [[0, 1, 2]]
    seqs = token_sequences(ep, M)
    assert len(seqs) == 1 and seqs[0].n_realign == 0 and seqs[0].n_calls == 3
    # CLEAN: the sequence is exactly the last prompt + last completion
    last = conv.recorded[-1]
    assert seqs[0].input_ids.tolist() == last.prompt_ids + last.completion_ids
    assert_faithful(ep, nodes, seqs, conv.recorded)


def test_whitespace_content_resent_realigns(tmp_path):
    # case 1 of docs/reference.md "What harnesses send back": content "\n\n" resent; the template renders \n\n\n<tool_call>
    conv = L.episode(tmp_path, "e", lambda c: L.two_tool_turns(c, reasoning=("Write it.", "Check it.")), harness="strict")
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, REALIGN, REALIGN]
    off, sampled, rerendered = divergence_text(ep, 1)
    assert off > 0 and sampled.startswith("\n\n<tool_call>") and rerendered.startswith("\n\n\n<tool_call>")
    seqs = token_sequences(ep, M)
    assert len(seqs) == 1 and seqs[0].n_realign == 2
    assert_faithful(ep, nodes, seqs, conv.recorded)


def test_text_before_tool_call_realigns(tmp_path):
    # case 2: `.\n<tool_call>` sampled, the parser leaves `\n` in the content, the template adds one
    conv = L.episode(tmp_path, "e", lambda c: L.two_tool_turns(
        c, reasoning=("Write it.", "Check it."), content=("I will write the file.", "Now check.")), harness="tidy")
    ep, nodes, _ = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, REALIGN, REALIGN]
    tok = L.tokenizer()
    s = tok.decode(ep.calls[1].prompt.tolist())
    assert "I will write the file.\n\n<tool_call>" in s
    assert "I will write the file.\n<tool_call>" in tok.decode(ep.calls[0].completion.tolist())
    assert_faithful(ep, nodes, token_sequences(ep, M), conv.recorded)


def test_thinking_dropped_realigns(tmp_path):
    # case 3: Pi drops whitespace-only reasoning; `<think>\n\n</think>\n\n` sampled, nothing re-rendered
    def run(c):
        c.call(L.Sample("", "Hello! How can I help?", []))
        c.user("Now create hello.txt")
        c.call(L.Sample("", "", [L.write_tool()]), results=["ok"])
        c.call(L.Sample("", "Done.", []))
    conv = L.episode(tmp_path, "e", run, harness="pi")
    ep, nodes, _ = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, REALIGN, REALIGN]
    off, sampled, rerendered = divergence_text(ep, 1)
    assert "<think>" in sampled and "<think>" not in rerendered
    assert_faithful(ep, nodes, token_sequences(ep, M), conv.recorded)


def test_bpe_merge_into_previous_prompt(tmp_path):
    # case 4 of docs/reference.md "What harnesses send back" (the trap): Qwen Code drops empty
    # reasoning and resends content "\n\n":
    # `<|im_start|>assistant\n` + `\n\n\n` merge, so the divergence is INSIDE the previous prompt
    conv = L.episode(tmp_path, "e", lambda c: L.two_tool_turns(c, reasoning=("", "")), harness="qwen-code")
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    prev = ep.calls[0].prompt
    n = common_prefix(np.concatenate([prev, ep.calls[0].completion]), ep.calls[1].prompt)
    assert n == len(prev) - 1  # the generation prompt's last token `\n` was merged away
    assert prev[-3] == M.start and ep.calls[1].prompt[n] != prev[-1]
    assert [n.kind for n in nodes] == [FORK, REALIGN, REALIGN] and chains == [[0, 1, 2]]
    seqs = token_sequences(ep, M)
    assert len(seqs) == 1
    assert_faithful(ep, nodes, seqs, conv.recorded)


def test_noncanonical_tool_arguments_realign(tmp_path):
    # the model emitted compact JSON; the server parses it and the template's tojson re-serializes it
    conv = L.episode(tmp_path, "e", lambda c: L.two_tool_turns(c, reasoning=("Write it.", "Check it."), compact_args=True),
                     harness="tidy")
    ep, nodes, _ = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, REALIGN, CLEAN]
    assert '{"path":"hello.txt"' in L.tokenizer().decode(ep.calls[0].completion.tolist())
    assert '{"path": "hello.txt"' in L.tokenizer().decode(ep.calls[1].prompt.tolist())
    assert_faithful(ep, nodes, token_sequences(ep, M), conv.recorded)


def test_new_user_turn_strips_all_earlier_thinking(tmp_path):
    # a new user query: the template drops the think blocks of EVERY earlier turn: one link, 3 turns realigned
    def run(c):
        L.two_tool_turns(c, reasoning=("Write it.", "Check it."))
        c.user("Thanks. Now delete it.")
        c.call(L.Sample("Delete.", "", [("run_shell", json.dumps({"command": "rm hello.txt"}))]), results=[""])
    conv = L.episode(tmp_path, "e", run, harness="tidy")
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, CLEAN, CLEAN, REALIGN]
    assert nodes[3].realigned == 3 and chains == [[0, 1, 2, 3]]
    assert_faithful(ep, nodes, token_sequences(ep, M), conv.recorded)


def test_compaction_forks(tmp_path):
    def run(c):
        L.two_tool_turns(c, reasoning=("Write it.", "Check it."))
        c.compact("hello.txt was created and contains hi.")
        c.call(L.Sample("Verify.", "", [("run_shell", json.dumps({"command": "ls"}))]), results=["hello.txt"])
        c.call(L.Sample("Done.", "All good.", []))
    conv = L.episode(tmp_path, "e", run, harness="tidy")
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, CLEAN, CLEAN, FORK, CLEAN]
    assert chains == [[0, 1, 2], [3, 4]]
    seqs = token_sequences(ep, M)
    assert [s.segment for s in seqs] == [0, 1]
    assert_faithful(ep, nodes, seqs, conv.recorded)


def test_subagent_interleaved_forks_and_main_continues(tmp_path):
    w = EpisodeWriter(tmp_path / "e.arrow", "e")
    main = L.Conversation(w, harness="tidy")
    sub = L.Conversation(w, harness="tidy", system="You are a sub-agent that reads files.", task="read hello.txt", seed=1)
    main.call(L.Sample("Delegate reading.", "", [L.write_tool()]), results=["ok"])
    sub.call(L.Sample("Read it.", "", [("run_shell", json.dumps({"command": "cat hello.txt"}))]), results=["hi"])
    main.call(L.Sample("Wait for the sub-agent.", "", [("run_shell", json.dumps({"command": "true"}))]), results=[""])
    sub.call(L.Sample("", "It contains hi.", []))
    main.call(L.Sample("Done.", "Finished.", []))
    w.end(1.0)
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, FORK, CLEAN, CLEAN, CLEAN]
    assert chains == [[0, 2, 4], [1, 3]]
    assert_faithful(ep, nodes, token_sequences(ep, M), main.recorded + sub.recorded)


def test_retry_keeps_the_extended_branch(tmp_path):
    def run(c):
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        first = c.call(L.Sample("Hmm.", "", [("run_shell", json.dumps({"command": "cat hello.txt"}))]), keep=False)
        first.kept = False  # the harness timed out and retried the same request
        c.call(L.Sample("Check it.", "", [("run_shell", json.dumps({"command": "ls"}))]), results=["hello.txt"])
        c.call(L.Sample("Done.", "Done.", []))
    conv = L.episode(tmp_path, "e", run, harness="tidy")
    # by default the rejected sample trains too, in its own segment (every sample accounted for: no sample dropped)
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, FORK, CLEAN, CLEAN] and chains == [[0, 2, 3], [1]]
    seqs = token_sequences(ep, M)
    assert sorted(c for s in seqs for c in s.calls) == [0, 1, 2, 3]
    # excluding rejected retries: counted, not trained
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow", exclude_retries=True)
    assert [n.kind for n in nodes] == [FORK, RETRY, CLEAN, CLEAN]
    assert np.array_equal(ep.calls[1].prompt, ep.calls[2].prompt)
    assert chains == [[0, 2, 3]]
    excluded = []
    assert_faithful(ep, nodes, token_sequences(ep, M, nodes, excluded=excluded), conv.recorded)
    assert excluded == [(ep.calls[1].row, "rejected retry")]


def test_retry_where_the_first_answer_is_used(tmp_path):
    # a duplicate request whose answer the harness ignores: the FIRST sibling is the extended one
    def run(c):
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        msgs = [dict(m) for m in c.messages]
        c.call(L.Sample("Check.", "", [("run_shell", json.dumps({"command": "ls"}))]), results=["hello.txt"])
        after = c.messages
        c.messages = msgs
        dup = c.call(L.Sample("Other.", "", [("run_shell", json.dumps({"command": "pwd"}))]), keep=False)
        dup.kept = False
        c.messages = after
        c.call(L.Sample("Done.", "Done.", []))
    conv = L.episode(tmp_path, "e", run, harness="tidy")
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow", exclude_retries=True)
    assert [n.kind for n in nodes] == [FORK, CLEAN, RETRY, CLEAN]
    assert chains == [[0, 1, 3]]
    assert_faithful(ep, nodes, token_sequences(ep, M, nodes), conv.recorded)


def test_auxiliary_and_cut_off_calls_are_left_out(tmp_path):
    def run(c):
        L.auxiliary_call(c.w)
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        c.cut_off()
        c.call(L.Sample("Check it.", "", [("run_shell", json.dumps({"command": "ls"}))]), results=["hello.txt"])
    conv = L.episode(tmp_path, "e", run, harness="tidy")
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [AUX, FORK, ERROR, CLEAN]
    assert chains == [[1, 3]]
    assert_faithful(ep, nodes, token_sequences(ep, M), conv.recorded)


def test_per_call_strategy(tmp_path):
    conv = L.episode(tmp_path, "e", lambda c: L.two_tool_turns(c, reasoning=("", "")), harness="qwen-code")
    ep = read_calls(tmp_path / "e.arrow")
    seqs = per_call_sequences(ep)
    assert len(seqs) == 3
    for s, r in zip(seqs, conv.recorded):
        assert s.input_ids.tolist() == r.prompt_ids + r.completion_ids
        assert s.prompt_len == len(r.prompt_ids) and s.loss_mask.sum() == len(r.completion_ids)


def test_fast_reader_agrees_with_read_episode(tmp_path):
    from polar_contracts.log.reader import read_episode

    L.episode(tmp_path, "e", lambda c: L.two_tool_turns(c, reasoning=("", "")), harness="qwen-code")
    a, b = read_calls(tmp_path / "e.arrow"), read_episode(tmp_path / "e.arrow")
    assert [c.prompt.tolist() for c in a.calls] == b.calls["prompt_ids"].to_list()
    assert [c.completion.tolist() for c in a.calls] == b.calls["completion_ids"].to_list()
    assert (a.finished, a.reward, a.metadata) == (b.finished, b.reward, b.metadata)


def test_markers_come_from_the_tokenizer():
    tok = L.tokenizer()
    assert M.start == tok.convert_tokens_to_ids("<|im_start|>") and M.end == tok.convert_tokens_to_ids("<|im_end|>")
    assert L.encode("<|im_start|>assistant\n")[:2] == [M.start, *M.assistant]


@pytest.mark.parametrize("cut", [5, 6, 7])
def test_length_cut_completion_keeps_the_turn_end_as_context(tmp_path, cut):
    """finish_reason=length: the model never sampled <|im_end|>; the template closes the turn when
    the harness resends the text. The sequence must still hold that <|im_end|>, as context."""
    w = EpisodeWriter(tmp_path / "e.arrow", "e")
    conv = L.Conversation(w, harness="strict", thinking=False, tools=None)
    prompt = L.encode(L.render(conv.messages, None, False))
    comp = L.encode("Sure: the file hello.txt will contain exactly the two letters")[:cut]
    w.append_call(call_index=w.next_call_index(), prompt_ids=prompt, completion_ids=comp,
                  completion_logprobs=[-0.5] * len(comp), api="chat", finish_reason="length")
    conv.messages.append({"role": "assistant", "content": L.tokenizer().decode(comp)})
    conv.user("Go on.")
    conv.call(L.Sample("", "Done.", []))
    w.end(1.0)
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert nodes[1].kind == REALIGN and chains == [[0, 1]]  # the empty think block of the prompt is gone
    seq = token_sequences(ep, M)[0]
    assert seq.input_ids[len(prompt):len(prompt) + len(comp)].tolist() == comp
    assert seq.input_ids[len(prompt) + len(comp)] == M.end and seq.loss_mask[len(prompt) + len(comp)] == 0
    second = ep.calls[1]
    n_ctx = len(seq.input_ids) - len(second.completion) - len(prompt) - len(comp)
    assert seq.input_ids[-len(second.completion) - n_ctx:-len(second.completion)].tolist() == second.prompt[-n_ctx:].tolist()


def _user_turn_after_mixed_thinking(c):
    # the property test's falsifying example: three tool turns (only the middle one with reasoning),
    # a plain answer, a new user query (the template now drops EVERY earlier think block), an answer
    for reasoning in ("", "Think.", ""):
        c.call(L.Sample(reasoning, "", [("write_file", json.dumps({"path": "a.txt", "content": "hi"}))]), results=["ok"])
    c.call(L.Sample("", "Sure.", []))
    c.user("Next, please.")
    c.call(L.Sample("", "Let me check.", []))


def test_user_turn_links_to_the_latest_call_not_an_earlier_tie(tmp_path):
    # calls 2 and 3 both align with call 4's prompt and diverge at the same first think block
    # (call 1's); call 2's realigned turn shares a longer tool-call tail, which used to win the
    # tie-break, made call 3 a branch, and trained call 3 in two sequences
    conv = L.episode(tmp_path, "e", _user_turn_after_mixed_thinking, harness="pi", thinking=True)
    ep, nodes, chains = kinds_of(tmp_path / "e.arrow")
    assert [n.parent for n in nodes] == [None, 0, 1, 2, 3]
    assert nodes[4].kind == REALIGN and nodes[4].realigned == 2  # call 1's turn and call 3's turn
    assert chains == [[0, 1, 2, 3, 4]]
    seqs = token_sequences(ep, M, nodes)
    assert len(seqs) == 1 and seqs[0].calls == [0, 1, 2, 3, 4]
    assert_faithful(ep, nodes, seqs, conv.recorded)


def test_segments_is_idempotent_with_a_detached_branch(tmp_path):
    # a call whose parent continues in a later branch is detached as a FORK; segments() runs once
    # per consumer (inspect, html, drift: token then retokenize), and each run must give the same
    # chains: the branch used to come back both as a root and as a branch again
    def run(c):
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        msgs = [dict(m) for m in c.messages]
        c.call(L.Sample("Side.", "Side answer.", []))  # extended by nobody but a different prompt than below
        c.messages = msgs
        c.user("Actually, check it first.")
        c.call(L.Sample("Check.", "", [("run_shell", json.dumps({"command": "ls"}))]), results=["hello.txt"])
        c.call(L.Sample("Done.", "Done.", []))
    conv = L.episode(tmp_path, "e", run, harness="tidy")
    ep = read_calls(tmp_path / "e.arrow")
    nodes = link_calls(ep.calls, M)
    assert nodes[1].parent == 0 and nodes[2].parent == 0  # two children of call 0: a branch point
    first = segments(nodes)
    assert first == [[0, 2, 3], [1]] and nodes[1].kind == FORK
    assert segments(nodes) == first and segments(nodes) == first
    seqs = token_sequences(ep, M, nodes)
    assert [s.calls for s in seqs] == [[0, 2, 3], [1]]
    assert_faithful(ep, nodes, seqs, conv.recorded)


def test_a_call_in_two_segments_is_an_error_not_a_shard(tmp_path):
    from polar_recon.strategies import ReconError

    L.episode(tmp_path, "e", lambda c: L.two_tool_turns(c, reasoning=("Write it.", "Check it.")), harness="tidy")
    ep = read_calls(tmp_path / "e.arrow")
    nodes = link_calls(ep.calls, M)
    nodes[2].parent, nodes[2].kind = None, FORK  # a corrupted tree: call 2 is a root AND call 1's child
    with pytest.raises(ReconError, match="call 2 falls in segments 0 and 1; its completion would train twice"):
        token_sequences(ep, M, nodes)


@pytest.mark.parametrize("decoder", ["table", "rust"])
def test_a_sampled_id_past_the_tokenizer_forks(tmp_path, monkeypatch, decoder):
    """Qwen3's embedding has 151936 rows for 151669 tokens; a drifting policy samples the padding rows
    (seen in the closed loop's shifted-mask arm: id 151838). The server's text has nothing for such an
    id, so the next prompt lacks it: the context differs from the sampled turn by a token no re-render
    class explains. That is a FORK (each call trains on what it was served), never a crash of the
    reconstruction and never a REALIGN that "sees the same text"."""
    import polar_recon.link as link
    import polar_recon.tokens as tokens
    from polar_recon import testing

    pad = 151838
    real, done = testing.encode, []

    def encode(text):
        ids = real(text)
        if text.endswith("<|im_end|>") and not done:  # the first sampled completion only
            done.append(1)
            return ids[:-1] + [pad] + ids[-1:]
        return ids
    monkeypatch.setattr(testing, "encode", encode)
    m = M
    if decoder == "rust":  # the path for tokenizers that are not byte-level BPE
        from tokenizers import Tokenizer
        rust = tokens._RustDecoder(Tokenizer.from_file(str(L.TOKENIZER_DIR / "tokenizer.json")))
        monkeypatch.setattr(tokens, "_decoder", lambda _dir: rust)
        link._turn_classes.cache_clear()
        with pytest.raises(ValueError, match="not in the tokenizer's vocabulary: \\[151838\\]"):
            rust.decode([pad])

    def run(c):
        c.call(L.Sample("", "Hello! How can I help?", []))
        c.user("Now create hello.txt")
        c.call(L.Sample("", "Done.", []))
    conv = L.episode(tmp_path, "e", run, harness="strict")
    ep = read_calls(tmp_path / "e.arrow")
    assert pad in ep.calls[0].completion.tolist() and pad not in ep.calls[1].prompt.tolist()
    nodes = link_calls(ep.calls, m)
    assert [n.kind for n in nodes] == [FORK, FORK]
    seqs = token_sequences(ep, m)
    assert len(seqs) == 2
    assert_faithful(ep, nodes, seqs, conv.recorded)
    link._turn_classes.cache_clear()
