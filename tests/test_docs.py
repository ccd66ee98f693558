"""The docs cannot drift from the code: the site builds with warnings as errors, every code block marked
runnable runs, no internal link is broken, the README stays short, and a newcomer's pages render in a
real browser with navigation and search."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUNNABLE = re.compile(r"<!-- runnable -->\s*```python\n(.*?)```", re.S)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """`mkdocs build --strict`: any warning (a broken link, a page outside the nav, an unresolved API
    reference) fails the build. Each test process builds into its own folder, so one xdist worker's build
    never empties the site another is serving."""
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)], cwd=ROOT,
                          capture_output=True, text=True, env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder


def test_the_docs_build_with_warnings_as_errors(site):
    for page in ("index.html", "getting-started/index.html", "api/index.html", "cli/index.html",
                 "results/index.html", "results/2026-11-25-worker-fairness/index.html"):
        assert (site / page).exists(), page
    cli = (site / "cli" / "index.html").read_text()
    assert "specbench worker" in cli and "--slice-tokens" in cli  # generated from the parser, not copied


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
                                        if RUNNABLE.search(p.read_text())))
def test_runnable_blocks_run(page):
    """Each page's runnable blocks, in order, in one namespace per page."""
    namespace = {}
    for block in RUNNABLE.findall((DOCS / page).read_text()):
        exec(compile(block, f"docs/{page}", "exec"), namespace)


def test_no_internal_link_is_broken(site):
    """Every relative link of the built site resolves to a file (mkdocs checks the Markdown; this checks
    what it wrote, hooks' pages included), and every relative link of the README to a file of the repo."""
    broken = []
    for html in site.rglob("*.html"):
        for target in re.findall(r'href="([^"#:?]+)(?:#[^"]*)?"', html.read_text()):
            if target.startswith(("/", "//")):
                continue
            path = (html.parent / target).resolve()
            if not (path.exists() or (path / "index.html").exists()):
                broken.append((html.relative_to(site).as_posix(), target))
    assert not broken, broken[:20]
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert (ROOT / target).exists(), f"README links to missing {target}"


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)


def test_a_newcomers_pages_render_with_navigation_and_search(site):
    """Home, getting started and the API page of `run`, in headless Chromium over HTTP (the search index
    is fetched, which file:// forbids)."""
    import shutil

    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs Debian's chromium and chromium-driver (make setup installs them)")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from specbench.worker.launch import free_port
    from test_browser import SHOTS

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    browser = _browser()
    try:
        time.sleep(1)
        SHOTS.mkdir(parents=True, exist_ok=True)
        for page, expected in (("", "speculative decoding"), ("getting-started/", "Two commands"),
                               ("api/", "specbench.api.run")):
            browser.get(f"http://127.0.0.1:{port}/{page}")
            body = browser.find_element(By.TAG_NAME, "body").text
            assert expected in body, (page, body[:500])
            nav = browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link")
            assert len(nav) >= 15, len(nav)
            browser.save_screenshot(str(SHOTS / f"docs_{page.strip('/') or 'home'}.png"))
        browser.find_element(By.CSS_SELECTOR, "label.md-search__icon, .md-search__input").click()
        search = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
        search.send_keys("slice tokens")
        deadline, hits = time.time() + 20, []
        while time.time() < deadline and not hits:
            hits = browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
            time.sleep(0.25)
        assert hits, "search found nothing for 'slice tokens'"
        browser.save_screenshot(str(SHOTS / "docs_search.png"))
        search.send_keys(Keys.ESCAPE)
    finally:
        browser.quit()
        server.terminate()


def _browser():
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
