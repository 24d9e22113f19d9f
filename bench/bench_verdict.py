"""What the verdict's evidence costs: grading time with canaries + structured result, against without.

    .venv/bin/python bench/bench_verdict.py --reps 5                 # bundled task + inflection on the host
    .venv/bin/python bench/bench_verdict.py --reps 5 --docker        # + the flask row through grade_episode in docker
    .venv/bin/python bench/bench_verdict.py --reps 5 --docker --row inflection

Each rep grades a fixed episode (the fix applied) twice, alternating which goes first:
- command: the bundled fix-add (`python3 -m unittest -q test_calc`) in a fresh local workspace
  (bubblewrap when available): the eval command as written (exit status only: the baseline) vs
  through Polar's runner with canaries planted (harness_recipes/verdict/command.py); the time of
  the evaluation (eval patch, runner files, the command, reading the result);
- swebench-host: the inflection row's official eval script in a checkout on the host (no docker),
  tasks/swebench/grade.py `grade` whole (script, swebench's report and log reading, the verdict),
  the baseline instrumented with the exit-status line only (as swebench's own harness does);
- swebench-docker (`--docker`): a row through `grade_episode` on the docker runtime (snapshot,
  fresh container, the fix as the model patch, eval script, report), baseline as above: the
  published flask row (data/swebench-verified, its gold patch; the image built here from PyPI
  the first time), or `--row inflection` (the bundled row, its fix).
Prints medians and the overhead in percent (wall time; for the command and host runs also CPU
time of this process and its children, steadier on a shared machine); writes
bench/results/verdict.json (runs of other modes already there are kept).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

import harness_recipes.tasks.swebench.grade as sg  # noqa: E402
from harness_recipes.node.grading import evaluate_task  # noqa: E402
from harness_recipes.node.model_patch import patch_paths  # noqa: E402
from harness_recipes.runtimes.base import ExecResult, Sandbox, populate_workspace, run_process  # noqa: E402
from harness_recipes.runtimes.local import LocalRuntime, bwrap_available  # noqa: E402
from harness_recipes.tasks.swebench.instances import load_instances  # noqa: E402
from harness_recipes.tasks.task_file import load_tasks  # noqa: E402
from harness_recipes.verdict import swebench as vs  # noqa: E402
from harness_recipes.verdict.command import Plan, plan_command, workspace_files  # noqa: E402

ENV = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
INFLECTION = "jpvanhal__inflection-ordinal-thirteen"
FIX = ("number % 100 in (11, 12):", "number % 100 in (11, 12, 13):")
_instrument = vs.instrument_script
CPU: dict[bool, list[float]] = {False: [], True: []}  # CPU seconds (this process + its children) per grading


def cpu_now() -> float:
    """CPU seconds used so far by this process and its waited-for children: less sensitive than wall
    time to the other work on a shared machine (docker's processes are not ours: wall time only)."""
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + c.ru_utime + c.ru_stime


def exit_line_only(script: str, home: str) -> vs.Instrumented:
    """The baseline: swebench's exit-status line, no canaries, no XML."""
    from swebench.harness.utils import record_test_exit_code
    return vs.Instrumented("\n".join(record_test_exit_code(script.split("\n"))), why="baseline")


async def command_once(rt, task, checked: bool) -> float:
    sb = await rt.prepare(task, f"bench-{'c' if checked else 'b'}-{time.monotonic_ns()}", Path(sys.executable))
    try:
        calc = Path(sb.workspace) / "calc.py"
        calc.write_text(calc.read_text().replace("return a - b", "return a + b"))
        env = {**ENV, "PATH": "/usr/bin:/bin", "HOME": sb.home}
        plan = (plan_command(task.eval_cmd, workspace_files(Path(sb.workspace), patch_paths(task.eval_patch)))
                if checked else Plan(why="baseline"))
        t0, c0 = time.perf_counter(), cpu_now()
        verdict, _, err = await evaluate_task(task, sb, env, plan)
        dt = time.perf_counter() - t0
        CPU[checked].append(cpu_now() - c0)
        assert not err and verdict.reward == 1.0, (err, verdict)
        return dt
    finally:
        await sb.close()


class HostSandbox(Sandbox):
    def __init__(self, root: Path):
        self.root, self.workspace, self.home = root, str(root / "testbed"), str(root / "home")
        Path(self.home).mkdir(parents=True)

    async def exec(self, argv, env, timeout, cwd=None) -> ExecResult:
        return await run_process(argv, env, timeout, cwd)

    async def close(self) -> None:
        pass


async def host_once(task, checked: bool, tmp: Path) -> float:
    root = Path(tempfile.mkdtemp(dir=tmp))
    sb = HostSandbox(root)
    populate_workspace(task, Path(sb.workspace))
    src = Path(sb.workspace) / "inflection" / "__init__.py"
    src.write_text(src.read_text().replace(*FIX))
    inst = {**task.swebench, "eval_script": task.swebench["eval_script"].replace("/testbed", sb.workspace)}
    sg.instrument_script = _instrument if checked else exit_line_only
    try:
        t0, c0 = time.perf_counter(), cpu_now()
        g = await sg.grade(inst, sb, {**ENV, "HOME": sb.home}, 300, root / "out", "fix")
        dt = time.perf_counter() - t0
        CPU[checked].append(cpu_now() - c0)
    finally:
        sg.instrument_script = _instrument
    assert g.reward == 1.0 and g.verdict.status == "passed", g.verdict
    return dt


async def docker_once(rt, task, checked: bool, tmp: Path) -> float:
    from harness_recipes.node.grading import grade_episode
    eid = f"bench-{'c' if checked else 'b'}-{time.monotonic_ns()}"
    sb = await rt.prepare(task, eid, Path("/usr/bin/python3"))
    await sb.write_file(f"{sb.home}/fix.patch", task.swebench["patch"])
    res = await sb.exec(["git", "apply", f"{sb.home}/fix.patch"], {"PATH": "/usr/bin:/bin", "HOME": "/root"},
                        timeout=60, cwd=sb.workspace)
    assert res.rc == 0, res
    sg.instrument_script = _instrument if checked else exit_line_only
    try:
        t0 = time.perf_counter()
        g = await grade_episode(rt, task, eid, sb, Path("/usr/bin/python3"), "/usr/local/bin:/usr/bin:/bin",
                                tmp / "out" / eid, workdir=str(tmp))
        dt = time.perf_counter() - t0
    finally:
        sg.instrument_script = _instrument
    assert g.reward == 1.0, g.eval
    return dt


def summary(name: str, base: list[float], checked: list[float]) -> dict:
    b, c = statistics.median(base), statistics.median(checked)
    out = {"what": name, "reps": len(base), "baseline_s": round(b, 4), "checked_s": round(c, 4),
           "overhead_pct": round(100 * (c - b) / b, 1), "baseline_all": [round(x, 4) for x in base],
           "checked_all": [round(x, 4) for x in checked]}
    line = f"{name:24s} wall: baseline {b:.3f} s  checked {c:.3f} s  overhead {out['overhead_pct']:+.1f}%"
    if CPU[False]:
        cb, cc = statistics.median(CPU[False]), statistics.median(CPU[True])
        out.update(baseline_cpu_s=round(cb, 4), checked_cpu_s=round(cc, 4), cpu_overhead_pct=round(100 * (cc - cb) / cb, 1))
        line += f"   cpu: {cb:.3f} s -> {cc:.3f} s ({out['cpu_overhead_pct']:+.1f}%)"
        CPU[False].clear()
        CPU[True].clear()
    print(line)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--docker", action="store_true", help="also grade a row in docker")
    ap.add_argument("--row", choices=("flask", "inflection"), default="flask", help="the row graded in docker")
    ap.add_argument("--no-host", action="store_true", help="skip the command task and the host-run row")
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (inst,) = load_instances(ROOT / "data" / "swebench" / "mini.jsonl", instances=[INFLECTION])
        if not a.no_host:
            task = next(t for t in load_tasks(ROOT / "data" / "tasks" / "tasks.jsonl") if t.id == "fix-add")
            rt = LocalRuntime(isolation="bwrap" if bwrap_available() else "none", workdir=str(tmp))
            runs: dict[bool, list[float]] = {False: [], True: []}
            for i in range(a.reps):
                for checked in ((False, True) if i % 2 == 0 else (True, False)):
                    runs[checked].append(await command_once(rt, task, checked))
            results.append(summary(f"command ({rt.isolation})", runs[False], runs[True]))
            runs = {False: [], True: []}
            for i in range(a.reps):
                for checked in ((False, True) if i % 2 == 0 else (True, False)):
                    runs[checked].append(await host_once(inst, checked, tmp))
            results.append(summary("swebench-host", runs[False], runs[True]))
        if a.docker:
            if a.row == "flask":
                data = ROOT / "data" / "swebench-verified"
                (inst,) = load_instances(f"swebench:{data / 'flask-5014.jsonl'}", repos=data / "repos")
            from harness_recipes.runtimes.docker import DockerRuntime
            drt = DockerRuntime(network="none", memory="2g", cpus=1.0, workdir=str(tmp))
            try:
                runs = {False: [], True: []}
                for i in range(a.reps):
                    for checked in ((False, True) if i % 2 == 0 else (True, False)):
                        runs[checked].append(await docker_once(drt, inst, checked, tmp))
            finally:
                await drt.shutdown()
            results.append(summary(f"swebench-docker ({a.row})", runs[False], runs[True]))
    out = BENCH / "results" / "verdict.json"
    old = json.loads(out.read_text())["results"] if out.is_file() else []
    kept = [r for r in old if r["what"] not in {x["what"] for x in results}]
    out.write_text(json.dumps({"results": kept + results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
