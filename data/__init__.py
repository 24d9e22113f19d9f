"""polar_data: the project's bundled data, installed with the wheel (setup.cfg maps `data/` here).

    tokenizers/qwen3/   the real Qwen3 tokenizer and chat template (see its PROVENANCE.md)
    tasks/              sample tasks (tasks.jsonl, toy repos, the demo's reply script)
    scripts/            polar-serve reply scripts

Find a file with `polar_contracts.assets.data_path("tokenizers", "qwen3")`.
"""
