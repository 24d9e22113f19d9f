"""Runs generation jobs one at a time on a worker thread and streams their tokens to asyncio.

The aiohttp loop never touches torch: each request becomes a job on a single worker thread (so two
requests never share a KV cache or interleave), and every produced token is handed back to the
loop through `call_soon_threadsafe`, so streams flush token by token while the loop stays free.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .model import SamplingParams, ServedModel, TokenStep


@dataclass
class Event:
    """One produced token (with the text it completes) or the end of the generation ("done",
    which carries the last token, if any, in `step`/`text`)."""
    kind: str                       # "token" | "done" | "error"
    step: TokenStep | None = None
    text: str = ""                  # detokenized text this token adds (may be "")
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: BaseException | None = None


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    forced_ids: list[int] | None = None   # scripted mode: teacher-force these instead of sampling
    delay: float = 0.0
    include_stop_str: bool = False
    cancelled: bool = False               # set when the client went away: stop generating


class Detok:
    """vLLM-style incremental detokenizer: emits text only once it is complete UTF-8."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok, self.skip = tokenizer, skip_special
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def add(self, tid: int) -> str:
        self.ids.append(tid)
        prev = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        new = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(new) > len(prev) and not new.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(prev):]
        return ""


class Engine:
    def __init__(self, model: ServedModel):
        self.model = model
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polar-serve-model")

    def run_sync(self, fn, *args):
        """Run `fn(model, *args)` on the worker thread; await its result."""
        return asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(self.model, *args))

    def stream(self, job: Job) -> asyncio.Queue:
        """Start `job`; its Events arrive on the returned queue, the last one of kind done/error."""
        return self.stream_many([job])[0]

    def stream_many(self, jobs: list[Job]) -> list[asyncio.Queue]:
        """Start `jobs` together (the n choices of one request): the worker produces their tokens in
        lockstep, one token of each running job in turn, as vLLM's engine steps its n sequences."""
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in jobs]

        def putter(q: asyncio.Queue):
            def put(ev: Event, at: float = 0.0) -> None:
                # Scripted delays are timers on the loop, not sleeps on the worker, so a slow
                # simulated reply never holds up other requests.
                if at > 0:
                    loop.call_soon_threadsafe(loop.call_later, at, q.put_nowait, ev)
                else:
                    loop.call_soon_threadsafe(q.put_nowait, ev)
            return put

        def work() -> None:
            running = [(self._generate(job, putter(q), private=len(jobs) > 1), putter(q))
                       for job, q in zip(jobs, queues, strict=True)]
            while running:
                for gen, put in list(running):
                    try:
                        next(gen)
                    except StopIteration:
                        running.remove((gen, put))
                    except BaseException as e:  # reported to the request, never kills the worker
                        running.remove((gen, put))
                        put(Event("error", error=e))

        self.pool.submit(work)
        return queues

    def _generate(self, job: Job, put_event, private: bool = False):
        """Runs the job, one token per step of this generator; the last token travels inside the
        "done" Event, like vLLM's final output carries its last token together with the finish reason."""
        held: list[tuple[Event, float]] = []

        def put(ev: Event, at: float = 0.0) -> None:
            if ev.kind == "token":
                if held:
                    put_event(*held.pop())
                held.append((ev, at))
                return
            if held:
                last, at = held.pop()
                ev.step, ev.text = last.step, last.text
            put_event(ev, at)

        yield from self._run(job, put, private)

    def _run(self, job: Job, put, private: bool = False):
        m = self.model
        detok = Detok(m.tokenizer)
        text = ""
        if job.forced_ids is not None:
            steps = m.teacher_force(job.prompt_ids, job.forced_ids, job.params)
            per_tok = job.delay / max(len(steps), 1)
            for i, st in enumerate(steps):
                put(Event("token", st, detok.add(st.token_id)), per_tok * (i + 1))
                yield
            last = steps[-1].token_id if steps else None
            if last is not None and last in m.eos_ids:
                put(Event("done", finish_reason="stop", stop_reason=_eos_reason(m, last)), job.delay)
            else:
                put(Event("done", finish_reason="length"), job.delay)
            return
        stops = [s for s in job.stop if s]
        finish, reason = "length", None
        for st in m.generate(job.prompt_ids, job.params, private):
            if job.cancelled:
                finish = "abort"
                break
            piece = detok.add(st.token_id)
            if st.token_id in m.eos_ids and not job.params.ignore_eos:
                put(Event("token", st, piece))
                finish, reason = "stop", _eos_reason(m, st.token_id)
                break
            if st.token_id in job.params.stop_token_ids:
                put(Event("token", st, piece))
                finish, reason = "stop", st.token_id
                break
            hit = _find_stop(text, piece, stops)
            if hit is not None:
                s, pos = hit
                keep = (text + piece)[:pos + (len(s) if job.include_stop_str else 0)]
                put(Event("token", st, keep[len(text):] if len(keep) > len(text) else ""))
                finish, reason = "stop", s
                break
            text += piece
            put(Event("token", st, piece))
            yield
        put(Event("done", finish_reason=finish, stop_reason=reason))


def _eos_reason(m, tid: int) -> int | None:
    """vLLM's stop_reason for an end-of-sequence token: None for the tokenizer's own EOS; the id for
    the other EOS ids of generation_config.json (vLLM adds those as stop_token_ids)."""
    return None if tid == m.tokenizer.eos_token_id else tid


def _find_stop(text: str, piece: str, stops: list[str]):
    if not stops or not piece:
        return None
    full = text + piece
    best = None
    for s in stops:
        # Only matches that end in the new piece: earlier text was already checked.
        pos = full.find(s, max(0, len(text) - len(s) + 1))
        if pos != -1 and (best is None or pos < best[1]):
            best = (s, pos)
    return best
