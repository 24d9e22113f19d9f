import io

from rich.console import Console

import harness_recipes.node.episode as ep
from harness_recipes.node.progress import Progress, summary_table
from harness_recipes.node.records import Records
from harness_recipes.node.scheduler import Job, Limits, Pipeline
from harness_recipes.tasks.task_file import Task


def test_summary_table_shows_phases_rewards_and_statuses(tmp_path):
    p = Pipeline(recipe=None, exe=None, runtime=None, settings=ep.Settings(proxy="http://x"), records=Records(tmp_path),
                 logdir=None, limits=Limits())
    t = Task(id="t", prompt="p", eval_cmd="true")
    p.jobs = [Job(t, s, 0, f"t.s{s}") for s in range(3)]
    p.stats.phase_counts.update(queued=1, run=1, finished=1)
    p.stats.finished, p.stats.rewards, p.stats.statuses = 1, [1.0], {"done": 1}
    buf = io.StringIO()
    Console(file=buf, width=150, force_terminal=False).print(summary_table(p))
    out = buf.getvalue()
    assert "queued" in out and "1.000" in out and "done: 1" in out


def test_plain_progress_prints_each_finished_episode_once(tmp_path):
    buf = io.StringIO()
    view = Progress(enabled=False, console=Console(file=buf, width=200))
    p = Pipeline(None, None, None, ep.Settings(proxy="http://x"), Records(tmp_path), None, Limits())
    job = Job(Task(id="t", prompt="p", eval_cmd="true"), 0, 0, "t.s0", phase="finished",
              record={"episode_id": "t.s0", "status": "done", "reward": 1.0})
    p.jobs = [job]
    view.update(p)
    view.update(p)
    assert buf.getvalue().count("t.s0: done reward=1.0") == 1
