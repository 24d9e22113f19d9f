"""The served causal LM: load from disk, prefill with a prefix-reusing KV cache, sample, teacher-force.

Qwen3 (dense) is run by a small hand-written forward over the checkpoint's own weights instead of
transformers' generic `generate`: the e2e suites replay ~20k-token harness prompts, and the generic
path recomputes masks and concatenates caches on every step. The forward here keeps one
preallocated KV buffer, only ever applies `lm_head` to the positions whose distribution is needed
(never to the whole prompt), and reuses the cached prefix of the previous request, like vLLM's
prefix caching. `tests/serve/test_model.py` checks it against transformers' own forward.

Other architectures fall back to transformers' model with its cache (slower, same results).

Sampling follows vLLM 0.32's transform in its order (temperature, min-p, top-k, top-p; see
process_logits). The reported logprobs are the server's `logprobs_mode`: "processed" (vLLM
`--logprobs-mode processed_logprobs`: log-softmax after that transform; masked tokens -inf,
reported floored at -9999.0), "raw" (vLLM's default raw_logprobs) or "scaled" (SGLang 0.5.23).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from polar_contracts.prefix import common_prefix
from polar_contracts.sampling_fields import GREEDY_EPS, LOGPROBS_MODES

LOGPROB_FLOOR = -9999.0
_PREFILL_CHUNK = 1024
# Extending a cached prefix by more than this many tokens is slower than recomputing from scratch.
_RECOMPUTE_ABOVE = 4096


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0


@dataclass
class TokenStep:
    """One produced token: its id, processed logprob and the top-k alternatives (id, logprob)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


class KVCache:
    """One sequence's keys/values for every layer, grown by doubling; `ids` are the cached tokens."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, cap: int = 1024):
        self.k = [torch.empty(1, n_kv, cap, head_dim) for _ in range(n_layers)]
        self.v = [torch.empty(1, n_kv, cap, head_dim) for _ in range(n_layers)]
        self.ids: list[int] = []

    def reserve(self, n: int) -> None:
        cap = self.k[0].shape[2]
        if n <= cap:
            return
        new = max(n, cap * 2)
        for lst in (self.k, self.v):
            for i, t in enumerate(lst):
                grown = torch.empty(t.shape[0], t.shape[1], new, t.shape[3])
                grown[:, :, :cap] = t
                lst[i] = grown

    def truncate(self, n: int) -> None:
        del self.ids[n:]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Qwen3Runner:
    """A minimal Qwen3 forward over a loaded transformers model's parameters (no copies)."""

    def __init__(self, hf_model):
        cfg = hf_model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        base = hf_model.model
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = base.layers
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported by the fast Qwen3 path")
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.n_kv, self.head_dim)

    def _rope(self, start: int, n: int):
        pos = torch.arange(start, start + n, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    @staticmethod
    def _rot(x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def forward(self, cache: KVCache, new_ids: list[int], keep_last: int | None = None) -> torch.Tensor:
        """Append `new_ids` to `cache`; return final-norm hidden states of the last `keep_last`
        new positions (all when None) as [k, hidden].

        From an empty cache the whole sequence goes through one causal SDPA call (the fast fused
        path); extending a cached prefix needs an explicit mask, which SDPA runs much slower, so
        that is done in chunks of `_PREFILL_CHUNK` tokens. The last layer only computes the rows
        whose hidden state is wanted (its keys/values are still cached for every position), which
        halves a cold prefill of the 2-layer tiny model.
        """
        keep = len(new_ids) if keep_last is None else min(keep_last, len(new_ids))
        if not cache.ids:
            return self._forward_chunk(cache, list(new_ids), keep)
        outs = []
        starts = list(range(0, len(new_ids), _PREFILL_CHUNK))
        for s in starts:
            chunk = new_ids[s:s + _PREFILL_CHUNK]
            remaining_after = len(new_ids) - (s + len(chunk))
            k = max(0, keep - remaining_after)
            outs.append(self._forward_chunk(cache, chunk, min(k, len(chunk))))
        outs = [o for o in outs if o.shape[0]]
        return torch.cat(outs, 0) if len(outs) > 1 else (outs[0] if outs else torch.empty(0, self.embed.shape[1]))

    def _forward_chunk(self, cache: KVCache, ids: list[int], keep: int) -> torch.Tensor:
        start, n = len(cache.ids), len(ids)
        end = start + n
        cache.reserve(end)
        x = F.embedding(torch.tensor([ids]), self.embed)
        cos, sin = self._rope(start, n)
        last = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            at = layer.self_attn
            h = _rms(x, layer.input_layernorm.weight, self.eps)
            k = F.linear(h, at.k_proj.weight, at.k_proj.bias).view(1, n, self.n_kv, self.head_dim)
            v = F.linear(h, at.v_proj.weight, at.v_proj.bias).view(1, n, self.n_kv, self.head_dim)
            k = self._rot(_rms(k, at.k_norm.weight, self.eps).transpose(1, 2), cos, sin)
            cache.k[li][:, :, start:end] = k
            cache.v[li][:, :, start:end] = v.transpose(1, 2)
            rows = keep if li == last else n  # queries whose output is still needed
            if rows == 0:
                break
            if rows < n:
                x, h = x[:, n - rows:], h[:, n - rows:]
            q = F.linear(h, at.q_proj.weight, at.q_proj.bias).view(1, rows, self.n_heads, self.head_dim)
            q = self._rot(_rms(q, at.q_norm.weight, self.eps).transpose(1, 2),
                          cos[:, :, n - rows:], sin[:, :, n - rows:])
            kk, vv = cache.k[li][:, :, :end], cache.v[li][:, :, :end]
            causal, mask = False, None
            if rows > 1:
                if rows == end:
                    causal = True
                else:
                    # Query i (absolute end-rows+i) sees keys 0..end-rows+i.
                    mask = torch.ones(rows, end, dtype=torch.bool).tril(diagonal=end - rows)
            if rows == 1:
                a = self._attend_one(q, kk, vv)
            else:
                a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal,
                                                   enable_gqa=self.n_kv != self.n_heads,
                                                   scale=1.0 / math.sqrt(self.head_dim))
            a = a.transpose(1, 2).reshape(1, rows, self.n_heads * self.head_dim)
            x = x + F.linear(a, at.o_proj.weight, at.o_proj.bias)
            h = _rms(x, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                             mlp.down_proj.weight)
        cache.ids.extend(ids)
        if keep == 0:
            return torch.empty(0, self.embed.shape[1])
        return _rms(x, self.norm, self.eps)[0]

    def _attend_one(self, q, kk, vv):
        """One query row against the cache: grouped heads share their K/V without copying it
        (SDPA's GQA path on CPU expands K/V, which dominates a decode step on a long cache)."""
        g = self.n_heads // self.n_kv
        qg = q.reshape(1, self.n_kv, g, self.head_dim)
        w = torch.softmax(torch.matmul(qg, kk.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim)), -1)
        return torch.matmul(w, vv).reshape(1, self.n_heads, 1, self.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


class HFRunner:
    """Fallback for non-Qwen3 checkpoints: transformers' base model + its cache (no prefix reuse)."""

    def __init__(self, hf_model):
        self.model = hf_model

    def new_cache(self):
        c = KVCache(0, 0, 0)
        c.hf = None
        return c

    def forward(self, cache, new_ids, keep_last=None):
        if not new_ids:
            raise ValueError("empty forward")
        out = self.model.model(input_ids=torch.tensor([new_ids]), past_key_values=cache.hf, use_cache=True)
        cache.hf = out.past_key_values
        cache.ids.extend(new_ids)
        h = out.last_hidden_state[0]
        return h if keep_last is None else h[len(h) - keep_last:]

    def logits(self, hidden):
        return self.model.lm_head(hidden)


# The transform vLLM 0.32 samples from, in its order (v1/sample/sampler.py Sampler.sample and
# ops/topk_topp_sampler.py, the CPU path apply_top_k_top_p_pytorch / apply_top_k_only; penalties,
# logit_bias and the other logits processors come before it and polar-serve does not implement them):
#   1. temperature: logits / T (greedy, T < 1e-5: no transform at all, nothing truncated: vLLM's
#      SamplingParams turns top_k/top_p/min_p off for greedy requests);
#   2. min_p (MinPLogitsProcessor, the argmax-invariant processors): drop p < min_p * p_max, p the
#      softmax of the scaled logits;
#   3. top_k: drop logits below the k-th largest (ties kept);
#   4. top_p over what is left (renormalised): ascending sort, softmax, cumsum, drop where the
#      cumulative sum <= 1 - top_p, the largest always kept;
#   5. processed logprobs = log_softmax of the result (renormalised over the kept tokens).
# min_p and top_k commute (each keeps the most likely token and min_p depends only on p / p_max),
# top_p does not: it sees the distribution after both.


def process_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Logits after vLLM's transform (see above; masked entries -inf): log_softmax of this is
    vLLM's processed logprob row."""
    x = logits.float()
    if p.temperature <= GREEDY_EPS:
        return x
    x = x / p.temperature
    if p.min_p and p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < probs.max(-1, keepdim=True).values * p.min_p, float("-inf"))
    if p.top_k is not None and 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p.top_p
        drop[..., -1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return x


_NUCLEUS_PROBE = 1024


def _candidates(x: torch.Tensor, p: SamplingParams):
    """(values, ids) of the scaled logits ``x`` that survive min-p / top-k / top-p, sorted by
    value, or (x, None) when nothing is truncated. The set process_logits() keeps (same order of
    steps), but never sorts the whole vocabulary when top-k or min-p (or a small nucleus) bounds it."""
    V = x.shape[-1]
    vals = idx = None
    if p.top_k is not None and 0 < p.top_k < V:
        vals, idx = torch.topk(x, p.top_k)
    if p.min_p and p.min_p > 0:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p) (the normaliser cancels)
        cut = float(x.max()) + math.log(p.min_p)
        if vals is None:
            sel = torch.nonzero(x >= cut).flatten()
            vals, order = torch.sort(x[sel], descending=True)
            idx = sel[order]
        else:
            n = max(int((vals >= cut).sum()), 1)
            vals, idx = vals[:n], idx[:n]
    if p.top_p is not None and p.top_p < 1.0:
        if vals is None:
            lse = torch.logsumexp(x, -1)
            vals, idx = torch.topk(x, min(_NUCLEUS_PROBE, V))
            if float((vals - lse).exp().sum()) <= p.top_p:  # nucleus wider than the probe: full sort
                vals, idx = torch.sort(x, descending=True)
        else:
            lse = torch.logsumexp(vals, -1)  # the distribution top_p sees: what min_p/top_k kept
        probs = (vals - lse).exp()
        # vLLM's rule in ascending order: drop while the cumulative sum (tokens outside `vals`,
        # which it sums first, plus these from the smallest) is <= 1 - top_p
        asc = probs.flip(0).cumsum(0) + max(0.0, 1.0 - float(probs.sum()))
        keep = max(int((asc > 1 - p.top_p).sum()), 1)
        vals, idx = vals[:keep], idx[:keep]
    return (x, None) if vals is None else (vals, idx)


def reported_row(logits: torch.Tensor, p: SamplingParams, mode: str) -> torch.Tensor:
    """The full log-probability row a server reports in ``mode``: processed (vLLM
    processed_logprobs: log_softmax of process_logits), raw (vLLM's default raw_logprobs:
    log_softmax of the logits as the model gave them), scaled (SGLang 0.5.23's sampler: log of
    softmax(logits / T), before any truncation; the raw row for greedy)."""
    x = logits.float()
    if mode == "raw" or p.temperature <= GREEDY_EPS:
        return torch.log_softmax(x, -1)
    if mode == "scaled":
        return torch.log_softmax(x / p.temperature, -1)
    return torch.log_softmax(process_logits(x, p), -1)


def sample_step(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator, mode: str = "processed") -> TokenStep:
    """Sample one token from vLLM's transform; its logprob and the top alternatives as a server
    in logprobs ``mode`` reports them (processed: the sampled distribution)."""
    x = logits.float()
    if p.temperature <= GREEDY_EPS:
        lp = torch.log_softmax(x, -1)
        return _step(lp, int(torch.argmax(lp)), p.top_logprobs)
    vals, idx = _candidates(x / p.temperature, p)
    lp = torch.log_softmax(vals, -1)
    # Exponential race (what vLLM's sampler does): argmax(prob / Exp(1)) samples from prob.
    q = torch.empty_like(lp).exponential_(generator=gen)
    j = int(torch.argmax(lp.exp() / q))
    tok = j if idx is None else int(idx[j])
    if mode != "processed":
        return _step(reported_row(x, p, mode), tok, p.top_logprobs)
    if idx is None:
        return _step(lp, j, p.top_logprobs)
    top = []
    if p.top_logprobs > 0:
        k = p.top_logprobs
        top = [(int(i), max(float(v), LOGPROB_FLOOR)) for v, i in zip(lp[:k].tolist(), idx[:k].tolist(), strict=True)]
        if len(top) < k:  # the rest of the vocabulary is masked: -inf, floored like vLLM
            rest = [i for i in range(x.shape[-1]) if i not in set(idx.tolist())][:k - len(top)]
            top += [(i, LOGPROB_FLOOR) for i in rest]
    return TokenStep(tok, max(float(lp[j]), LOGPROB_FLOOR), top)


def _step(lp_row: torch.Tensor, tok: int, k: int) -> TokenStep:
    lp = max(float(lp_row[tok]), LOGPROB_FLOOR)
    top = []
    if k > 0:
        vals, idx = torch.topk(lp_row, k)
        top = [(int(i), max(float(v), LOGPROB_FLOOR)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)]
    return TokenStep(tok, lp, top)


class ServedModel:
    """Tokenizer + weights + a small pool of prefix caches. Not thread-safe: engine.Engine runs
    everything on one worker thread."""

    POOL = 4
    CACHE_BUDGET = 2 << 30  # bytes of pooled KV caches (a 20k-token Qwen3-0.6B cache is ~4.6 GB in fp32)

    def __init__(self, model_dir: str | Path, max_model_len: int | None = None, *, logprobs_mode: str = "processed",
                 generation_config: str = "auto"):
        self.max_model_len = max_model_len  # vLLM's --max-model-len (default: the config's context)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, not {logprobs_mode!r}")
        # what the reported logprobs are (reported_row): server-wide, like vLLM's --logprobs-mode
        self.logprobs_mode = logprobs_mode
        # where unset sampling fields get their defaults: "auto" (the served model's
        # generation_config.json, vLLM --generation-config auto / SGLang --sampling-defaults model),
        # "vllm" (none: OpenAI's neutral values), or a directory holding a generation_config.json
        self.generation_config = generation_config
        self.load(model_dir)

    def load(self, model_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep the server's output to its one "listening" line
        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"{d} has no config.json: not a Hugging Face model directory")
        tok = AutoTokenizer.from_pretrained(str(d))
        hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        self.model_dir = d
        self.tokenizer = tok
        self.hf = hf
        self.runner = Qwen3Runner(hf) if hf.config.model_type == "qwen3" else HFRunner(hf)
        self.caches: list[KVCache] = []
        self.eos_ids = self._eos_ids(hf)
        src = getattr(self, "generation_config", "auto")
        self.gen_defaults = {} if src == "vllm" else self._gen_defaults(d if src == "auto" else Path(src))
        self.max_len = int(getattr(self, "max_model_len", None) or getattr(hf.config, "max_position_embeddings", 32768))

    @staticmethod
    def _gen_defaults(d: Path) -> dict:
        """Sampling defaults of generation_config.json (both servers apply them to unset fields)."""

        f = d / "generation_config.json"
        if not f.is_file():
            return {}
        cfg = json.loads(f.read_text())
        return {k: cfg[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in cfg}

    @staticmethod
    def _eos_ids(hf) -> tuple[int, ...]:
        ids = []
        for src in (getattr(hf, "generation_config", None), hf.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            for x in (e if isinstance(e, (list, tuple)) else [e]):
                if isinstance(x, int) and x not in ids:
                    ids.append(x)
        return tuple(ids)

    # -- cache pool --------------------------------------------------------------------------
    def _cache_for(self, ids: list[int]) -> KVCache:
        """The pooled cache sharing the longest prefix with `ids`, truncated to that prefix."""
        best, best_n = None, -1
        for c in self.caches:
            n = common_prefix(c.ids, ids)
            if n > best_n:
                best, best_n = c, n
        if isinstance(self.runner, HFRunner) or best is None or best_n == 0:
            best = self.runner.new_cache()
            best_n = 0
            self.caches.append(best)
        # At least the last prompt token must be recomputed to get its hidden state.
        best_n = min(best_n, len(ids) - 1)
        if len(ids) - best_n > _RECOMPUTE_ABOVE:
            best_n = 0
        best.truncate(best_n)
        self.caches.remove(best)
        self.caches.append(best)  # most recently used last
        while len(self.caches) > self.POOL or (
                len(self.caches) > 1 and sum(c.nbytes() for c in self.caches) > self.CACHE_BUDGET):
            self.caches.pop(0)
        return best

    def _prefill(self, ids: list[int]) -> tuple[KVCache, torch.Tensor]:
        if not ids:
            raise ValueError("the prompt is empty")
        cache = self._cache_for(ids)
        hidden = self.runner.forward(cache, ids[len(cache.ids):], keep_last=1)
        return cache, hidden

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], p: SamplingParams, private: bool = False):
        """Yield TokenSteps for sampled tokens; stops at EOS/stop ids (yielded) or max_tokens.
        `private`: a cache of its own, outside the pool (for generations that run interleaved)."""
        with torch.inference_mode():
            if private:
                cache = self.runner.new_cache()
                hidden = self.runner.forward(cache, list(prompt_ids), keep_last=1)
            else:
                cache, hidden = self._prefill(prompt_ids)
            gen = torch.Generator()
            if p.seed is not None:
                gen.manual_seed(p.seed)
            else:
                gen.seed()
            h = hidden[-1:]
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
            for i in range(p.max_tokens):
                step = sample_step(self.runner.logits(h)[0], p, gen, self.logprobs_mode)
                tok = step.token_id
                yield step
                if tok in stops or i == p.max_tokens - 1:
                    return
                h = self.runner.forward(cache, [tok], keep_last=1)

    def prompt_logprobs(self, ids: list[int], k: int) -> list[tuple[int, float, int, list[tuple[int, float]]]]:
        """vLLM's `prompt_logprobs`: for each prompt position after the first, (token, raw logprob,
        rank (1 = most likely), top-k [(id, logprob)]). One uncached forward over the whole prompt."""
        with torch.inference_mode():
            cache = self.runner.new_cache()
            hidden = self.runner.forward(cache, list(ids))
            out = []
            lp = torch.log_softmax(self.runner.logits(hidden[:-1]).float(), -1)
            for row, tok in zip(lp, ids[1:], strict=True):
                v = float(row[tok])
                rank = int((row >= row[tok]).sum())  # vLLM: batched_count_greater_than (>=)
                top = []
                if k > 0:
                    vals, idx = torch.topk(row, k)
                    top = [(int(i), max(float(x), LOGPROB_FLOOR)) for x, i in zip(vals.tolist(), idx.tolist(),
                                                                                   strict=True)]
                out.append((tok, max(v, LOGPROB_FLOOR), rank, top))
            return out

    def teacher_force(self, prompt_ids: list[int], forced: list[int], p: SamplingParams) -> list[TokenStep]:
        """The logprobs of `forced` continuing `prompt_ids` as this server reports them (its
        logprobs_mode; one forward, lm_head only there)."""
        if not forced:
            return []
        with torch.inference_mode():
            cache, hidden = self._prefill(prompt_ids)
            h_last = hidden[-1:]
            rest = self.runner.forward(cache, forced[:-1]) if len(forced) > 1 else hidden[:0]
            hs = torch.cat([h_last, rest], 0)
            steps = []
            for row, tok in zip(self.runner.logits(hs), forced, strict=True):
                lp_row = reported_row(row, p, self.logprobs_mode)
                steps.append(_step(lp_row, tok, p.top_logprobs))
            return steps
