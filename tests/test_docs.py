"""The documentation: its links resolve, and the commands it shows use flags that exist.

Covers README.md, docs/*.md, benchmarks/README.md and examples/your_project/README.md:
- every relative link points to a file (or folder) that exists. A `#anchor` into a markdown
  file must name one of its headings, using GitHub's anchors: lowercase, spaces to '-',
  punctuation other than '-' and '_' removed, and '-1', '-2', ... for repeated headings;
- every `python -m tfmulti.X ...` command shown, in code blocks and in inline code, names only
  flags that tool accepts (`--noflag` for a boolean), or absl's own (`--flagfile`, `--help`,
  `--verbosity`, `-v`, ...). For `tfmulti.launch`, the flags after a bare `--` belong to
  tfmulti.main (`python -m tfmulti.X`, in capitals, stands for any tool). A code block right
  after the line `<!-- docs-test: refused flags -->` shows a
  tool refusing flags: there, each flag must be refused by that tool and accepted by another;
- every flag of every tool is mentioned somewhere in docs/;
- each recorded benchmark result holds a relative command that writes that very file.

It needs only the flags module, not TensorFlow.
"""
import json
import re
import shlex
from pathlib import Path

import pytest
from absl import app, flags, logging  # noqa: F401  (absl's own flags: --verbosity, -v, ...)

from tfmulti.run import flagdefs  # the flags module: the one line to change when it moves

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("main", "tune", "scratch", "bench", "doctor", "launch", "evaluate", "dataservice")
REFUSED_MARK = "<!-- docs-test: refused flags -->"


def doc_files(root=ROOT):
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            root / "benchmarks" / "README.md", root / "examples" / "your_project" / "README.md"]


# ----------------------------------------------------------------------------- markdown

def split_markdown(text):
    """(prose with code blocks blanked, [(code block lines, marked as refused)])."""
    prose, blocks, block, fence, previous = [], [], None, None, ""
    for line in text.splitlines():
        stripped = line.strip()
        if block is None and re.match(r"(```|~~~)", stripped):
            fence, block, refused = stripped[:3], [], previous == REFUSED_MARK
            prose.append("")
        elif block is not None and stripped.startswith(fence):
            blocks.append((block, refused))
            block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
        if stripped:
            previous = stripped
    return "\n".join(prose), blocks


def inline_code(prose):
    return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def without_inline_code(prose):
    return re.sub(r"`[^`]*`", " ", prose)


def anchor(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # links: their text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    seen, result = {}, set()
    for match in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", prose, re.M):
        base = anchor(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path):
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    prose = without_inline_code(prose)
    found = re.findall(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    found += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", prose, re.M)
    return found


def link_problems(path, root=ROOT):
    """Each relative link of `path` that does not resolve, with why."""
    problems = []
    for target in links(path):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(
                f"{target}: no heading with the anchor #{fragment} in "
                f"{resolved.relative_to(root) if root in resolved.parents else resolved}")
    return problems


# ----------------------------------------------------------------------------- commands

def absl_flags():
    """absl's own flags (long and short names), and which of them are booleans."""
    ours = {name for tool in TOOLS for name in flagdefs.tool_flags(tool)}
    names = {name for name in flags.FLAGS if name not in ours}
    booleans = {name for name in names if flags.FLAGS[name].boolean}
    special = {"flagfile", "undefok", "help", "helpfull", "helpshort", "helpxml", "?"}
    return names | special, booleans | {"help", "helpfull", "helpshort", "helpxml"}


def accepted(tool):
    """The flag names `tool` accepts on its command line, `--noX` for booleans included."""
    names = set(flagdefs.tool_flags(tool))
    absl_names, absl_booleans = absl_flags()
    booleans = {name for name in names if flags.FLAGS[name].boolean} | absl_booleans
    return names | absl_names | {f"no{name}" for name in booleans}


def tokens(text):
    """Shell words of `text` up to a comment or a shell operator."""
    try:
        lexer = shlex.shlex(text, posix=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words = list(lexer)
    except ValueError:  # an unbalanced quote: plain words
        words = text.split(" #", 1)[0].split()
    for i, word in enumerate(words):
        if word in ("|", "||", "&&", ";", ">", ">>", "2>&1", ")") or word.endswith((";", ")")):
            return words[:i]
    return words


def commands(snippet):
    """(tool, [words after the module]) for each tfmulti command in one line of a snippet."""
    found = [(m.group(1), tokens(m.group(2)))
             for m in re.finditer(r"(?:^|\s)-m\s+tfmulti\.(\w+)(?=\s|$)(.*)", snippet)
             if not m.group(1).isupper()]  # `python -m tfmulti.X`: any tool
    console = re.match(r"^\s*(?:\S*\$\s+)?tfmulti(\s.*)?$", snippet)  # the `tfmulti` script
    if console and not found:
        found.append(("main", tokens(console.group(1) or "")))
    return found


def flags_of(tool, words):
    """(tool, flag name) for each flag in a command's words."""
    result = []
    for word in words:
        if word == "--" and tool == "launch":
            tool = "main"
            continue
        if not word.startswith("-") or word in ("-", "--") or re.match(r"-\d", word):
            continue
        result.append((tool, word.lstrip("-").split("=", 1)[0]))
    return result


def snippets(path):
    """(text, refused) for every line of every code block (continuation lines joined) and
    every inline code span of `path`."""
    prose, blocks = split_markdown(path.read_text(encoding="utf-8"))
    result = [(span, False) for span in inline_code(prose)]
    for lines, refused in blocks:
        joined = "\n".join(lines).replace("\\\n", " ")
        result += [(line, refused) for line in joined.splitlines()]
    return result


def flag_problems(path):
    """Each flag of a command shown in `path` that its tool does not accept (or, in a block
    marked as refused, that it does accept), with the command's tool."""
    problems, checked = [], 0
    for text, refused in snippets(path):
        for tool, words in commands(text):
            if tool not in TOOLS:
                problems.append(f"python -m tfmulti.{tool}: not a tool ({', '.join(TOOLS)})")
                continue
            for owner, name in flags_of(tool, words):
                checked += 1
                if not refused and name not in accepted(owner):
                    problems.append(f"--{name}: not a flag of python -m tfmulti.{owner}")
                if refused and (name in accepted(owner) or
                                not any(name in accepted(t) for t in TOOLS if t != owner)):
                    problems.append(f"--{name}: shown as refused by python -m tfmulti.{owner}, "
                                    "but it is not another tool's flag")
    return problems, checked


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.exists()
    assert link_problems(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_uses_flags_its_tool_accepts(path):
    problems, _ = flag_problems(path)
    assert problems == []


def test_the_docs_show_commands_of_every_tool():
    shown = {tool for path in doc_files() for text, _ in snippets(path)
             for tool, _ in commands(text)}
    assert shown >= set(TOOLS)
    assert sum(flag_problems(path)[1] for path in doc_files()) > 50


def test_every_flag_of_every_tool_is_documented():
    text = "\n".join(path.read_text(encoding="utf-8") for path in (ROOT / "docs").glob("*.md"))
    mentioned = set(re.findall(r"--(?:no)?(\w+)", text))
    missing = {f"{tool}: --{name}" for tool in TOOLS for name in flagdefs.tool_flags(tool)
               if name not in mentioned}
    assert not missing, sorted(missing)


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("*.json")),
                         ids=lambda p: p.name)
def test_each_recorded_result_holds_a_relative_command_that_writes_it(path):
    record = json.loads(path.read_text(encoding="utf-8"))
    words = shlex.split(record["command"])
    relative = path.relative_to(ROOT).as_posix()
    assert words[:2] == ["python", f"benchmarks/{words[1].split('/')[-1]}"], words
    assert (ROOT / words[1]).exists(), words[1]
    assert f"--out={relative}" in words, words
    if "args" in record:
        assert record["args"]["out"] == relative
    assert not re.search(r'"/(work|tmp|home|root)/', path.read_text(encoding="utf-8"))


def test_the_checks_find_a_broken_link_a_missing_anchor_and_a_made_up_flag(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        "# Other page\n\n## The launcher: `tfmulti.launch`\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\nSee [gone](missing.md), [fine](other.md#the-launcher-tfmultilaunch), "
        "[bad anchor](other.md#no-such-heading), [here](#page) and [there](#nowhere).\n\n"
        "Run `python -m tfmulti.main --num_gpus=2 --nosync_batchnorm --made_up_flag=3`.\n\n"
        "```\n$ python -m tfmulti.launch --workers=2 -- --width=8 \\\n    --workers=3  # main's\n"
        "python -m tfmulti.tune --max_trials=2 --base_lr=0.1\n```\n\n"
        f"{REFUSED_MARK}\n```\npython -m tfmulti.main --max_trials=5 --epochs=2\n```\n")
    assert link_problems(page, tmp_path) == [
        "missing.md: no such file",
        "other.md#no-such-heading: no heading with the anchor #no-such-heading in docs/other.md",
        "#nowhere: no heading with the anchor #nowhere in docs/page.md"]
    problems, checked = flag_problems(page)
    assert problems == [
        "--made_up_flag: not a flag of python -m tfmulti.main",
        "--workers: not a flag of python -m tfmulti.main",
        "--base_lr: not a flag of python -m tfmulti.tune",
        "--epochs: shown as refused by python -m tfmulti.main, but it is not another tool's flag"]
    assert checked == 10


# ----------------------------------------------------------------------------- make run

def test_the_pages_promise_the_output_make_run_gave_with_todays_flags():
    """README.md, flags/quickstart.cfg and docs/main-job.md show the line that make run's
    command printed when last measured (benchmarks/results/quickstart.json), and the README its
    time; the flags measured are flags/quickstart.cfg's today (else measure again:
    python benchmarks/quickstart.py --out=benchmarks/results/quickstart.json)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import quickstart

    measured = json.loads((ROOT / "benchmarks" / "results" / "quickstart.json").read_text())
    assert measured["flags_sha256"] == quickstart.flags_digest(ROOT / quickstart.FLAGFILE), (
        "flags/quickstart.cfg changed since make run's output was measured")
    line = measured["line"]
    assert line.startswith("test acc: ") and line.endswith(
        "synthetic Fashion-like data (not Fashion-MNIST)")
    for page in ("README.md", "flags/quickstart.cfg", "docs/main-job.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert line in text, f"{page} does not show make run's measured line: {line}"
        shown = re.findall(r"test acc: [0-9.]+, [0-9.]+ sec/epoch on \[CPU:0, CPU:1\][^\n`]*",
                           text)
        assert set(shown) == {line}, (page, shown)  # and no other figure for it
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"{measured['seconds']:.0f} s" in readme


def test_the_security_page_names_what_the_code_opens_writes_and_trusts():
    """docs/security.md against the code: the flags it names are the tools', the files it
    lists are the names the code writes, the modes are the cache's, and the data service's
    refusal is the one it describes."""
    from tfmulti import caches
    from tfmulti.rundir import lifecycle, lock, names
    from tfmulti.tools import dataservice
    from tfmulti.tune import secret

    text = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    assert "trusted_network" in flagdefs.tool_flags("dataservice")
    assert "host" in flagdefs.FLAGS["network"].parser.enum_values and "--network=host" in text
    for name in (lifecycle.RUN_FILE, names.METRICS_FILE, names.PLOT_FILE, names.MODEL_FILE,
                 names.SAVED_MODEL_DIR, names.CLASS_NAMES_FILE, names.TENSORBOARD_DIR,
                 lock.LOCK_FILE, secret.FILE):
        assert f"`{name}" in text, name
    assert caches.FILE_MODE == 0o600 and "folders are 0700 and its files 0600" in text
    assert "--trusted_network" in text and "no authentication" in dataservice.UNTRUSTED


def layout_map(text):
    """{path under tfmulti/: its line} of docs/developing.md's layout block: a folder line
    ("  data/ ...") holds the lines indented under it; a line's leading words ending in .py
    name its modules."""
    block = text.split("## Layout", 1)[1].split("```")[1]
    found, folders = {}, []  # folders: [(indent, name)] open above the line
    lines = block.splitlines()
    for line in lines[lines.index("tfmulti/") + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # past tfmulti/ (tests/, benchmarks/, ...)
            break
        folders = [(i, name) for i, name in folders if i < indent]
        words = line.split()
        if words[0].endswith("/"):
            folders.append((indent, words[0]))
            continue
        where = "".join(name for _, name in folders)
        for word in words:
            if not word.endswith(".py"):
                break
            found[where + word] = line
    return found


def test_the_developers_map_names_every_module_where_it_is():
    """docs/developing.md's layout lists every module of tfmulti/ under its folder, and
    nothing that is not there (it once missed a folder and 12 modules)."""
    mapped = layout_map((ROOT / "docs" / "developing.md").read_text(encoding="utf-8"))
    modules = {str(p.relative_to(ROOT / "tfmulti")) for p in (ROOT / "tfmulti").rglob("*.py")
               if p.name != "__init__.py"}
    assert sorted(modules - set(mapped)) == [], "missing from the map"
    assert sorted(set(mapped) - modules) == [], "in the map, not in the tree"


def test_the_console_command_runs_each_tool_by_its_name():
    """`tfmulti TOOL --help` is `python -m tfmulti.TOOL --help` (the tool's own text and
    flags); `tfmulti --help` the main job's; a tool that does not exist is one line."""
    import subprocess
    import sys

    def console(*args):
        return subprocess.run([sys.executable, "-c", "import sys; from tfmulti.main import run; "
                               f"sys.argv = ['tfmulti', *{list(args)!r}]; run()"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    launch = console("launch", "--help")  # (absl's --help exits with 1)
    assert "Starts N workers of the main job" in launch.stdout and "--workers" in launch.stdout
    # a tool with a package of its own: its __main__'s text (in this process: no TensorFlow
    # process started for it)
    from tfmulti import main as console_main
    assert console_main.tool_doc("tune").startswith("Tuning sessions: keras-tuner finds")
    assert console_main.tool_doc("doctor") and console_main.tool_doc("launch").startswith(
        "Starts N workers of the main job")
    wrong = console("train")
    assert wrong.returncode == 1 and wrong.stderr.strip().splitlines() == [
        "tfmulti: error: no tool 'train': tfmulti TOOL [flags], TOOL one of main, tune, "
        "scratch, bench, doctor, launch, evaluate, dataservice (no TOOL: main)"]
    from tfmulti import main

    assert main.TOOLS == TOOLS
