"""How an episode was graded, as its end metadata's ``eval`` says it: the rollout node writes these
(harness_recipes/verdict/), reconstruction counts them per policy version (polar_recon/verdicts.py).

``eval.verdict`` is one of VERDICTS; ``eval.tampered`` is true iff it is TAMPERED (the reward is then
the lowest a task gives and the episode stays in training); ``eval.evidence`` says what each source
of the verdict said; ``eval.verdict_reasons`` why, when it is not plainly passed or failed.
"""
from __future__ import annotations

PASSED = "passed"  # the sources agree: every real test passed (reward 1.0)
FAILED = "failed"  # the sources agree: a real test did not pass (reward 0.0)
TAMPERED = "tampered"  # the sources disagree, or a canary misbehaved
UNREADABLE = "unreadable"  # the graded run left nothing the node can read (reward 0.0, kept)
TIMED_OUT = "timed_out"  # the tests ran past the eval timeout (reward 0.0, kept)
UNCHECKED = "unchecked"  # an eval the node cannot instrument: its exit status alone
VERDICTS = (PASSED, FAILED, TAMPERED, UNREADABLE, TIMED_OUT, UNCHECKED)

VERDICT_KEY = "verdict"  # keys of the end metadata's "eval"
TAMPERED_KEY = "tampered"
