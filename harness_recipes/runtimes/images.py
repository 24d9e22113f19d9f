"""Moved: SWE-bench instance images are the task's business, in harness_recipes.tasks.swebench.images.

These names stay importable from here for code written before the move.
"""
from harness_recipes.tasks.swebench.images import (  # noqa: F401
    ImageError,
    base_only_repo,
    build_instance,
    ensure_base,
    find_official,
    history_after,
    image_path,
    instance_image,
    official_candidates,
    official_name,
    polar_name,
    registry_name,
    task_image,
    uses_spec,
)
