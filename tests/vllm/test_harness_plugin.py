"""The ForcedReply logits processor (harness_recipes/demo/vllm_plugin/polar_forced_reply.py) on its own, in
vLLM's environment (it imports torch and vllm, which ours does not have): rows follow vLLM's
BatchUpdate (removed, added, moved, swapped), each forced row admits only its next token, other
rows and exhausted sequences are untouched, bad `polar_forced` values are refused."""
from __future__ import annotations

import os
import subprocess

import pytest

from harness_recipes.cache import vllm_python
from harness_recipes.demo.forced_replies import PLUGIN_CLASS, vllm_plugin_dir, vllm_plugin_env

CHECK = r'''
import math, torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality as M
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
from polar_forced_reply import ForcedReply, KEY

(cls,) = _load_logitsprocs_by_fqcns([PLUGIN_CLASS])   # how vLLM loads --logits-processors
assert cls is ForcedReply and not cls.__new__(cls).is_argmax_invariant()
p = ForcedReply(None, torch.device("cpu"), False)
forced = lambda ids: SamplingParams(extra_args={KEY: ids})
out_a, out_b, out_c = [], [], []
p.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
    (0, forced([5, 7, 2]), [1, 2], out_a), (1, SamplingParams(), [1], out_b), (2, forced([9]), [3], out_c)]))
V = 11

def step():
    logits = torch.randn(3, V)
    ref = logits.clone()
    res = p.apply(logits)
    return res, ref

def only(row, tok):
    return [i for i in range(V) if not math.isinf(row[i].item())] == [tok] and row[tok].item() == 0.0

res, ref = step()
assert only(res[0], 5) and only(res[2], 9) and torch.equal(res[1], ref[1])
out_a.append(5); out_c.append(9)
res, ref = step()
assert only(res[0], 7) and torch.equal(res[2], ref[2])        # row 2's sequence is done: untouched
# swap rows 0 and 1, then move row 2 (a forced, finished one) to 0's place after removing 0
p.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, M.SWAP)]))
res, ref = step()
assert only(res[1], 7) and torch.equal(res[0], ref[0])
p.update_state(BatchUpdate(batch_size=2, removed=[0], added=[], moved=[(2, 0, M.UNIDIRECTIONAL)]))
assert set(p.rows) == {0, 1}
out_a.append(7)
res, ref = step()
assert only(res[1], 2)
# a new unforced request takes row 1: no longer forced
p.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[(1, SamplingParams(), [1], [])]))
assert set(p.rows) == {0}
for bad in ([], ["x"], [-1], [True], "1 2"):
    try:
        ForcedReply.validate_params(forced(bad))
    except ValueError:
        continue
    raise AssertionError(f"accepted {bad!r}")
ForcedReply.validate_params(SamplingParams())
print("ok")
'''


def test_forced_reply_processor_in_vllms_environment():
    python = vllm_python()
    if not python.exists():
        pytest.skip(f"the real vLLM is not installed at {python}: run `make vllm`")
    assert (vllm_plugin_dir() / "polar_forced_reply.py").is_file()
    r = subprocess.run([str(python), "-c", f"PLUGIN_CLASS = {PLUGIN_CLASS!r}\n" + CHECK], env={**os.environ, **vllm_plugin_env()},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
