"""The documentation site builds with `mkdocs build --strict`: every page in the nav, no
broken link, no broken API reference, and every public name of actorshm documented."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import yaml  # mkdocs's own dependency: the 'test' extra brings both

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

def _nav_pages(nav) -> list[str]:
    out = []
    for entry in nav:
        if isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


# On Python 3.10 pip finds no pymdown-extensions that the mkdocstrings it picks can use
# (13.0 on need 3.11.5): the site is built on 3.11 and later.
needs_docs_toolchain = pytest.mark.skipif(
    sys.version_info < (3, 11, 5), reason="the docs toolchain needs Python 3.11.5 or later")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
         "--site-dir", str(site)],
        cwd=config.parent, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


def test_every_page_is_in_the_nav():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    missing = [p for p in pages if p not in nav]
    assert not missing, (f"docs pages not in the site's nav: {missing}; add a line "
                         "`- Title: page.md` under `nav:` in mkdocs.yml")
    gone = [p for p in nav if p not in pages]
    assert not gone, f"mkdocs.yml's nav names pages that do not exist: {gone}"


@needs_docs_toolchain
def test_site_builds_strict_and_documents_every_public_name(tmp_path):
    import actorshm
    p = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, "mkdocs build --strict failed:\n" + (p.stderr + p.stdout)[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    documented = set(re.findall(r'id="actorshm\.(\w+)"', api))
    undocumented = [n for n in actorshm.__all__ if n not in documented]
    assert not undocumented, (
        f"public names without an entry in the API reference: {undocumented}. A class or "
        "function in actorshm.__all__ needs a docstring; a submodule needs its own "
        "`::: actorshm.<name>` line in docs/api.md")
    assert (tmp_path / "site" / "index.html").exists()


@needs_docs_toolchain
def test_strict_build_fails_on_broken_link_and_reference(tmp_path):
    """The checks above mean something: the same config rejects a broken link and a
    reference to a name that does not exist, naming each."""
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "concepts.md", "a") as f:
        f.write("\nSee [the old page](no-such-page.md) and [run][actorshm.no_such_name].\n")
    p = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert p.returncode != 0
    assert "no-such-page.md" in p.stderr and "actorshm.no_such_name" in p.stderr, p.stderr
    assert "could not collect" not in p.stderr.lower(), p.stderr  # the API page still built


def test_committed_pictures_are_small_and_used():
    pages = "".join(p.read_text() for p in DOCS.rglob("*.md"))
    for png in DOCS.glob("*.png"):
        assert png.stat().st_size < 200_000, f"{png.name} is over 200 KB: redraw it smaller"
        assert f"]({png.name})" in pages, f"docs/{png.name} is not shown on any page"
