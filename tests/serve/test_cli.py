"""The polar-serve command line: --make-tiny determinism, the ready line, the fixtures, bad input."""
from __future__ import annotations

import subprocess
import sys

import httpx

from polar_contracts.assets import QWEN3_TOKENIZER
from tests.support.servers import REPO


def test_make_tiny_is_deterministic_and_carries_the_real_tokenizer(tmp_path, tiny_model):
    out = tmp_path / "tiny"
    # Run outside the checkout: the tokenizer is packaged data (polar_contracts.assets), not a repo path.
    r = subprocess.run([sys.executable, "-m", "polar_serve.cli", "--make-tiny", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (QWEN3_TOKENIZER / name).read_bytes()


def test_serve_fixture_port_zero_health_and_sglang_token_ids_layout(serve):
    srv = serve("sglang", extra_args=["--sglang-token-ids-field", "token_ids"])
    assert srv.port > 0 and srv.base_url == f"http://127.0.0.1:{srv.port}"
    assert httpx.get(srv.base_url + "/health").status_code == 200
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_token_ids": True}
    c = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert len(c["token_ids"]) == 3 and c["prompt_token_ids"][-3:] == [151644, 77091, 198]
    assert "response_token_ids" not in c
    assert srv.proc.poll() is None


def test_bad_script_and_missing_model_exit_2_with_a_message(tmp_path, tiny_model):
    bad = tmp_path / "s.json"
    bad.write_text('{"turns": [{"contnt": "x"}]}')
    r = subprocess.run([sys.executable, "-m", "polar_serve.cli", "--model", str(tiny_model), "--script", str(bad)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown keys ['contnt']" in r.stderr
    r = subprocess.run([sys.executable, "-m", "polar_serve.cli", "--model", str(tmp_path / "nope")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no config.json" in r.stderr


def test_dialect_choices_name_the_dialect_objects():
    from polar_serve.cli import _parser
    from polar_serve.dialects import DIALECTS

    action = next(a for a in _parser()._actions if a.dest == "dialect")
    assert tuple(action.choices) == tuple(DIALECTS)
    assert all(name == d.name for name, d in DIALECTS.items())
