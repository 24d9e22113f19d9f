"""`polar-serve`: a CPU inference server speaking vLLM's or SGLang's wire format.

    polar-serve --make-tiny DIR [--seed N]
    polar-serve --model DIR --port PORT --dialect vllm|sglang [--script FILE] [--host 127.0.0.1]
                [--served-model-name NAME [NAME ...]] [--threads N] [--weight-version V]
                [--logprobs-mode raw_logprobs|processed_logprobs] [--generation-config auto|vllm|DIR]
                [--sampling-defaults model|openai]

Once listening it prints exactly one line `polar-serve listening on http://HOST:PORT` (flushed);
`--port 0` picks a free port, which that line reports.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polar-serve", description=__doc__.split("\n")[0])
    p.add_argument("--make-tiny", metavar="DIR", help="build the tiny random Qwen3 model into DIR and exit")
    p.add_argument("--seed", type=int, default=0, help="seed of --make-tiny (default 0)")
    p.add_argument("--model", metavar="DIR", help="Hugging Face model directory to serve")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    # The names of dialects.DIALECTS, spelled out so that --help and bad flags answer without importing
    # torch (tests/serve/test_cli.py checks that the two agree).
    p.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--script", metavar="FILE", help="scripted mode: replies come from FILE (see polar_serve/script.py)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) accepted (vLLM checks them); the first is reported (default: DIR's name)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a shared 2-core machine more threads spin and run slower)")
    p.add_argument("--weight-version", default=None, help="initial weight_version (default 'default', like SGLang)")
    p.add_argument("--sglang-token-ids-field", choices=("response_token_ids", "token_ids"),
                   default="response_token_ids",
                   help="SGLang chat choice field for output ids: response_token_ids (0.5.23; docs/reference.md, Wire formats) "
                        "or token_ids (later sources; return_token_ids then implies prompt_token_ids)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length the server admits and reports, as vLLM's flag (default: the model config's)")
    p.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default=None,
                   help="vLLM's flag (vllm dialect only): raw_logprobs (the default, as vLLM's: log-softmax of the "
                        "model's logits) or processed_logprobs (after temperature, min-p, top-k, top-p, renormalised: "
                        "the distribution sampled). The sglang dialect reports SGLang 0.5.23's logprobs: "
                        "log-softmax of logits / temperature, before truncation.")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="vLLM's flag (vllm dialect): where unset sampling fields take their defaults: auto (the "
                        "model's generation_config.json, the default), vllm (none: temperature 1, top_p 1, top_k off, "
                        "min_p 0), or a directory holding a generation_config.json")
    p.add_argument("--sampling-defaults", choices=("model", "openai"), default="model",
                   help="SGLang's flag (sglang dialect): model (the model's generation_config.json, the default) or "
                        "openai (none)")
    p.add_argument("--log-level", default="warning")
    return p


def _sampling_setup(args) -> tuple[str, str]:
    """(logprobs mode, generation-config source) of the dialect's flags, as the real servers take them."""

    if args.dialect == "sglang":
        if args.logprobs_mode is not None or args.generation_config != "auto":
            raise ValueError("--logprobs-mode and --generation-config are vLLM flags; SGLang's logprobs are "
                             "scaled (log-softmax of logits / T) and its defaults come from --sampling-defaults")
        return "scaled", "auto" if args.sampling_defaults == "model" else "vllm"
    if args.sampling_defaults != "model":
        raise ValueError("--sampling-defaults is SGLang's flag; the vllm dialect takes --generation-config")
    src = args.generation_config
    if src not in ("auto", "vllm") and not (Path(src) / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {src!r}: not auto, vllm, or a directory with a generation_config.json")
    return ("processed" if args.logprobs_mode == "processed_logprobs" else "raw"), src


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.make_tiny:
        from .tiny import make_tiny
        out = make_tiny(args.make_tiny, seed=args.seed)
        print(f"tiny Qwen3 model written to {out}", flush=True)
        return 0
    if not args.model:
        print("polar-serve: --model DIR is required (or --make-tiny DIR)", file=sys.stderr)
        return 2
    script = None
    if args.script:
        from .script import ScriptError, load_script
        try:
            script = load_script(args.script)
        except ScriptError as e:
            print(f"polar-serve: {e}", file=sys.stderr)
            return 2
    try:
        logprobs_mode, generation_config = _sampling_setup(args)
    except ValueError as e:
        print(f"polar-serve: {e}", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(max(1, args.threads))

    # the server's modules (torch, transformers) load only to serve: --help and errors stay fast
    from .app import Server, make_app
    from .listen import serve_forever
    from .model import ServedModel
    try:
        model = ServedModel(args.model, args.max_model_len, logprobs_mode=logprobs_mode,
                            generation_config=generation_config)
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"polar-serve: cannot load model from {args.model}: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or [Path(args.model).resolve().name]
    from .dialects import DIALECTS
    server = Server(model, DIALECTS[args.dialect].configured(args), name, script, args.weight_version)
    return asyncio.run(serve_forever(make_app(server), args.host, args.port, "polar-serve listening on "))


if __name__ == "__main__":
    sys.exit(main())
