"""The `polar-recon` command line: build / watch / inspect / drift / stats / show / compare."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from polar_contracts.log import end_record as end
from polar_contracts.log.arrays import Episode, list_logs, read_calls
from polar_contracts.log.table import LogError, read_batches
from polar_contracts.shards import MANIFEST, SHARD_GLOB
from polar_recon.shard_writer import ManifestError

from .build import Options, Report, RewardsError, load_rewards, model_max_len
from .build import build as build_shards
from .build import watch as watch_shards
from .diagnostics import drift as run_drift
from .diagnostics import inspect_rows, shard_stats
from .html import render_episode
from .strategies import STRATEGIES, Retokenizer
from .tokens import DEFAULT_TOKENIZER, TurnMarkers


def _tqdm(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="ep", file=sys.stderr, disable=None, leave=False)


def _torn(logdir: Path, eids: list[str]) -> set[str]:
    """The unfinished logs whose last bytes are cut mid-record: a damaged copy, or a writer killed
    (or, in a live logdir, still) mid-write; said so rather than just "not finished"."""
    torn = set()
    for eid in eids:
        try:
            if read_batches(logdir / f"{eid}.arrow")[2]:
                torn.add(eid)
        except (LogError, OSError):
            continue
    return torn


def _echo_report(r: Report, out: Path | None = None, torn: set[str] = frozenset()) -> None:
    for path, msg in r.errors:
        click.echo(f"error: {msg if path in msg else f'{path}: {msg}'}", err=True)
    if r.no_reward:
        click.echo(f"excluded, no reward ({len(r.no_reward)}): {', '.join(sorted(r.no_reward))}", err=True)
    if r.discarded:
        click.echo(f"excluded, discarded by the rollout (metadata.discard) ({len(r.discarded)}): "
                   f"{', '.join(sorted(r.discarded))}", err=True)
    if torn:
        click.echo(f"corrupt, not finished: cut mid-record (a truncated copy, or a proxy killed mid-write), skipped "
                   f"({len(torn)}): {', '.join(sorted(torn))}", err=True)
    unfinished = sorted(set(r.unfinished) - set(torn))
    if unfinished:
        click.echo(f"not finished, skipped ({len(unfinished)}): {', '.join(unfinished)}", err=True)
    for gid, n in sorted(r.waiting.items()):
        click.echo(f"group {gid}: {n} episodes finished, waiting for the rest (not built)", err=True)
    if r.excluded_calls:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(r.excluded_counts().items()))
        click.echo(f"sampled completions not trained ({len(r.excluded_calls)}; {counts}):", err=True)
        for eid, call, choice, reason in r.excluded_calls:
            click.echo(f"  {eid} call {call} choice {choice}: {reason}", err=True)
    if r.timed_out_groups:
        click.echo(f"written incomplete (group_complete=false): {', '.join(r.timed_out_groups)}", err=True)
    shards = ", ".join(p.name for p in r.shards) or "none"
    click.echo(f"built {len(r.built)} episodes ({r.already} already built) -> {r.sequences} sequences, "
               f"{r.tokens} tokens, {r.trainable} trainable; shards: {shards}")
    if r.ledger.episodes:  # the coverage ledger of what this run built (polar_recon/ledger.py)
        click.echo(f"ledger: {r.ledger.summary()}")


def _resolve_episode(episode: str, logdir: str | None) -> Path:
    p = Path(episode)
    if p.exists():
        return p
    cand = Path(logdir or ".") / f"{episode}.arrow"
    if cand.exists():
        return cand
    raise click.BadParameter(f"no log {episode!r} (looked for {p} and {cand}; pass --logdir)", param_hint="EPISODE")


def _read_episode_arg(episode: str, logdir: str | None) -> Episode:
    """EPISODE (a log file, or an id in --logdir) read as calls; a log that cannot be read is a
    ClickException naming the file (inspect and show)."""
    path = _resolve_episode(episode, logdir)
    try:
        return read_calls(path)
    except LogError as exc:
        raise click.ClickException(str(exc)) from None


tokenizer_opt = click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=str(DEFAULT_TOKENIZER),
                             show_default=True, help="tokenizer dir: turn markers, chat template for retokenize")


def _options(strategy, rewards, group_by, shard_size, group_size, tokenizer, include_incomplete=False,
             max_len=None, model=None, exclude_rejected_retries=False, check=False) -> Options:
    try:
        table = load_rewards(rewards) if rewards else None
    except (RewardsError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--rewards") from None
    try:
        if max_len is None and model is not None:
            max_len = model_max_len(model)
        return Options(strategy=strategy, rewards=table, group_by=group_by, shard_size=shard_size,
                       group_size=group_size, include_incomplete=include_incomplete, tokenizer=tokenizer,
                       max_len=max_len, exclude_rejected_retries=exclude_rejected_retries, check=check)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _common(f):
    f = click.option("--strategy", type=click.Choice(STRATEGIES), default="token", show_default=True)(f)
    f = click.option("--rewards", type=click.Path(exists=True, dir_okay=False),
                     help="JSON {episode: reward} or JSONL {episode_id, reward}; overrides end records")(f)
    f = click.option("--group-by", "group_by", metavar="FIELD",
                     help="metadata key naming the GRPO group (e.g. task_id); 'episode' = one group each; "
                          "default: metadata group_id, else the episode")(f)
    f = click.option("--shard-size", type=int, default=256, show_default=True,
                     help="rows per shard (a shard is closed after the group that reaches it)")(f)
    f = click.option("--group-size", type=int, help="episodes in a complete group (GRPO num_generations)")(f)
    f = click.option("--max-len", "max_len", type=int,
                     help="longest row in tokens: longer rows are split at a call boundary; a call longer alone is "
                          "left out, counted in the manifest (never truncated). Default: --model's "
                          "max_position_embeddings, else no limit")(f)
    f = click.option("--model", type=click.Path(exists=True, file_okay=False),
                     help="model dir whose config.json max_position_embeddings is the default --max-len")(f)
    f = click.option("--exclude-rejected-retries", is_flag=True,
                     help="leave out retried samples no later call extends (counted) instead of training each in "
                          "its own row")(f)
    f = click.option("--check", is_flag=True,
                     help="re-verify each episode's rows: context fidelity and every sample accounted for "
                          "(an episode that fails is an error, not a shard)")(f)
    return tokenizer_opt(f)


@click.group()
def main() -> None:
    """Token-faithful training sequences from Polar episode logs."""


@main.command()
@click.argument("logdir", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@_common
@click.option("--include-incomplete", is_flag=True, help="also write groups short of --group-size, flagged")
def build(logdir, out, strategy, rewards, group_by, shard_size, group_size, max_len, model, exclude_rejected_retries,
          check, tokenizer, include_incomplete):
    """Build every finished episode of LOGDIR not yet in OUT into OUT/shard-NNNNNN.parquet."""
    opts = _options(strategy, rewards, group_by, shard_size, group_size, tokenizer, include_incomplete, max_len, model,
                    exclude_rejected_retries, check)
    _check_logdir(Path(logdir), Path(out))
    try:
        report = build_shards(logdir, out, opts, progress_factory=_tqdm)
    except (ManifestError, LogError) as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        # the manifest is saved per group: what was built stays built, a rerun goes on from there
        click.echo("polar-recon build: interrupted; the groups written so far are in the manifest, "
                   "run it again to go on", err=True)
        sys.exit(130)
    _echo_report(report, torn=_torn(Path(logdir), report.unfinished))
    sys.exit(1 if report.errors else 0)


def _check_logdir(logdir: Path, out: Path) -> None:
    """A build over no logs is a mistake (a wrong directory, LOGDIR and OUT swapped), never `built 0`."""
    if list_logs(logdir):
        return
    if any(logdir.glob(SHARD_GLOB)) or (logdir / MANIFEST).exists():
        raise click.UsageError(f"LOGDIR {logdir} holds shards, not capture logs: the arguments are LOGDIR (the "
                               f"proxy's polar_logdir, *.arrow) then OUT (where shards go); swapped?")
    raise click.ClickException(f"no capture logs (*.arrow) in {logdir}: LOGDIR is the proxy's polar_logdir "
                               f"(mitmdump --set polar_logdir=DIR); nothing was built"
                               + (f" (OUT {out} has logs: swapped arguments?)"
                                  if out.is_dir() and list_logs(out) else ""))


@main.command()
@click.argument("logdir", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@_common
@click.option("--poll", type=float, default=2.0, show_default=True, help="seconds between directory scans")
@click.option("--group-timeout", type=float, help="seconds after a group's first finished episode to write it anyway, flagged")
@click.option("--idle-exit", type=float, help="exit after this many seconds with nothing new and nothing pending")
def watch(logdir, out, strategy, rewards, group_by, shard_size, group_size, max_len, model, exclude_rejected_retries,
          check, tokenizer, poll, group_timeout, idle_exit):
    """Build shards continuously as episodes finish (complete GRPO groups per shard)."""
    if group_by not in (None, "episode") and group_size is None and group_timeout is None:
        raise click.UsageError("watch --group-by needs --group-size (or --group-timeout) to know when a group is complete")
    opts = _options(strategy, rewards, group_by, shard_size, group_size, tokenizer, False, max_len, model,
                    exclude_rejected_retries, check)
    try:
        total = watch_shards(logdir, out, opts, poll=poll, group_timeout=group_timeout, idle_exit=idle_exit,
                             on_report=_echo_report)
    except KeyboardInterrupt:
        return
    except (ManifestError, LogError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"watch done: {len(total.built)} episodes, {len(total.shards)} shards")


@main.command()
@click.argument("episode")
@click.option("--logdir", type=click.Path(exists=True, file_okay=False), help="where EPISODE.arrow lives")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per call")
@tokenizer_opt
def inspect(episode, logdir, as_json, tokenizer):
    """Per call of LOGFILE (or EPISODE in --logdir): api, tokens, link kind, timings, errors."""
    ep = _read_episode_arg(episode, logdir)
    rows = inspect_rows(ep, TurnMarkers.load(tokenizer))
    discarded = end.is_discarded(ep.metadata)
    if discarded:  # stderr: keeps --json output one object per call
        click.echo(f"{ep.episode_id}: DISCARDED by the rollout (metadata.discard, status "
                   f"{ep.metadata.get(end.STATUS)!r}): build and watch exclude it", err=True)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{ep.episode_id}: {'finished' if ep.finished else 'NOT finished'}, reward {ep.reward}"
                    + (", DISCARDED (not built)" if discarded else "")
                    + (", torn tail cut" if ep.truncated else ""))
    for c in rows[0] if rows else ["call"]:
        t.add_column(c)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r.values()))
    Console(width=200).print(t)


@main.command()
@click.argument("logdir", type=click.Path(exists=True, file_okay=False))
@click.option("--harness-key", default=end.HARNESS, show_default=True, help="episode metadata key naming the harness")
@click.option("--json", "as_json", is_flag=True)
@tokenizer_opt
def drift(logdir, harness_key, as_json, tokenizer):
    """Compare token / per-call / retokenize on the same episodes."""
    from tqdm import tqdm

    d = run_drift(logdir, TurnMarkers.load(tokenizer), Retokenizer(tokenizer), harness_key,
                  progress=lambda ps: tqdm(ps, desc="drift", unit="ep", file=sys.stderr, disable=None, leave=False))
    for path, why in d.skipped:
        click.echo(f"skipped {path}: {why}", err=True)
    row = d.row()
    kinds = {h: dict(sorted(c.items())) for h, c in sorted(d.kinds.items())}
    divergent = {h: {"context_divergent_tokens": d.context_divergent.get(h, 0), "context_tokens": d.context_tokens.get(h, 0),
                     "realign_classes": dict(sorted(d.realign_classes.get(h, {}).items()))} for h in sorted(d.kinds)}
    if as_json:
        click.echo(json.dumps({**row, "links_by_harness": kinds, "context_by_harness": divergent}))
        return
    click.echo(f"episodes {row['episodes']}, sequences {row['sequences']}, trainable tokens {row['trainable_tokens']}")
    click.echo(f"retokenize: {row['retokenize_differing_tokens']} trainable tokens differ "
               f"({100 * row['retokenize_differing_share']:.2f}%), {row['retokenize_sequences_affected']}/"
               f"{row['sequences']} sequences affected, {row['retokenize_logprobs_misplaced']} logprobs on another id")
    click.echo(f"per-call: {row['per_call_sequences']} sequences, {row['per_call_tokens']} tokens "
               f"({row['per_call_token_blowup']:.1f}x the token strategy's {row['token_sequence_tokens']})")
    for h, c in kinds.items():
        click.echo(f"links [{h}]: " + ", ".join(f"{k} {v}" for k, v in c.items()))
        v = divergent[h]
        click.echo(f"context [{h}]: {v['context_divergent_tokens']} of {v['context_tokens']} context tokens differ from "
                   "what the model was served (token strategy; per-call: 0); classes: "
                   + (", ".join(f"{k} {n}" for k, n in v["realign_classes"].items()) or "none"))


@main.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True)
def stats(out, as_json):
    """Episodes, groups, segments, trainable tokens and rewards of the shards in OUT."""
    try:
        s = shard_stats(out)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(s))
        return
    for k, v in s.items():
        if k == "discarded_ids":
            continue
        if k != "reward_histogram":
            click.echo(f"{k:18} {v}")
    click.echo("reward histogram:")
    width = max(c for _, _, c in s["reward_histogram"]) or 1
    for a, b, c in s["reward_histogram"]:
        click.echo(f"  [{a:8.3f}, {b:8.3f}) {c:6d} {'#' * max(1 if c else 0, int(40 * c / width))}")


@main.command()
@click.argument("episode")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), required=True, help="file to write")
@click.option("--logdir", type=click.Path(exists=True, file_okay=False), help="where EPISODE.arrow lives")
@tokenizer_opt
def show(episode, html_path, logdir, tokenizer):
    """Write an HTML view of EPISODE: tokens, trainable spans, logprobs, turns, link kinds."""
    ep = _read_episode_arg(episode, logdir)
    page = render_episode(ep, TurnMarkers.load(tokenizer), tokenizer)
    tmp = Path(html_path).with_name(Path(html_path).name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(html_path)
    click.echo(f"wrote {html_path} ({len(page)} bytes)")


@main.command()
@click.argument("inputs", nargs=-1, required=True, metavar="[NAME=]STORE_OR_LOGDIR...")
@click.option("--logdir", "logdirs", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="where the sources' capture logs are when not in their own logs/ (a shared proxy logdir); repeatable")
@click.option("--trainer", "trainers", multiple=True, metavar="[HARNESS=]PATH",
              help="the trainer's trainer_state.json (or its output dir) for HARNESS's training curves; repeatable")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="write the self-contained HTML report here (token views of the named episodes beside it, "
                   "in FILE's name + _episodes/)")
@click.option("--json", "as_json", is_flag=True, help="print the report as one JSON object instead of the table")
@click.option("--solved-at", type=float, default=1.0, show_default=True, help="an episode is solved at reward >= this")
@click.option("--drift", "with_drift", is_flag=True,
              help="also measure the drift text re-tokenization would cause (re-links every episode: slow)")
@click.option("--max-views", type=int, default=20, show_default=True, help="token views written per harness")
@click.option("--watch", "watch_s", type=float, default=None, metavar="SECONDS",
              help="with --html: build the report again every SECONDS while a run runs (the page reloads itself); "
                   "Ctrl-C stops")
@tokenizer_opt
def compare(inputs, logdirs, trainers, html_path, as_json, solved_at, with_drift, max_views, watch_s, tokenizer):
    """Harnesses side by side: episodes, calls, tokens, phase times, reward, fidelity, exclusions,
    training curves, per harness (and per weight version), from stores, rollout outputs, an
    experiment's store root or log directories (docs/report.md)."""
    from .compare.run import CompareError, run_compare

    if watch_s is not None:
        from .compare.watch import watch

        if not html_path or as_json:
            raise click.UsageError("--watch rewrites the --html page: give --html FILE (and not --json)")
        try:
            watch(lambda: run_compare(list(inputs), list(logdirs), list(trainers), solved_at=solved_at,
                                      drift=with_drift, tokenizer=tokenizer, html_path=html_path,
                                      max_views=max_views),
                  html_path, watch_s, echo=lambda m: click.echo(m, err=True))
        except CompareError as exc:
            raise click.ClickException(str(exc)) from None
        return

    try:
        report = run_compare(list(inputs), list(logdirs), list(trainers), solved_at=solved_at, drift=with_drift,
                             tokenizer=tokenizer, html_path=html_path, max_views=max_views)
    except CompareError as exc:
        raise click.ClickException(str(exc)) from None
    for e in report["log_errors"]:
        click.echo(f"log not read: {e['path']}: {e['error']}", err=True)
    if as_json:
        click.echo(json.dumps(report, default=str))
    else:
        from .compare.table import render

        render(report)
    if html_path:
        click.echo(f"wrote {html_path}", err=as_json)


if __name__ == "__main__":
    main()
