"""Every relative link in README.md and docs/*.md points at a file that exists and, with #anchor, at a heading
that exists: moving a page or renaming a heading breaks a link where a reader would follow it."""
import re
from pathlib import Path

from conftest import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`+[^`]*`+")


def pages(repo: Path) -> list:
    """The markdown files whose links are checked: the front page and every docs page."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def _prose(text: str):
    """The lines outside fenced code blocks, where a link or heading means something."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    """Every anchor the page's headings give, repeated headings numbered as GitHub numbers them."""
    seen, result = {}, set()
    for line in _prose(page.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(page: Path, root: Path) -> list:
    """'page: target (why)' for each relative link of the page that points at nothing."""
    problems = []
    for line in _prose(page.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^(https?:|mailto:)", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading with that anchor in {dest.name})")
    return problems


def test_every_relative_link_in_the_docs_points_at_something_that_exists():
    checked = pages(REPO)
    assert (REPO / "README.md") in checked and len(checked) > 1, "README.md and docs/*.md should be found"
    problems = [problem for page in checked for problem in broken_links(page, REPO)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "topic.md").write_text("# A topic\n\n## Where it's at: `here`\n\nBack to [front](../README.md).\n")
    (tmp_path / "README.md").write_text(
        "# Front\n\n[ok](docs/topic.md#where-its-at-here) [ok too](#front) [web](https://example.com/x.md)\n"
        "[gone](docs/missing.md) [no heading](docs/topic.md#nowhere) [no local heading](#back)\n"
        "`[in code](docs/missing-too.md)`\n\n```\n[in a block](docs/missing-three.md)\n```\n")
    problems = [p for page in pages(tmp_path) for p in broken_links(page, tmp_path)]
    assert problems == ["README.md: docs/missing.md (no such file)",
                        "README.md: docs/topic.md#nowhere (no heading with that anchor in topic.md)",
                        "README.md: #back (no heading with that anchor in README.md)"]
