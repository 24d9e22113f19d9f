"""Long episodes as real harnesses run them: N model calls of the fix-add task through the real CLI.

`long_script(calls)` is a polar-serve script (polar_serve/script.py) that drives any bundled harness
through `calls` model calls: the fix first (so the task's reward is 1.0), then `calls - 3` shell calls
that inspect the workspace, then the tests, then the final answer (mini-swe-agent: its submit
command). Every shell command names its step, so no two calls are alike (Gemini CLI and Qwen Code stop
a session that repeats one tool call). The reply is picked by how many tool results the request
holds (`turn_index: tool_results`), not by assistant turns after the last user message: a harness
that slips a reminder in as a user message mid-run (Claude Code's system reminders) would otherwise
start the count over. Calls without tools (titles, next-speaker checks, loop checks) get a short
text; aider (no tools: SEARCH/REPLACE blocks) gets its one edit block.

tests/fixtures/scripts/long_episode.json is `long_script(100)` (tests/rollout/test_long_episodes.py
checks it); bench/bench_long_episodes.py and the compatibility matrix write their own length.

`run_long(name, ...)` runs one harness through a long episode against a scripted stack and measures
it (`LongRun`): calls captured, wall time, `polar-recon build --check` on that episode alone (its
time, the shard bytes, rows, and the coverage ledger: trained share and whether it closed).

    python -m harness_recipes.long_episode --write-script tests/fixtures/scripts/long_episode.json
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

SHELL_TOOLS = ["run_shell_command", "bash", "shell", "exec_command", "Bash"]
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent ends a task with this command
CALLS = 100
# What the inspection steps run, in turn (each with its step number, so no two commands are equal).
INSPECT = ("grep -n 'def ' calc.py", "wc -l calc.py test_calc.py", "sed -n '1,4p' calc.py", "ls", "head -c 120 test_calc.py")


def _shell(command: str, reasoning: str, content: str | None = None) -> dict:
    reply = {"reasoning": reasoning,
             "tool_calls": [{"tool": {"any_of": SHELL_TOOLS}, "arguments": {"command": command},
                             # Gemini CLI and Qwen Code's shell tool wants these beside the command
                             "arguments_by_tool": {"run_shell_command": {"command": command, "description": reasoning,
                                                                        "is_background": False}}}]}
    if content:
        reply["content"] = content
    return reply


def long_script(calls: int = CALLS) -> dict:
    """The polar-serve script of a `calls`-call fix-add episode (calls >= 3)."""
    if calls < 3:
        raise ValueError(f"a long episode needs at least 3 calls (fix, tests, answer), not {calls}")
    turns = [_shell("sed -i 's/return a - b/return a + b/' calc.py", "The add function subtracts. I will fix it with sed.",
                    "I'll fix the operator in calc.py.")]
    for k in range(1, calls - 2):
        cmd = INSPECT[k % len(INSPECT)]
        turns.append(_shell(f"echo 'step {k} of {calls - 3}'; {cmd}", f"Step {k}: look at the workspace again ({cmd})."))
    turns.append(_shell("python3 -m unittest -q test_calc", "Run the tests to check the fix."))
    return {
        "description": f"A {calls}-call fix-add episode (harness_recipes/long_episode.py, long_script({calls})): the fix, "
                       f"{calls - 3} shell calls that inspect the workspace (each names its step), the tests, the final "
                       "answer; replies picked by the number of tool results in the request. mini-swe-agent submits "
                       "last; aider (no tools) gets one edit block; calls without tools get a short text.",
        "turn_index": "tool_results",
        "rules": [
            {"when": {"tools": False, "system_contains": "SEARCH/REPLACE", "last_user_contains": "calc.py"},
             "reply": {"content": "I'll fix calc.py.\n\ncalc.py\n```python\n<<<<<<< SEARCH\n    return a - b\n=======\n"
                                  "    return a + b\n>>>>>>> REPLACE\n```\n"}},
            {"when": {"tools": False}, "reply": {"content": "Fix the failing test"}},
            {"when": {"any_contains": SUBMIT, "turn": calls - 1},
             "reply": {"reasoning": "The tests pass. mini-swe-agent ends a task with its submit command.",
                       "tool_calls": [{"tool": "bash", "arguments": {"command": f"echo {SUBMIT}"}}]}},
        ],
        "turns": turns,
        "fallback": {"reasoning": "The tests pass now.", "content": "Done: the bug is fixed and the tests pass."},
    }


def write_script(path: Path, calls: int = CALLS) -> Path:
    path = Path(path)
    path.write_text(json.dumps(long_script(calls), indent=1) + "\n")
    return path


@dataclass
class LongRun:
    """One harness's long episode, measured."""
    recipe: str
    status: str            # the rollout record's status (done, timeout, ...)
    reward: float | None
    calls: int             # calls captured (agent + auxiliary)
    auxiliary: int
    wall_s: float          # the harness run, start to record
    recon_s: float         # polar-recon build --check of this episode alone
    log_bytes: int
    shard_bytes: int
    segments: int          # training sequences reconstruction built (distinct shard `segment` values)
    rows: int              # rows in the shards (a segment is one row unless --max-len splits it)
    longest_row: int       # tokens
    split_len: int | None  # the second build's --max-len (None: not built)
    split_rows: int | None  # rows of that build: longer segments split at a call boundary
    split_trained: int | None  # its trained tokens (a call alone longer than split_len is left out, counted)
    sampled: int           # completion tokens the server sampled (the ledger)
    trained: int
    closes: bool           # the ledger closed (build exits 0 and says 100.0%)

    @property
    def trained_share(self) -> float:
        return self.trained / self.sampled if self.sampled else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "trained_share": round(self.trained_share, 4)}


def _shard_rows(shards: Path) -> list[tuple[int, int]]:
    """(segment, tokens) of every row in the shards under `shards`."""
    import pyarrow.parquet as pq
    out = []
    for s in sorted(shards.rglob("*.parquet")):
        t = pq.read_table(s, columns=["segment", "input_ids"])
        out += [(seg, len(ids)) for seg, ids in zip(t.column("segment").to_pylist(), t.column("input_ids").to_pylist())]
    return out


NO_CALL_FITS = "longer than max_len"  # in a --max-len build's "no usable call (<reasons>)" error


def build(logs: Path, shards: Path, *extra: str, group_by: str = "episode") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polar_recon.cli", "build", str(logs), str(shards), "--check",
                           "--group-by", group_by, *extra], capture_output=True, text=True, timeout=1800)


def only_too_long(b: subprocess.CompletedProcess) -> bool:
    """A --max-len build that failed only because some episodes have no call short enough: each
    such episode is reported as an error and written to no shard (documented), the rest built."""
    errors = [ln for ln in (b.stdout + b.stderr).splitlines() if ln.startswith("error:")]
    return b.returncode == 1 and bool(errors) and all(no_call_fits(ln) for ln in errors)


def no_call_fits(line: str) -> bool:
    """An episode with no usable call, some of them for their length (the others: auxiliary, ...)."""
    return "no usable call (" in line and NO_CALL_FITS in line.split("no usable call (", 1)[1]


def run_long(name: str, proxy, logdir: Path, work: Path, calls: int, echo=print, recipe_path: str | None = None,
             timeout: float = 1800, split_len: int | None = None) -> LongRun:
    """Run `name` once through the long episode (the stack's server runs long_script(calls)) and
    measure it. `work/<name>` holds the rollout output, `work/<name>-recon` the episode's own log
    and shards (`shards`: no length limit; `shards-split`: --max-len split_len, when given)."""
    from harness_recipes.recipes.install import ensure_installed
    from harness_recipes.recipes.recipe import load_recipe
    from harness_recipes.tasks.samples import sample_task_file
    from polar_contracts.log.reader import read_episode

    recipe = load_recipe(recipe_path or name)
    ensure_installed(recipe, log=echo)
    out = work / name
    tasks = sample_task_file(work, f"long{calls}-{name}", timeout=timeout)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", recipe_path or name, "--tasks", str(tasks),
         "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir),
         "--out", str(out), "--no-progress", "--recon", "none"],
        capture_output=True, text=True, timeout=timeout + 300)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: polar-rollout failed ({proc.returncode}): {proc.stderr[-3000:]}")
    (rec,) = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    src = logdir / f"{rec['episode_id']}.arrow"
    # reconstruction of this episode alone: its log in a folder of its own
    own = work / f"{name}-recon"
    (own / "logs").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, own / "logs" / src.name)
    rows = list(read_episode(src).calls.iter_rows(named=True))
    t1 = time.perf_counter()
    b = build(own / "logs", own / "shards")
    recon = time.perf_counter() - t1
    manifest = own / "shards" / ".polar-recon-manifest.json"
    if b.returncode != 0 and not manifest.is_file():
        raise RuntimeError(f"{name}: polar-recon build failed ({b.returncode}): {b.stdout[-2000:]}{b.stderr[-2000:]}")
    led = json.loads(manifest.read_text())["ledger"][rec["episode_id"]]
    shards = sorted((own / "shards").rglob("*.parquet"))
    built = _shard_rows(own / "shards")
    split_rows = split_trained = None
    if split_len is not None:
        s = build(own / "logs", own / "shards-split", "--max-len", str(split_len))
        if s.returncode != 0 and not only_too_long(s):
            raise RuntimeError(f"{name}: polar-recon build --max-len {split_len} failed: {s.stdout[-2000:]}{s.stderr[-2000:]}")
        split_rows = len(_shard_rows(own / "shards-split")) if (own / "shards-split").is_dir() else 0
        split_led = json.loads((own / "shards-split" / ".polar-recon-manifest.json").read_text())["ledger"] \
            if split_rows else {}
        split_trained = split_led.get(rec["episode_id"], {}).get("trained", 0)
    return LongRun(
        recipe=name, status=rec["status"], reward=rec.get("reward"), calls=len(rows),
        auxiliary=sum(bool(r["auxiliary"]) for r in rows), wall_s=round(wall, 1), recon_s=round(recon, 2),
        log_bytes=src.stat().st_size, shard_bytes=sum(s.stat().st_size for s in shards),
        segments=len({seg for seg, _ in built}), rows=len(built), longest_row=max((n for _, n in built), default=0),
        split_len=split_len, split_rows=split_rows, split_trained=split_trained,
        sampled=led["sampled"], trained=led["trained"],
        closes=b.returncode == 0 and "100.0% accounted for" in (b.stdout + b.stderr))


@click.command()
@click.option("--write-script", "path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="write long_script(--calls) here (tests/fixtures/scripts/long_episode.json)")
@click.option("--calls", type=click.IntRange(3), default=CALLS, show_default=True)
def main(path: Path, calls: int) -> None:
    write_script(path, calls)
    click.echo(f"wrote {path} ({calls} calls)")


if __name__ == "__main__":
    main()
