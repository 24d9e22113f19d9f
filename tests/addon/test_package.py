"""The addon as an installed package: ``python -m addon`` names the script for ``mitmdump -s``;
the script needs the installed package (no sys.path patching) and says how to install it; the
proxy process never imports polars, torch or transformers (the capture path needs none of them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import urllib.request
from pathlib import Path

from harness_recipes.node.processes import free_port, running

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "addon" / "polar_addon.py"
HEAVY = ("polars", "torch", "transformers")


def test_python_m_addon_prints_the_script_path(tmp_path):
    out = subprocess.run([sys.executable, "-m", "addon"], capture_output=True, text=True, cwd=tmp_path, check=True)
    path = Path(out.stdout.strip())
    assert path.is_absolute() and path == SCRIPT.resolve() and path.is_file()


def test_loading_the_script_imports_no_polars_torch_or_transformers(tmp_path):
    code = textwrap.dedent(f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("__mitmproxy_script__.polar_addon", {str(SCRIPT)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # as mitmdump -s loads it
        assert mod.addons
        print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    loaded = set(json.loads(out.stdout))
    assert "addon" in loaded and "mitmproxy" in loaded
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_a_running_proxy_has_not_imported_polars_torch_or_transformers(tmp_path):
    """mitmdump with the addon, after it served a call and wrote its row: what is in sys.modules."""
    from tests.addon.procs import fake_backend

    probe = tmp_path / "probe.py"
    dump = tmp_path / "modules.json"
    probe.write_text(textwrap.dedent(f"""
        import json, sys

        def done():
            with open({str(dump)!r}, "w") as f:
                json.dump(sorted({{m.split(".")[0] for m in sys.modules}}), f)
    """))
    port = free_port()
    mitmdump = Path(sys.executable).parent / "mitmdump"
    cmd = [str(mitmdump), "--listen-host", "127.0.0.1", "--listen-port", str(port),
           "--set", f"confdir={tmp_path / 'conf'}", "-s", str(SCRIPT), "-s", str(probe),
           "--set", f"polar_logdir={tmp_path / 'logs'}", "--set", "polar_dialect=vllm"]
    with fake_backend(tmp_path) as be, running([*cmd, "--mode", f"reverse:{be.url}"], log=tmp_path / "mitmdump.log",
                                               port=port, cwd=tmp_path, timeout=30) as px:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        req = urllib.request.Request(px.url + "/v1/chat/completions", data=body.encode(),
                                     headers={"content-type": "application/json", "x-polar-episode": "e"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    assert (tmp_path / "logs" / "e.arrow").stat().st_size > 0
    loaded = set(json.loads(dump.read_text()))
    assert "addon" in loaded and "pyarrow" in loaded
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_the_script_without_the_installed_package_says_how_to_install_it(tmp_path):
    """No sys.path patching: in a Python where the project is not installed (here: site-packages
    without its .pth files, so the editable install is not seen) the script stops with an
    ImportError that says to pip install the project."""
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    code = f"import runpy; runpy.run_path({str(SCRIPT)!r})"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "pip install" in out.stderr, out.stderr[-2000:]
    assert "not installed in the Python that runs mitmdump" in out.stderr
