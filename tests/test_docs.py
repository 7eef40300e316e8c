"""The README and docs/: short README, every relative link resolves (files and #anchors), the project speaks of itself
only, and extending.md's marked examples are there and compile."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 140
SESSION_WORDING = re.compile(r"this session|session [0-9]|issue ?[0-9]{1,2}\b", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The text outside code blocks and code spans (`kernel[grid](...)` is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped except - and _, spaces to -."""
    out = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def relative_links(path: Path):
    for target in LINK.findall(_prose(path.read_text())):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            yield target


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move reference text to docs/"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_session_wording(path):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if SESSION_WORDING.search(line)]
    assert not hits, f"{path.relative_to(ROOT)} speaks of sessions or issue numbers:\n" + "\n".join(hits)


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in DOCS if p.parent.name == "docs" and p.name != "README.md" and f"({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_extending_examples_are_marked_and_compile():
    text = (ROOT / "docs" / "extending.md").read_text()
    blocks = dict((kind, code) for code, kind in re.findall(r"```python\n(# extending: (\w+)\n.*?)```", text, re.S))
    assert set(blocks) >= {"family", "dispatcher", "metric"}, sorted(blocks)
    for kind, code in blocks.items():
        compile(code, f"docs/extending.md ({kind})", "exec")
