"""Harness recipes (one TOML file per harness CLI) and the rollout node `polar-rollout`.

recipe.py (load + validate recipes), install.py (ensure_installed), tasks.py (task JSONL and
SWE-bench-style files), runtimes/ (local + bubblewrap, docker), episode.py (one episode's phases),
scheduler.py (the pipeline), records.py (status per episode, resume), progress.py (rich view),
rollout.py (the CLI), stack.py (polar-serve + mitmdump for demo, bench, tests), demo.py (`make demo`).
"""
