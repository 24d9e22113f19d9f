"""polar-serve: a CPU inference server that answers like vLLM 0.33 or SGLang 0.5.23.

    polar-serve --make-tiny DIR                      # tiny random Qwen3 + the real Qwen3 tokenizer
    polar-serve --model DIR --port 0 --dialect vllm|sglang [--script FILE] [--served-model-name N ...]

Modules (protocol logic is sans-IO; app.py and cli.py are the only I/O):
- tiny.py      builds the tiny model (deterministic per seed)
- model.py     loading, fast Qwen3 forward with a prefix-reusing KV cache, sampling, teacher forcing
- engine.py    one worker thread runs jobs in order; tokens stream back to asyncio as produced
- render.py    chat-template input exactly as each server prepares it (their differences included)
- parsers.py   Qwen3 reasoning + hermes (vLLM) / qwen25 (SGLang) tool-call parsing, streaming
- params.py    request -> sampling parameters (generation_config defaults, validation messages)
- chat.py      request -> Call (prompt ids, job), folding events into a Result, logprob entries
- dialect_vllm.py / dialect_sglang.py   the exact JSON of answers, stream chunks and errors
- script.py    scripted mode (format documented there; example data/scripts/create_hello.json)
- app.py       aiohttp routes; cli.py the command line
Extra endpoints: GET /polar/weight_version, POST /polar/reload {"model": DIR[, "weight_version": V]};
every model answer carries the header x-polar-weight-version.
"""
