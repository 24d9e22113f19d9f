"""`polar-serve`: a CPU inference server speaking vLLM's or SGLang's wire format.

    polar-serve --make-tiny DIR [--seed N]
    polar-serve --model DIR --port PORT --dialect vllm|sglang [--script FILE] [--host 127.0.0.1]
                [--served-model-name NAME [NAME ...]] [--threads N] [--weight-version V]

Once listening it prints exactly one line `polar-serve listening on http://HOST:PORT` (flushed);
`--port 0` picks a free port, which that line reports.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys


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
                   help="SGLang chat choice field for output ids: response_token_ids (0.5.23, wire-formats.md) "
                        "or token_ids (later sources; return_token_ids then implies prompt_token_ids)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length the server admits and reports, as vLLM's flag (default: the model config's)")
    p.add_argument("--log-level", default="warning")
    return p


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
    import torch
    torch.set_num_threads(max(1, args.threads))
    from pathlib import Path

    from .app import Server, make_app
    from .listen import serve_forever
    from .model import ServedModel
    try:
        model = ServedModel(args.model, args.max_model_len)
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"polar-serve: cannot load model from {args.model}: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or [Path(args.model).resolve().name]
    from .dialects import DIALECTS
    server = Server(model, DIALECTS[args.dialect].configured(args), name, script, args.weight_version)
    return asyncio.run(serve_forever(make_app(server), args.host, args.port, "polar-serve listening on "))


if __name__ == "__main__":
    sys.exit(main())
