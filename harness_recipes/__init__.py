"""The rollout side: harness recipes and everything that runs them (``polar-rollout``, cli.py).

- recipes/   one TOML file per harness CLI, loaded and validated (recipe.py), installed (install.py)
- tasks/     task files (task_file.py) and SWE-bench instances (swebench/: rows, grading, sources)
- runtimes/  where an episode runs: local (bubblewrap) or docker, and the SWE-bench images
- node/      one rollout node: the pipelined scheduler, one episode's phases, records, progress,
             its K capture proxies, and the local processes it starts
- fleet/     the node on every machine of a Ray cluster: queue, coordinator, shared store, recon,
             the experiment file
- demo/      `make demo`, the closed loop on the CPU, scripted replies on the real vLLM
- cache.py   where harness CLIs and the tiny model go
"""
