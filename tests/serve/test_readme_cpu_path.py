"""The README's "Five minutes" has a CPU path: polar-serve builds and serves the tiny model whose
directory is MODEL_DIR, under the model name the harness asks for, with the logprobs mode the trainer
trains on (processed: polar-serve's own default is raw, as vLLM's, which the trainer excludes).
The commands themselves are run verbatim by the doc tests; this one reads what they say."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from polar_serve.cli import _parser, _sampling_setup

REPO = Path(__file__).resolve().parents[2]


def five_minutes_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Five minutes with your harness and server", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, "README: no command block under 'Five minutes'"
    commands, pending = [], ""
    for line in "\n".join(blocks).splitlines():
        line = pending + line.split(" #", 1)[0] if not line.lstrip().startswith("#") else pending
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if line.strip():
            commands.append(shlex.split(line.strip().rstrip("&").strip()))
    return commands


def test_readme_serves_the_tiny_model_on_cpu_with_processed_logprobs():
    serve = [c for c in five_minutes_commands() if c and c[0] == "polar-serve"]
    make = [c for c in serve if "--make-tiny" in c]
    run = [c for c in serve if "--model" in c]
    assert make and run, f"README's Five minutes has no polar-serve CPU path: {serve}"
    args = _parser().parse_args(run[0][1:])
    assert args.model == make[0][make[0].index("--make-tiny") + 1]  # MODEL_DIR is the tiny model it built
    assert _sampling_setup(args)[0] == "processed", "the trainer excludes every raw-logprobs row"
    assert args.served_model_name == ["polar-model"]  # the bundled recipes' --model default
    train = [c for c in five_minutes_commands() if c and c[0] == "polar-train"]
    assert train and "--use_cpu" not in train[0], "polar-train picks the CPU itself (trainer/cpu_fallback.py)"
