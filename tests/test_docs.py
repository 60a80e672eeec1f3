"""The documentation holds together: every exception class actplan defines has a heading in
docs/troubleshooting.md, every relative link in README.md and docs/*.md reaches an existing file
(and heading), and docs/index.md lists exactly the pages in docs/. Pure file reading."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SOURCE = ROOT / "src" / "actplan"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
INDEX = DOCS / "index.md"
PAGES = sorted(DOCS.glob("*.md"))
LINKING_FILES = [ROOT / "README.md", *PAGES]

_BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)
_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


# ---------------------------------------------------------------------------------------------
# Reading the source and the markdown


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_exception_base(name: str, found: set[str]) -> bool:
    # Builtins by name; third-party bases (yaml.YAMLError) by their conventional suffix.
    return name in _BUILTIN_EXCEPTIONS or name in found or name.endswith(("Error", "Exception", "Warning"))


def exception_classes(source: Path = SOURCE) -> set[str]:
    """Names of the public classes defined under ``source`` that derive from an exception,
    directly or through one another (a private one, ``_Name``, is caught inside the package
    and never reaches a user)."""
    bases: dict[str, set[str]] = {}
    for path in sorted(source.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(filter(None, map(_base_name, node.bases)))
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, parents in bases.items():
            if name not in found and any(_is_exception_base(parent, found) for parent in parents):
                found.add(name)
                changed = True
    return {name for name in found if not name.startswith("_")}


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` for every line outside fenced code blocks."""
    out = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)[0]
            continue
        if fence is not None:
            if match and match.group(1)[0] == fence:
                fence = None
            continue
        out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation goes, letters, digits, _ and - stay
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    matches = (_HEADING.match(line) for _, line in prose_lines(path.read_text(encoding="utf-8")))
    return [match.group(2) for match in matches if match]


def anchors(path: Path) -> set[str]:
    """Every anchor a link into ``path`` may name: heading slugs (repeats numbered) and HTML anchors."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    out.update(_HTML_ANCHOR.findall(path.read_text(encoding="utf-8")))
    return out


def link_targets(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every inline link, image and link reference definition
    outside code."""
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = _INLINE_CODE.sub("code", line)
        out.extend((number, target) for target in _LINK.findall(line))
        definition = _REFERENCE.match(line)
        if definition:
            out.append((number, definition.group(1)))
    return out


def broken_links(path: Path) -> list[str]:
    """One line per relative link in ``path`` whose file, or whose heading in a markdown file,
    does not exist."""
    problems = []
    for number, target in link_targets(path):
        if _SCHEME.match(target):
            continue  # http(s), mailto: not checked here
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor and destination.suffix == ".md" and unquote(anchor) not in anchors(destination):
            problems.append(f"{where}: no heading with anchor #{anchor} in {destination.name}")
    return problems


# ---------------------------------------------------------------------------------------------
# The checks


def test_every_exception_class_has_a_heading_in_troubleshooting():
    classes = exception_classes()
    # The scan itself works: these are defined in the package (guards a vacuous pass).
    assert {"ConfigError", "MarkerError", "BudgetError"} <= classes, classes
    page_headings = headings(TROUBLESHOOTING)
    missing = sorted(
        name for name in classes if not any(re.search(rf"\b{name}\b", text) for text in page_headings)
    )
    assert not missing, f"exception classes with no heading in {TROUBLESHOOTING.name}: {missing}"


@pytest.mark.parametrize("path", LINKING_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_existing_files_and_headings(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_index_lists_every_page_and_only_existing_ones():
    listed = set()
    for _, target in link_targets(INDEX):
        file_part = target.partition("#")[0]
        if _SCHEME.match(target) or not file_part.endswith(".md"):
            continue
        destination = (DOCS / unquote(file_part)).resolve()
        if destination.parent == DOCS.resolve():
            listed.add(destination)
    assert all(page.exists() for page in listed), sorted(str(p) for p in listed if not p.exists())
    unlisted = sorted(p.name for p in PAGES if p.resolve() not in listed and p != INDEX)
    assert not unlisted, f"pages missing from {INDEX.name}: {unlisted}"


# ---------------------------------------------------------------------------------------------
# The checkers catch what they should


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Planning under a budget", "planning-under-a-budget"),
        ("The policy: what is saved and what is replayed", "the-policy-what-is-saved-and-what-is-replayed"),
        ("Routing and collectives under `full`", "routing-and-collectives-under-full"),
        ("Qwen3-MoE routers and `norm_topk_prob`", "qwen3-moe-routers-and-norm_topk_prob"),
        ("Hugging Face's own gradient checkpointing", "hugging-faces-own-gradient-checkpointing"),
        ("Models and `--model`", "models-and---model"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_broken_links_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md#a-section) [also fine](#page) [web](https://example.com/x.md)\n"
        "`[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [self](#nope)\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert "missing.md: no such file" in problems[0]
    assert "#nowhere" in problems[1] and "#nope" in problems[2]


def test_exception_scan_follows_subclasses(tmp_path):
    (tmp_path / "errors.py").write_text(
        "import yaml\n"
        "class BaseProblem(RuntimeError): ...\n"
        "class Derived(BaseProblem): ...\n"
        "class FromYaml(yaml.YAMLError): ...\n"
        "class NotAnError: ...\n",
        encoding="utf-8",
    )
    assert exception_classes(tmp_path) == {"BaseProblem", "Derived", "FromYaml"}
