"""The README and docs/ point at things that exist: every relative link's file and #anchor, and
every repository path the README names in backticks. The README stays a first page (at most
150 lines; measurements, references and operations live in docs/)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set:
    heads = [line.lstrip("#").strip() for line in page.read_text().splitlines()
             if re.match(r"#{1,6} ", line)]
    return {_slug(h) for h in heads}


def _prose(page: pathlib.Path) -> str:
    """The page without its indented code blocks (commands there are not links)."""
    return "\n".join(line for line in page.read_text().splitlines() if not line.startswith("    "))


def test_slug_matches_github():
    assert _slug("Tool use: a supervised warm start, then RL (`--config-name tool_use`)") == \
        "tool-use-a-supervised-warm-start-then-rl---config-name-tool_use"
    assert _slug("A first GPU run: the one-GPU check") == "a-first-gpu-run-the-one-gpu-check"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):
            continue                      # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_paths_exist():
    """Every `path/with/slash` or `*.py|*.yaml|*.md` the README names in backticks is a file or
    folder of the repository (placeholders such as benchmarks/NAME.py excepted)."""
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"(?<![\w/])((?:examples|recipes|tools|benchmarks|docs|tests|earl_megatron)"
                           r"/[\w./-]*[\w/])", text))
    assert "examples/agents/calculator_openai.py" in named and "recipes/config.yaml" in named
    missing = sorted(p for p in named if "NAME" not in p and not (ROOT / p).exists())
    assert not missing, missing


def test_readme_is_a_first_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
    text = "\n".join(lines)
    for command in ("make demo", "make test", "docs/architecture.md", "docs/measurements.md"):
        assert command in text
