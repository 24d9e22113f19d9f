"""max_policy_lag with opaque string versions ordered by the sync history (SGLang's and vLLM's
"default", the trainer's step names), and the rows that name no single version (spans / unknown)."""
from __future__ import annotations

from polar_contracts.weight_versions import proxy_version, spanning, unknown
from tests.trainer.shardkit import row, synthetic_seq, write_shard
from trainer.shard_source import ShardSource, VersionOrder


def group(name: str, versions: list[str | None]) -> list[dict]:
    return [row(synthetic_seq([1, 2, 3], [100 + i, 200 + i]), f"{name}-e{i}", name, float(i),
                group_size=len(versions), weight_version=v) for i, v in enumerate(versions)]


def drain(src: ShardSource) -> list[str]:
    out = []
    while (g := src.try_next()) is not None:
        out.append(g.group_id)
    return out


def test_string_versions_by_sync_history(tmp_path):
    rows = (group("initial", ["default", "default"]) + group("s1", ["step-000001"] * 2)
            + group("s2", ["step-000002"] * 2) + group("s3", ["step-000003"] * 2)
            + group("mixed", ["step-000003", "step-000001"])  # the oldest row decides
            + group("span", ["step-000003", spanning("step-000002", "step-000003")])
            + group("unk", [unknown("a failed sync to step-000004 may have changed part of the weights")] * 2)
            + group("null", [None, "step-000003"])
            + group("stranger", ["step-999999"] * 2))  # never synced by this trainer
    write_shard(tmp_path, 1, rows)
    src = ShardSource(str(tmp_path), max_policy_lag=1)
    for v in ("default", "step-000001", "step-000002", "step-000003"):  # what the callback tells it
        src.set_current_version(v)
    assert src.current_version == 3 and src.current_version_name == "step-000003"
    assert drain(src) == ["s2", "s3"]
    # null: the oldest version (3 syncs behind), so "null" drops for its lag, not as unknown
    assert src.stats.dropped == {"policy_lag": 4, "spans_versions": 1, "unknown_version": 2}
    # no lag bound: everything is trained, markers included
    assert len(drain(ShardSource(str(tmp_path)))) == 9


def test_lag_of_and_order():
    o = VersionOrder()
    assert o.empty and o.lag("default") == (None, "unknown_version")  # no history: nothing can be bounded
    assert o.lag(None) == (None, "unknown_version")
    o.learn("default")
    o.learn("default")  # (a repeat of the current version is not a new sync)
    o.learn("a")
    o.learn("b")
    assert o.history == ["default", "a", "b"] and o.position == 2
    assert o.lag("default") == (2, "") and o.lag("b") == (0, "") and o.lag("zzz") == (None, "unknown_version")
    assert o.lag(spanning("a", "b")) == (None, "spans_versions")
    assert o.lag(None) == (2, "")  # null: the oldest (the proxy names versions from the first sync on)
    # polar-serve's integer counters outside any history still compare as integers
    c = VersionOrder()
    c.saw("3")
    c.saw("5")
    assert c.current == "5" and c.lag("3") == (2, "") and c.lag(None) == (5, "")
    c.learn("7")
    assert c.lag("5") == (2, "") and c.lag("step-1") == (None, "unknown_version")


def test_trainer_sees_lag_by_history(tmp_path):
    write_shard(tmp_path, 1, group("g", ["default", "x"]))
    src = ShardSource(str(tmp_path))
    src.set_current_version("default")
    src.set_current_version("x")
    src.set_current_version("y")
    g = src.try_next()
    assert src.lag_of(g) == 2  # the group's oldest row is two syncs behind


def test_recon_row_version_never_hides_a_marker_or_null():
    """polar_recon.strategies.oldest_version: a shard row's version is its oldest call's, and a call
    with no single version (null, spans, unknown) makes the whole row say so."""
    from polar_recon.strategies import oldest_version

    assert oldest_version(["3", "1", "2"]) == "1"  # polar-serve counters: numeric
    assert oldest_version(["default", "step-000001"]) == "default"  # strings: the first call's
    assert oldest_version(["step-000001", None]) is None
    span = spanning("step-000001", "step-000002")
    assert oldest_version(["step-000001", span, "step-000002"]) == span
    assert oldest_version([]) is None


def test_no_order_no_bound(tmp_path):
    """A run that never syncs, on string versions (vLLM's / SGLang's "default") or nulls: nothing orders
    them, so the default bound drops nothing (the rollout counts the groups as lag unknown)."""
    write_shard(tmp_path, 1, group("a", ["default", None]) + group("b", [None, None]))
    src = ShardSource(str(tmp_path), max_policy_lag=4)
    assert src.versions.empty and drain(src) == ["a", "b"] and not src.stats.dropped


def test_proxy_named_versions():
    """A server that names no version: rows carry the proxy's own (proxy:<start>-<n>). Learned from
    the proxy (GET /polar/@weights at train start) it is ordered like any version; one the history
    never learned (another proxy's) is the oldest, as a null was: never unknown, never fresh."""
    mine, other = proxy_version("20261203T101500Z.7", 0), proxy_version("20261203T101501Z.8", 0)
    o = VersionOrder()
    o.learn(mine)
    assert o.lag(mine) == (0, "") and o.lag(other) == (0, "")
    o.learn("step-000001")
    o.learn("step-000002")
    assert o.lag(mine) == (2, "") and o.lag(other) == (2, "") and o.lag("step-000001") == (1, "")
