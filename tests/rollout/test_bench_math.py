import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_rollout", Path(__file__).resolve().parents[2] / "bench" / "bench_rollout.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_busy_seconds_is_the_union_of_intervals():
    assert bench.busy_seconds([]) == 0
    assert bench.busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == 3.0
    assert bench.busy_seconds([(0, 10), (1, 2), (3, 4)]) == 10.0


def test_workload_gives_each_task_its_own_delay(tmp_path):
    import json
    tasks, script = bench.make_workload(tmp_path, 3, 0.5)
    s = json.loads(script.read_text())
    delays = [r["reply"]["delay"] for r in s["rules"] if r["when"].get("turn") == 0]
    assert delays == bench.DELAYS[:3]
    assert len(tasks.read_text().splitlines()) == 3
