"""polar-serve: a CPU inference server that answers like vLLM 0.33 or SGLang 0.5.23.

    polar-serve --make-tiny DIR                      # tiny random Qwen3 + the real Qwen3 tokenizer
    polar-serve --model DIR --port 0 --dialect vllm|sglang [--script FILE] [--served-model-name N ...]

Modules (protocol logic is sans-IO; the aiohttp handlers are in app.py, plus SGLang's native
/generate and /get_model_info in dialect_sglang.py; cli.py is the command line):
- tiny.py          builds the tiny model (deterministic per seed; the tokenizer from polar_recon.assets)
- model.py         loading, fast Qwen3 forward with a prefix-reusing KV cache, sampling, teacher forcing
- engine.py        one worker thread runs jobs in order; tokens stream back to asyncio as produced
- params.py        request -> sampling parameters (generation_config defaults, validation messages)
- generation.py    request -> GenerationRequest (prompt ids, job), events -> GenerationResult, logprob layouts
- parsers.py       Qwen3 reasoning + hermes (vLLM) / qwen25 (SGLang) tool-call parsing, streaming;
                   jsonstream.py the incremental JSON scanner behind streamed tool-call arguments
- dialect.py       the Dialect interface: every rule in which the two servers differ;
                   dialect_vllm.py (VLLM) / dialect_sglang.py (SGLang) implement it, down to the exact
                   JSON of answers, stream chunks and errors; dialects.py names them for --dialect
- script.py        scripted mode (format documented there; example data/scripts/create_hello.json)
- app.py           aiohttp routes
Chat-template input (exactly as each server prepares it) is polar_recon.chat_render, shared with
reconstruction.
Extra endpoints: GET /polar/weight_version, POST /polar/reload {"model": DIR[, "weight_version": V]};
every model answer carries the header x-polar-weight-version.
"""
