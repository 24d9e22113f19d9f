"""The harness compatibility matrix, observed rather than written by hand.

Every bundled recipe (or the ones named) runs the scripted fix-add task (data/tasks, script
fix_tasks.json: a shell call that fixes calc.py, one that runs the tests, a final answer) through
the capture proxy against polar-serve in scripted mode, and the table reports what the run showed:
the API on the wire, streaming, the tools the harness declared and whether tool calls came back in
its history, whether the sampled reasoning came back, the sub-agent tool it declares, how the
episode id reached the proxy, and what reconstruction found (link kinds: CLEAN / REALIGN / FORK,
re-render classes, training segments). Compaction is a harness feature this short task never
triggers: the column says whether the run showed one (a later call resending a shorter history).
Then each recipe runs a LONG_CALLS-call episode of the same task (harness_recipes/long_episode.py:
the fix, inspection calls, the tests, the answer) on a server of its own, and the last column gives
the segments reconstruction made of it and the share of sampled tokens trained (with the calls
captured when the CLI stopped short of the script, and the status when it was not done).

    python -m harness_recipes.compat --out docs/compatibility.md [--recipe NAME ...] [--keep DIR]

tests/rollout/test_compat_matrix.py regenerates rows and compares them with the committed doc.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click

from harness_recipes.tasks.samples import SCRIPT, TASKS, sample_task_file  # noqa: F401 (TASKS: also imported from here)

# The long episode's length in the matrix (harness_recipes/long_episode.py; the bench measures 100)
LONG_CALLS = 100
LONG_COLUMN = f"{LONG_CALLS}-call episode: segments, trained share"
# Tool names harnesses give their sub-agent launcher.
SUBAGENT_TOOLS = ("task", "Task", "Agent", "invoke_agent", "spawn_agent", "dispatch_agent", "delegate")
COLUMNS = ("Recipe", "CLI (npm / PyPI)", "API on the wire", "Streams", "Tools declared / tool calls resent",
           "Thinking resent", "Title call (no tools)", "Sub-agent tool", "Compaction (this run)",
           "Episode id reaches the proxy by", "Calls (agent + auxiliary)", "Reconstruction: links", "Re-render classes",
           "Segments", "Reward", LONG_COLUMN)
BEGIN, END = "<!-- compat-matrix:begin -->", "<!-- compat-matrix:end -->"


@dataclass(frozen=True)
class Compaction:
    """How a CLI compacts its history, and what tests/rollout/test_compaction.py made it do here.

    settings: (old, new) edits of the bundled recipe's text that turn its threshold down (empty:
    not exercised, `matrix` says why); summary_request: a regex the summary call's request
    matches; summary: "auxiliary" (a recipe [[auxiliary]] rule: recorded, never trained) or
    "trained" (its own segment, with the episode's reward); matrix: the compaction column's text."""
    matrix: str
    settings: tuple[tuple[str, str], ...] = ()
    summary_request: str = ""
    summary: str = "auxiliary"


COMPACTION = {
    "qwen-code": Compaction(
        "compacts (0.7 of a 30k window): summary call AUX, next call FORK",
        # the default threshold (0.7) of a 30,000-token window: crossed only by the second listing
        # (the system prompt and tools alone are ~18,000 tokens). Qwen Code keeps the last two tool
        # rounds and compresses only when the summary saves tokens, so the first listing, the one
        # compressed, must be three rounds back.
        settings=(('"name": "${model}",',
                   '"name": "${model}",\n    "chatCompression": {"contextPercentageThreshold": 0.7},'),
                  ('"generationConfig": {"customHeaders"',
                   '"generationConfig": {"contextWindowSize": 30000, "customHeaders"')),
        summary_request="summarizes internal chat history"),
    "claude-code": Compaction(
        "compacts (20% of a 100k auto-compact window, again every tool round or two here): summary calls trained, "
        "each call after one a FORK",
        # CLAUDE_CODE_AUTO_COMPACT_WINDOW's floor is 100,000 tokens, but the threshold is a share of
        # it: 20% (20,000 tokens) is crossed by the first listing (its system prompt and 24 tools are
        # ~18,900 tokens), far below the tiny model's 40,960. Its summary call keeps the tools and the
        # history and appends the instruction to the last user turn: no [[auxiliary]] rule singles
        # it out, so it is trained, as Codex's is. 20,000 is barely above its base prompt, so it
        # compacts again after each tool round or two (docs/compatibility.md).
        settings=(('IS_SANDBOX = "1"', 'CLAUDE_CODE_AUTO_COMPACT_WINDOW = "100000"\n'
                   'CLAUDE_AUTOCOMPACT_PCT_OVERRIDE = "20"\nIS_SANDBOX = "1"'),),
        summary_request="Your task is to create a detailed summary of the conversation so far", summary="trained"),
    "codex": Compaction(
        "compacts (auto-compact limit 12000): summary call trained (own segment), next call FORK",
        # its system prompt and tools are ~8,800 tokens; the limit is crossed after the second
        # listing. The summary call declares no tools but is the agent's own system prompt: no
        # [[auxiliary]] rule singles it out, so it is trained, a FORK of its own (the choice the
        # test checks).
        settings=(('model_reasoning_effort = "low"', 'model_reasoning_effort = "low"\nmodel_auto_compact_token_limit = 12000'),),
        summary_request="CONTEXT CHECKPOINT COMPACTION", summary="trained"),
    "gemini-cli": Compaction(
        "compacts (compressionThreshold 0.01 of its 1,048,576 limit, at the next-speaker check's \"Please continue.\"): "
        "summary + verify calls AUX, next call FORK",
        # it checks the threshold (against the last answer's usageMetadata.promptTokenCount) before
        # each turn, but compresses only up to the last user turn that is not a tool result
        # (findCompressSplitPoint in chatCompressionService): in a one-prompt -p run that is the
        # prompt itself, so nothing, until the history ends in a text answer. With the next-speaker
        # check on (skipNextSpeakerCheck false; the script answers "model" once) the CLI then sends
        # "Please continue." and first compresses the whole history. 0.01 (10,485 tokens) is under
        # the last prompt here (~16,000). The summary and verify calls have their own system prompt:
        # the recipe's chat-compression rule makes both auxiliary, as Qwen Code's.
        settings=(('"model": {"name": "${model}"},',
                   '"model": {"name": "${model}", "compressionThreshold": 0.01, "skipNextSpeakerCheck": false},'),),
        summary_request="distilling chat history into a structured XML <state_snapshot>"),
    "opencode": Compaction(
        "compacts (limit.context 14500, limit.output 4000: overflow at 10,500 tokens): summary call AUX, next call FORK",
        # OpenCode compacts after a step whose usage (prompt + completion) reaches the model's usable
        # window, limit.context - limit.output (isOverflow/usable in its SessionCompaction module;
        # compaction.reserved counts only with limit.input). 10,500 lies between the largest call
        # after the summary (base prompt ~7,000 + summary + one listing: 9,565 here) and the call
        # after both listings (11,819): it compacts once, after the tests, and no call after the
        # summary overflows again (a smaller window would compact again while the agent redoes
        # the work from the summary, and again after that summary). tail_turns 0: the summary
        # replaces the whole history (by default recent turns stay verbatim up to a token budget,
        # so the prompt after the summary would depend on that budget). The summary call has its
        # own system prompt ("You are a context summarization agent") and no tools: the recipe's
        # session-compaction rule makes it auxiliary, as Qwen Code's and Gemini CLI's.
        settings=(('"limit": {"context": 32768, "output": 4096}}}',
                   '"limit": {"context": 14500, "output": 4000}}}'),
                  ('"lsp": false,', '"lsp": false,\n  "compaction": {"tail_turns": 0},')),
        summary_request="Create a new anchored summary from the conversation history"),
    "aider": Compaction("summarises old chat history; not exercised"),
    "mini-swe-agent": Compaction("none (keeps the whole history)"),
    "pi": Compaction("has auto-compaction; not exercised"),
}


def _chat_requests(rows: list[dict]) -> list[dict]:
    """Each call's request as the chat body the server rendered (the translators' view)."""
    from polar_recon.strategies import as_chat_request
    out = []
    for r in rows:
        try:
            out.append(as_chat_request(json.loads(r["request"]), r["api"]))
        except (ValueError, TypeError):
            out.append({})
    return out


def observe(recipe, log, ep, markers, rec: dict) -> dict[str, str]:
    """One matrix row from a finished episode: its log (polars), its calls (arrays) and the rollout record."""
    from polar_recon.link import link_calls
    from polar_recon.strategies import token_sequences

    rows = list(log.calls.iter_rows(named=True))
    agent = [r for r in rows if not r["auxiliary"]]
    chats = _chat_requests(agent)
    # the agent's own calls declare tools (a title call, asked first by some harnesses, declares none)
    with_tools = [(r, c) for r, c in zip(agent, chats) if c.get("tools")]
    tools = sorted({t.get("function", {}).get("name") for _, c in with_tools for t in c["tools"]})
    later = [m for _, c in with_tools[1:] for m in c.get("messages") or ()]
    resent_calls = any(m.get("role") == "assistant" and m.get("tool_calls") for m in later) and \
        any(m.get("role") == "tool" for m in later)
    thinking = any(m.get("role") == "assistant" and (m.get("reasoning_content") or m.get("reasoning"))
                   for m in later)
    nodes = link_calls(ep.calls, markers)
    kinds = Counter(n.kind for n in nodes)
    seqs = token_sequences(ep, markers, nodes)
    classes = Counter(c for s in seqs for c in s.realign_classes)
    subagent = sorted({t for t in tools if t in SUBAGENT_TOOLS})
    episode = (f"header `{recipe.episode_header}`" if recipe.episode_via == "header"
               else "path prefix `/polar/<id>/`")
    # compaction: the harness resent a SHORTER history than before (a summary replaced turns)
    lens = [len(r["prompt_ids"] or ()) for r, _ in with_tools]
    compacted = any(b < a for a, b in zip(lens, lens[1:]))
    return {
        "Recipe": recipe.name,
        "CLI (npm / PyPI)": f"{recipe.install.package} {recipe.install.version}",
        "API on the wire": ", ".join(sorted({r["api"] for r in rows})),
        "Streams": "yes" if all(r["stream"] for r in agent) else ("some" if any(r["stream"] for r in agent) else "no"),
        "Tools declared / tool calls resent": f"{len(tools)} / {'yes' if resent_calls else 'no'}",
        "Title call (no tools)": _title_call(rows),
        "Thinking resent": "yes" if thinking else "no",
        "Sub-agent tool": ", ".join(f"`{t}`" for t in subagent) or "none",
        # what the compaction test made the CLI do (this short task never compacts: a run that
        # did would be news, and says so)
        "Compaction (this run)": ("history shrank; " if compacted else "")
        + (COMPACTION[recipe.name].matrix if recipe.name in COMPACTION else "not exercised"),
        "Episode id reaches the proxy by": episode,
        "Calls (agent + auxiliary)": f"{len(agent)} + {len(rows) - len(agent)}",
        "Reconstruction: links": ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())),
        "Re-render classes": ", ".join(f"{k} {v}" for k, v in sorted(classes.items())) or "none",
        "Segments": str(len(seqs)),
        "Reward": f"{rec.get('reward')}",
    }


def _title_call(rows: list[dict]) -> str:
    """Whether the harness makes a call that declares no tools beside its tool-using ones (a title,
    a next-speaker check), and whether capture or the recipe's rules flag it auxiliary (not trained)."""
    chats = _chat_requests(rows)
    if not any(c.get("tools") for c in chats):
        return "no"  # a harness without tools (aider): every call is the agent's
    bare = [r for r, c in zip(rows, chats) if not c.get("tools")]
    if not bare:
        return "no"
    return "yes, auxiliary" if all(r["auxiliary"] for r in bare) else "yes, trained"


def run_recipe(name: str, proxy, logdir: Path, work: Path, markers, echo=print) -> dict[str, str]:
    from harness_recipes.recipes.install import ensure_installed
    from harness_recipes.recipes.recipe import load_recipe
    from polar_contracts.log.arrays import read_calls
    from polar_contracts.log.reader import read_episode

    recipe = load_recipe(name)
    ensure_installed(recipe, log=echo)
    out = work / name
    proc = subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", name, "--tasks", str(sample_task_file(work, name)),
         "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir),
         "--out", str(out), "--no-progress", "--recon", "build"],
        capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: polar-rollout failed ({proc.returncode}): {proc.stderr[-3000:]}")
    (rec,) = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    path = logdir / f"{rec['episode_id']}.arrow"
    return observe(recipe, read_episode(path), read_calls(path, with_requests=True), markers, rec)


@contextlib.contextmanager
def scripted_stack(logdir: Path):
    """polar-serve (scripted, the tiny model) behind the capture proxy."""
    from harness_recipes.cache import tiny_model
    from harness_recipes.node.local_stack import capture_proxy, serve
    with serve(tiny_model(), script=SCRIPT) as srv, capture_proxy(srv.url, logdir) as proxy:
        yield proxy


def long_cell(run) -> str:
    """The long-episode column from a LongRun: segments and trained share, and anything else the run
    showed (the calls captured, agent and auxiliary, when not LONG_CALLS; a status other than done;
    a ledger that does not close)."""
    text = f"{run.segments}, {run.trained_share:.1%}"
    notes = [f"{run.calls} call{'' if run.calls == 1 else 's'}"] if run.calls != LONG_CALLS else []
    if run.status != "done" or run.reward != 1.0:
        notes.append(f"{run.status}, reward {run.reward}")
    if not run.closes:
        notes.append("ledger does not close")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def build_rows(names: list[str], keep: Path | None = None, echo=print) -> list[dict[str, str]]:
    from harness_recipes.cache import tiny_model
    from harness_recipes.long_episode import run_long, write_script
    from harness_recipes.node.local_stack import capture_proxy, serve
    from polar_recon.tokens import DEFAULT_TOKENIZER, TurnMarkers

    markers = TurnMarkers.load(DEFAULT_TOKENIZER)
    with contextlib.ExitStack() as stack:
        base = keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polar-compat-")))
        logdir = base / "logs"
        with scripted_stack(logdir) as proxy:
            rows = []
            for name in names:
                echo(f"[compat] {name}")
                rows.append(run_recipe(name, proxy, logdir, base, markers, echo))
        # the long episode: its own script, so its own server and proxy
        long = base / "long"
        script = write_script(base / "long_episode.json", LONG_CALLS)
        with serve(tiny_model(), script=script) as srv, capture_proxy(srv.url, long / "logs") as proxy:
            for row in rows:
                echo(f"[compat] {row['Recipe']}: {LONG_CALLS}-call episode")
                row[LONG_COLUMN] = long_cell(run_long(row["Recipe"], proxy, long / "logs", long, LONG_CALLS, echo))
        return rows


def table(rows: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def parse_table(text: str) -> dict[str, dict[str, str]]:
    """The rows of the generated table in a doc, by recipe name."""
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = [ln for ln in body.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split(" | ")]
    rows = {}
    for ln in lines[1:]:
        cells = [c.strip().replace("\\|", "|") for c in ln.strip().strip("|").split(" | ")]
        row = dict(zip(head, cells))
        rows[row["Recipe"]] = row
    return rows


def write_doc(path: Path, rows: list[dict[str, str]]) -> None:
    """Replace the generated table in ``path`` (between the markers); rows of recipes not rerun stay."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise click.ClickException(f"{path}: no {BEGIN} ... {END} block to fill")
    old = parse_table(text) if "| Recipe |" in text.split(BEGIN, 1)[1].split(END, 1)[0] else {}
    old.update({r["Recipe"]: r for r in rows})
    merged = [old[k] for k in sorted(old)]
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + table(merged) + END + rest.split(END, 1)[1])


@click.command()
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="the doc whose generated table to replace (docs/compatibility.md)")
@click.option("--recipe", "names", multiple=True, help="recipes to run (default: every bundled one)")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="keep logs and shards here (default: a temporary directory)")
def main(out: Path, names: tuple[str, ...], keep: Path | None) -> None:
    from harness_recipes.recipes.recipe import bundled_names
    rows = build_rows(list(names) or sorted(bundled_names()), keep, echo=lambda m: click.echo(m, err=True))
    write_doc(out, rows)
    click.echo(table(rows))


if __name__ == "__main__":
    main()
