"""``python -m harness_recipes.demo``: what `make demo` runs (run.py)."""
import sys

from harness_recipes.demo.run import main

sys.exit(main())
