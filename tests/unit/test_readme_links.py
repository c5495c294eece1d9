"""The README's relative links point at files that exist (the docs site's own links are checked by
`mkdocs build --strict` in `make docs`, which does not read the README)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_relative_link_of_the_readme_exists():
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    relative = [link.split("#")[0] for link in links if not re.match(r"[a-z]+://|#|mailto:", link)]
    assert len(relative) >= 19  # the map of the docs
    missing = sorted({link for link in relative if not (ROOT / link).is_file()})
    assert missing == [], f"README.md links to files that don't exist: {missing}"
