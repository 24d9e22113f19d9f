"""Harness recipes (one TOML file per harness CLI) and the rollout node `polar-rollout`.

recipe.py (load + validate recipes; the bundled ones are package data), install.py
(ensure_installed), cache.py (where harness CLIs and the tiny model go), tasks.py (task JSONL and
SWE-bench-style files), runtimes/ (local + bubblewrap, docker), episode.py (one episode's phases),
scheduler.py (the pipeline), records.py (status per episode, resume), progress.py (rich view),
rollout.py (the CLI), procs.py (start/stop local processes), stack.py (polar-serve + mitmdump for the
demo, the benchmarks, the tests), closed_loop.py (serve -> proxy -> recon -> trainer -> reload on the
CPU), demo.py (`make demo`).
"""
