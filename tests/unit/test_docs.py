"""The README and docs/ against the code they describe: the import layers of
docs/architecture.md are pyproject.toml's, the README's set-up commands are what CI runs, every
docs page is reachable from the README, every relative link resolves, every `fp8jax COMMAND`
the README names exists, and nothing cites a file outside the repository."""
from __future__ import annotations

import argparse
import os
import re
import subprocess

import pytest

try:
  import tomllib
except ImportError:  # Python 3.10
  tomllib = pytest.importorskip("tomli")

from fp8jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
MAX_README_LINES = 250
SETUP_LINES = 40


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def _doc_pages() -> list[str]:
  return sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


# ------------------------------------------------------------------------------ layers

def _layer_modules(line: str) -> list[str]:
  """The module names of one layer line, in order ("a : b" and "a | b" alike)."""
  return re.findall(r"fp8jax(?:\.[A-Za-z_][\w]*)*", line)


def _pyproject_layers() -> list[list[str]]:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
  layers = [c for c in contracts if c["type"] == "layers"]
  assert len(layers) == 1, "one layers contract expected in pyproject.toml"
  return [_layer_modules(layer) for layer in layers[0]["layers"]]


def _architecture_layers() -> list[list[str]]:
  text = _read(os.path.join(DOCS, "architecture.md"))
  block = re.search(r"<!-- layers:.*?-->\s*```\n(.*?)```\s*<!-- end layers -->", text, re.S)
  assert block, "docs/architecture.md has no marked layer block"
  return [_layer_modules(line) for line in block.group(1).splitlines() if line.strip()]


def test_architecture_layers_are_the_import_linter_contract():
  assert _architecture_layers() == _pyproject_layers()


def test_layer_parser_reads_separators_and_order():
  assert _layer_modules("app   fp8jax.cli : fp8jax.launch") == ["fp8jax.cli", "fp8jax.launch"]
  assert _layer_modules("fp8jax.hardware | fp8jax.xla_env") == ["fp8jax.hardware",
                                                                "fp8jax.xla_env"]


# ------------------------------------------------------------------------------ README

def _ci_commands() -> tuple[str, str]:
  """(install, test) command lines of .ci/run, comments dropped."""
  lines = [line.split("#")[0].strip() for line in _read(os.path.join(ROOT, ".ci", "run"))
           .splitlines()]
  install = [line for line in lines if "pip install" in line]
  test = [line for line in lines if "pytest" in line]
  assert len(install) == 1 and len(test) == 1, (install, test)
  return install[0], test[0]


def test_readme_is_short_and_starts_with_both_setup_commands():
  lines = _read(README).splitlines()
  assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
  top = lines[:SETUP_LINES]
  install, test = _ci_commands()
  assert test == "python -m pytest -q -n 2"
  test_line = f"{install} && {test}"
  assert test_line in top, f"README's first {SETUP_LINES} lines lack {test_line!r}"
  i = top.index(test_line)
  main = top[i - 1]  # the main job, directly above: nothing between them
  assert re.fullmatch(r"python3 -m venv \.venv && \. \.venv/bin/activate && pip install -e \. "
                      r"&& fp8jax train( --config configs/\w+\.yaml)?", main), main
  config = re.search(r"--config (\S+)", main)
  assert config is None or os.path.isfile(os.path.join(ROOT, config.group(1)))


def test_every_docs_page_is_linked_from_the_readme():
  linked = {os.path.normpath(os.path.join(ROOT, t)) for t, _ in _links(_read(README))}
  missing = [os.path.relpath(p, ROOT) for p in _doc_pages() if p not in linked]
  assert missing == []


def _commands(parser: argparse.ArgumentParser) -> dict:
  """{name: nested commands} of `parser`'s subcommands."""
  out = {}
  for action in parser._actions:  # argparse keeps subparsers only here
    if isinstance(action, argparse._SubParsersAction):
      for name, sub in action.choices.items():
        out[name] = _commands(sub)
  return out


_FENCE = re.compile(r"```.*?```", re.S)
# Fenced blocks, and inline code (which may wrap onto the next line, never across a blank one).
_CODE = re.compile(r"```.*?```|`(?:[^`\n]|\n(?![ \t]*\n))+`", re.S)
_COMMAND = re.compile(r"(?<![\w.-])fp8jax((?: [a-z][\w-]*)+)")


def _named_commands(text: str) -> list[list[str]]:
  """The words after each `fp8jax` at a command position inside code (backticks or fences);
  `import fp8jax ...` / `from fp8jax ...` are Python, not commands."""
  found = []
  for code in _CODE.findall(text):
    for m in _COMMAND.finditer(code):
      before = code[:m.start()].rstrip()
      if before.endswith(("import", "from")):
        continue
      found.append(m.group(1).split())
  return found


def _unknown_commands(text: str, commands: dict) -> list[str]:
  bad = []
  for words in _named_commands(text):
    level = commands
    for depth, word in enumerate(words):
      if not level:  # a command without subcommands: the rest are its arguments
        break
      if word not in level:
        bad.append("fp8jax " + " ".join(words[:depth + 1]))
        break
      level = level[word]
  return bad


def test_every_command_the_readme_names_exists():
  commands = _commands(cli.build_parser())
  assert {"train", "check", "bench", "launch", "simulate"} <= set(commands)
  readme = _read(README)
  assert len(_named_commands(readme)) >= 10
  assert _unknown_commands(readme, commands) == []
  for page in _doc_pages():
    assert _unknown_commands(_read(page), commands) == [], os.path.relpath(page, ROOT)


def test_command_check_finds_a_missing_command():
  commands = _commands(cli.build_parser())
  text = "run `fp8jax evaluate --config x.yaml` or `fp8jax tokenizer fit`; `import fp8jax` is fine"
  assert _unknown_commands(text, commands) == ["fp8jax evaluate", "fp8jax tokenizer fit"]


# ------------------------------------------------------------------------------ links

_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def _links(text: str) -> list[tuple[str, str]]:
  """(path, anchor) of the relative Markdown links of `text`, code excluded."""
  out = []
  for target in _LINK.findall(_CODE.sub("", text)):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    out.append((path, anchor))
  return out


def _anchors(text: str) -> set[str]:
  """GitHub's heading anchors of a Markdown text."""
  seen: dict[str, int] = {}
  out = set()
  for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _FENCE.sub("", text), re.M):
    slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def _broken_links(path: str) -> list[str]:
  text = _read(path)
  bad = []
  for target, anchor in _links(text):
    dest = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
    if not os.path.exists(dest):
      bad.append(f"{target}#{anchor}" if anchor else target)
    elif anchor and dest.endswith(".md") and anchor not in _anchors(_read(dest)):
      bad.append(f"{target}#{anchor}")
  return bad


@pytest.mark.parametrize("page", ["README.md"] + [os.path.join("docs", os.path.basename(p))
                                                   for p in _doc_pages()])
def test_relative_links_resolve(page):
  assert _broken_links(os.path.join(ROOT, page)) == []


def test_link_check_finds_broken_links(tmp_path):
  (tmp_path / "b.md").write_text("# A Title: with `code`\n## Again\n## Again\n")
  page = tmp_path / "a.md"
  page.write_text("[ok](b.md#a-title-with-code) [ok](b.md#again-1) [web](https://x.org/y) "
                  "[bad](c.md) [bad anchor](b.md#nope) `[in code](d.md)` [self](#here)\n"
                  "## Here\n")
  assert _broken_links(str(page)) == ["c.md", "b.md#nope"]


# ------------------------------------------------------------------------------ citations

# Built from pieces so this file does not cite them itself.
_OUTSIDE = re.compile("DESIGN" + r"(\.md|'s)|\.\./" + "shared" + "|/work/" + "shared")
_BINARY = (".png", ".jpg", ".gif", ".pdf", ".bin", ".safetensors", ".npz", ".npy", ".pkl")


def _repo_files() -> list[str]:
  try:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [f for f in out.splitlines() if f]
  except (OSError, subprocess.SubprocessError):
    files = []
    for d, dirs, names in os.walk(ROOT):
      dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("runs", "__pycache__")]
      files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
    return files


def test_no_file_cites_anything_outside_the_repository():
  citing = []
  files = _repo_files()
  assert "README.md" in files and "pyproject.toml" in files
  for rel in files:
    path = os.path.join(ROOT, rel)
    if rel.endswith(_BINARY) or not os.path.isfile(path) or os.path.getsize(path) > 4 << 20:
      continue  # binaries and large data files cite nothing
    with open(path, "rb") as f:
      text = f.read().decode("utf-8", errors="replace")
    if _OUTSIDE.search(text):
      citing.append(rel)
  assert citing == []
