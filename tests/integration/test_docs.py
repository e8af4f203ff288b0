"""The docs stay honest: README.md and docs/*.md show commands that parse (and the cheap ones run),
name files, modules and links that exist; the quick start runs what CI runs; the configuration
reference is the generated docs/configuration.md, linked from README."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest
from helpers import ROOT, run_main

from ray_diloco import cli

README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
SEPARATORS = {"&&", "||", ";", "|", "&"}
#: top-level entries of the repository a path in the docs may point into (run outputs are not)
REPO_TOP = {p.name for p in ROOT.iterdir()
            if (not p.name.startswith(".") or p.name == ".ci") and p.name not in {"runs", "wandb"}
            and not p.name.endswith(".egg-info")}
#: subcommands cheap enough to run from the docs (seconds, no training, no Ray)
CHEAP = {"plan", "simulate", "config", "predict"}
#: of those, the ones that take more than a few seconds on a 2-core machine (transformers, the corpus, a model on meta)
SLOW = {"plan"}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _bash_blocks(path: Path) -> list[str]:
    return re.findall(r"^```bash[ \t]*\n(.*?)^```", _text(path), re.MULTILINE | re.DOTALL)


def _without_code(text: str) -> str:
    """Markdown text without its fenced code blocks (a `# comment` there is no heading)."""
    return re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.MULTILINE | re.DOTALL)


def _segments(block: str) -> list[list[str]]:
    """The simple commands of a bash block: continuation lines joined, comments dropped, split at
    &&, ||, ;, | and &."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        seg: list[str] = []
        for tok in shlex.split(line, comments=True):
            if tok in SEPARATORS:
                out.append(seg)
                seg = []
            else:
                seg.append(tok)
        out.append(seg)
    return [s for s in out if s]


def _all_segments() -> list[tuple[str, list[str]]]:
    return [(p.relative_to(ROOT).as_posix(), seg) for p in DOCS for b in _bash_blocks(p) for seg in _segments(b)]


def _ray_diloco_commands() -> list[tuple[str, list[str]]]:
    """(doc, argv after `ray-diloco`) for every `ray-diloco ...` in a bash block, including the
    one after `ray job submit ... --`."""
    return [(doc, seg[seg.index("ray-diloco") + 1:]) for doc, seg in _all_segments() if "ray-diloco" in seg]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """Parse with the real CLI parser (no command runs). (namespace, "") or (None, the error);
    --help gives (None, "")."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return cli._parser().parse_args(argv), ""
        except SystemExit as e:
            return None, "" if e.code == 0 else (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]


def _repo_path(token: str) -> Path | None:
    """The repository file a command-line token or inline-code span names, or None when it
    names none (URLs, run outputs, placeholders such as NAME or <run>)."""
    token = token.rstrip("/")
    if "/" not in token or "<" in token or re.match(r"^\w+://", token) or token.startswith(("/", "~")):
        return None  # an absolute path is the user's own (/data/stores/...), not the repository's
    parts = token.split("/")
    if any(re.fullmatch(r"[A-Z][A-Z_0-9]*(\.\w+)?", part) for part in parts):
        return None  # tune_spaces/NAME.yaml: a placeholder
    if parts[0] in REPO_TOP:
        return ROOT / token
    if (ROOT / "ray_diloco" / parts[0]).is_dir() and parts[0] not in {"data"}:
        return ROOT / "ray_diloco" / token  # `core/outer.py`: a module of the package
    return None


def _exists(path: Path) -> bool:
    if "*" in path.name:
        return any(path.parent.glob(path.name))
    return path.exists()


# -- the quick start and the configuration reference -----------------------------------------------

def _fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _fields(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _steps(cmd: str) -> list[str]:
    return [" ".join(s.replace("pip install -q", "pip install").split()) for s in cmd.split("&&")]


def test_ci_runs_the_readme_test_command():
    """README's test command is what `.ci/run` runs (whatever the install line becomes: pins, a
    constraints file), and the train command installs the same way, without the test extra."""
    blocks = _bash_blocks(README)
    test_cmd = next(b for b in blocks if "pytest" in b)
    train_cmd = next(b for b in blocks if b.rstrip().endswith("ray-diloco train"))
    ci = [" ".join(line.replace("pip install -q", "pip install").split())
          for line in _text(ROOT / ".ci" / "run").splitlines() if line.strip() and not line.startswith("#")]
    ci_steps = [s for line in ci for s in _steps(line)]
    readme_steps = _steps(test_cmd)
    assert readme_steps[-1] == "python -m pytest -q" == ci_steps[-1]
    missing = [s for s in readme_steps if s not in ci_steps]
    assert not missing, f"README's test command does steps .ci/run does not: {missing}"
    installs = [s for s in ci_steps if s.startswith("pip install")]
    assert [s for s in readme_steps if s.startswith("pip install")] == installs, "README installs differently from CI"
    gate = ["ruff check ray_diloco tests benchmarks", "ruff format --check ray_diloco", "mypy"]  # the lint and type gate, before pytest
    assert readme_steps[-1 - len(gate):-1] == gate == ci_steps[-1 - len(gate):-1]
    assert _steps(train_cmd)[:-1] == [s.replace('".[test]"', ".") for s in readme_steps[: -1 - len(gate)]]
    assert "torch==" in train_cmd


def test_the_configuration_reference_is_generated_and_linked_from_the_readme():
    ref = ROOT / "docs" / "configuration.md"
    assert ref.is_file()
    assert "](docs/configuration.md)" in _text(README)
    from ray_diloco.config import Config

    readme = _text(README)
    hand_written = [k for k in _fields(Config()) if f"| `{k}` |" in readme]
    assert not hand_written, f"README documents config keys by hand (configuration.md is generated): {hand_written}"


def test_readme_is_short_and_names_every_preset():
    from ray_diloco.config import PRESET_DIR

    readme = _text(README)
    assert len(readme.splitlines()) <= 200
    for preset in PRESET_DIR.glob("*.yaml"):
        assert f"`{preset.stem}`" in readme, preset.stem


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_unfilled_placeholders(doc):
    assert not re.findall(r"\b(?:MEASURED_RESULTS|BENCHMARKS|CONFIG_REFERENCE|TODO|TBD|FIXME)\b", _text(doc))


# -- commands in bash blocks ----------------------------------------------------------------------

def test_the_docs_have_commands_to_check():
    commands = _ray_diloco_commands()
    assert len(commands) >= 30, commands  # the collector found the examples
    assert {argv[0] for _, argv in commands} >= set(_subcommands()) - {"scale", "eval", "generate"}


def test_every_ray_diloco_command_names_a_subcommand_and_parses():
    subcommands = set(_subcommands())
    problems = []
    for doc, argv in _ray_diloco_commands():
        if not argv or (argv[0] not in subcommands and argv[0] not in ("-h", "--help")):
            problems.append(f"{doc}: ray-diloco {shlex.join(argv)}: no such subcommand (have {sorted(subcommands)})")
            continue
        _, err = _parse(argv)
        if err:
            problems.append(f"{doc}: ray-diloco {shlex.join(argv)}: {err}")
    assert not problems, "\n".join(problems)


def test_every_config_and_override_in_a_command_is_real():
    """--config/CONFIG names a preset or a file; --set keys are config fields, and with a known base
    config the values pass validation (files the example only stands for, such as
    data.path=my_corpus.jsonl, aside)."""
    from ray_diloco.config import load_config
    from ray_diloco.errors import ConfigError

    problems = []
    for doc, argv in _ray_diloco_commands():
        ns, _ = _parse(argv)
        if ns is None or ns.command not in ("train", "config", "plan", "tune"):
            continue
        base = getattr(ns, "config_file", None) or getattr(ns, "config", None)
        known = True  # None (the defaults), a preset name or a file of the repository
        if base is not None and _repo_path(base) is not None:
            base = str(_repo_path(base))
        elif base is not None and ("/" in base or base.endswith((".yaml", ".yml"))):
            known = False  # runs/sweeps/.../best_config.yaml: a file the example stands for
        validate = known and ns.command != "tune" and getattr(ns, "resume", None) is None
        try:
            load_config(base if known else None, ns.overrides, validate=validate)
        except ConfigError as e:
            real = [p for p in e.problems  # files, model directories and hub ids the example stands for
                    if not ((m := re.match(r"data\.path = '([^']*)': file not found", p)) and _repo_path(m[1]) is None)
                    and not ((m := re.match(r"model\.init_from = '([^']*)': ", p)) and _repo_path(m[1]) is None)]
            if real:
                problems.append(f"{doc}: ray-diloco {shlex.join(argv)}: {real}")
    assert not problems, "\n".join(problems)


def test_every_repository_path_and_module_in_a_command_exists():
    problems = []
    for doc, seg in _all_segments():
        for i, tok in enumerate(seg):
            for cand in [tok, *tok.split("=", 1)[1:]]:
                path = _repo_path(cand)
                if path is not None and not _exists(path):
                    problems.append(f"{doc}: {shlex.join(seg)}: {cand} does not exist")
            if tok in ("-c", "-r", "--constraint", "--requirement") and "pip" in seg and i + 1 < len(seg) \
                    and not (ROOT / seg[i + 1]).is_file():
                problems.append(f"{doc}: {shlex.join(seg)}: {seg[i + 1]} does not exist")
            if tok == "-m" and i > 0 and seg[i - 1].startswith("python") and i + 1 < len(seg):
                module = seg[i + 1]
                if module.split(".")[0] in REPO_TOP and importlib.util.find_spec(module) is None:
                    problems.append(f"{doc}: {shlex.join(seg)}: no module {module}")
    assert not problems, "\n".join(problems)


def _cheap_commands() -> list:
    seen, params = set(), []
    for doc, argv in _ray_diloco_commands():
        if not argv or tuple(argv) in seen or any("<" in a or a.isupper() for a in argv):
            continue
        help_ = "--help" in argv or "-h" in argv
        if not help_ and (argv[0] not in CHEAP or (argv[0] == "predict" and "--fits" in argv
                                                   and argv[argv.index("--fits") + 1] != "paper")):
            continue
        seen.add(tuple(argv))
        slow = not help_ and (argv[0] in SLOW or "--plot" in argv)
        params.append(pytest.param(argv, id=f"{doc}:{' '.join(argv)[:60]}",
                                   marks=[pytest.mark.slow] if slow else []))
    return params


@pytest.mark.parametrize("argv", _cheap_commands())
def test_cheap_commands_in_the_docs_run(argv, tmp_path, monkeypatch):
    """`ray-diloco plan/simulate/config/predict ...` and `--help` as the docs show them exit 0
    (through the CLI's ``main`` in this process, in a scratch directory that sees the repository's
    files, so outputs land there; the console script itself runs in test_cli)."""
    for name in REPO_TOP:
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    p = run_main(argv, env={"WANDB_MODE": "disabled"})
    assert p.returncode == 0, \
        f"ray-diloco {shlex.join(argv)}: exit {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}"


def test_every_subcommand_has_help():
    for name in _subcommands():
        ns, err = _parse([name, "--help"])
        assert ns is None and not err, name


def test_the_search_space_example_is_a_valid_space(tmp_path):
    from ray_diloco.tune.space import load_space

    blocks = re.findall(r"^```yaml[ \t]*\n(.*?)^```", _text(ROOT / "docs" / "sweeps.md"), re.MULTILINE | re.DOTALL)
    spaces = [b for b in blocks if "params:" in b]
    assert spaces
    for i, block in enumerate(spaces):
        path = tmp_path / f"space{i}.yaml"
        path.write_text(block)
        load_space(path)


# -- links, files and modules named in the text -----------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", _without_code(_text(path)), re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(_text(doc))):
        if re.match(r"^(\w+:|//)", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            problems.append(f"{target}: no heading #{anchor} in {path.name}")
    assert not problems, problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_file_named_in_the_text_exists(doc):
    spans = re.findall(r"`([^`\s]+)`", _without_code(_text(doc)))
    missing = sorted({s for s in spans if (p := _repo_path(s)) is not None and not _exists(p)})
    assert not missing, missing


def _resolve_dotted(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_ray_diloco_name_in_the_text_exists(doc):
    """`ray_diloco.components.data.Corpus` and the like, in the text and in examples: modules
    and the names in them (a moved module leaves no stale path in the docs)."""
    names = set(re.findall(r"\bray_diloco(?:\.[A-Za-z_]\w*)+", _text(doc)))
    missing = sorted(n for n in names if not _resolve_dotted(n))
    assert not missing, missing


def test_the_where_things_live_table_names_real_files_and_definitions():
    """Every file in architecture.md's table exists, and every class, function or Class.method it
    names beside a file is defined in one of that row's files."""
    text = _text(ROOT / "docs" / "architecture.md")
    rows = [r for r in text.split("## Where things live", 1)[1].split("\n## ", 1)[0].splitlines()
            if r.startswith("| ") and "`" in r.split("|")[2]]
    assert len(rows) >= 25
    problems = []
    for row in rows:
        spans = re.findall(r"`([^`]+)`", row.split("|")[2])
        files, last = [], None
        for s in spans:
            if s.endswith(".py"):
                last = ROOT / s if "/" in s else (last.parent / s if last else ROOT / s)
                files.append(last)
        for f in files:
            if not f.is_file():
                problems.append(f"{f.relative_to(ROOT)}: no such file")
        defined: set[str] = set()
        for f in (f for f in files if f.is_file()):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(node.name)
                    if isinstance(node, ast.ClassDef):
                        defined |= {f"{node.name}.{m.name}" for m in node.body
                                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
                elif isinstance(node, ast.Assign):  # OuterDriverActor = ray.remote(...)(OuterDriver)
                    defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):  # FORMATS: tuple = ...
                    defined.add(node.target.id)
        for s in spans:
            if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)?", s) and not s.endswith(".py") and files and s not in defined:
                problems.append(f"{s}: not defined in {[str(f.relative_to(ROOT)) for f in files]}")
    assert not problems, "\n".join(problems)
