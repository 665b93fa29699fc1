"""The built docs site as a reader sees it: headless Chromium opens it, checks it, and takes two screenshots.

    python -m mkdocs build --strict                        # site/
    python -m doctools.browser site docs/assets/screenshots  # refresh the screenshots the development page shows

``check_site`` serves the folder on 127.0.0.1 (the site's search and navigation need HTTP, not file://), opens
the home page and a concept page in Debian's ``chromium`` through Playwright (never a browser Playwright downloads),
and raises ``SiteError`` naming what a reader would miss: a page without its heading, an equation KaTeX did not
typeset, the experiment's plot not loaded.
"""

import argparse
import contextlib
import functools
import http.server
import pathlib
import threading

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
CONCEPT_PAGE = "concepts/attention/"
CONCEPT_PLOT = "scale_vs_dk.png"  # the attention_scale experiment's first plot
VIEWPORT = {"width": 1280, "height": 900}


class SiteError(AssertionError):
    """The built site does not show a reader what it should; the message says what and where."""


@contextlib.contextmanager
def serve(site_dir: pathlib.Path):
    """``site_dir`` over HTTP on a free port of 127.0.0.1; yields the base URL."""
    handler = functools.partial(QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def check_site(site_dir: pathlib.Path, screenshot_dir: pathlib.Path) -> dict:
    """Open the home page and a concept page of the built site in headless Chromium; raise SiteError on what is
    missing; save ``home.png`` and ``concept.png`` into ``screenshot_dir``. Returns what was measured."""
    from playwright.sync_api import sync_playwright

    site_dir, screenshot_dir = pathlib.Path(site_dir), pathlib.Path(screenshot_dir)
    if not (site_dir / "index.html").is_file():
        raise SiteError(f"{site_dir} has no index.html: build the site first (python -m mkdocs build --strict).")
    if not (site_dir / "assets" / "katex" / "katex.min.js").is_file():
        raise SiteError(f"{site_dir} has no assets/katex/katex.min.js: run `make katex` before building the site.")
    if not pathlib.Path(CHROMIUM).is_file():
        raise SiteError(f"No {CHROMIUM}: install Debian's chromium (apt-get install -y chromium); .ci/run does.")
    screenshot_dir.mkdir(parents=True, exist_ok=True)
    found = {}
    with serve(site_dir) as base, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            errors = []
            page.on("pageerror", lambda err: errors.append(str(err)))

            page.goto(base, wait_until="networkidle")
            heading = page.locator("article h1").first.inner_text()
            if "decoderlab" not in heading:
                raise SiteError(f"The home page's heading is {heading!r}, not decoderlab's.")
            found["home_tables"] = page.locator("article table").count()
            page.screenshot(path=str(screenshot_dir / "home.png"))

            page.goto(base + CONCEPT_PAGE, wait_until="networkidle")
            found["math"] = page.locator(".arithmatex").count()
            found["typeset"] = page.locator(".arithmatex .katex").count()
            found["katex_errors"] = page.locator(".katex-error").count()
            if found["math"] == 0:
                raise SiteError(f"{CONCEPT_PAGE} has no math (.arithmatex): the page lost its equations.")
            if found["typeset"] < found["math"] or found["katex_errors"]:
                raise SiteError(
                    f"{CONCEPT_PAGE}: {found['typeset']} of {found['math']} equations typeset by KaTeX, "
                    f"{found['katex_errors']} KaTeX errors."
                )
            plot = page.locator(f"img[src$='{CONCEPT_PLOT}']").first
            plot.scroll_into_view_if_needed()
            found["plot_width"] = plot.evaluate("img => img.complete ? img.naturalWidth : 0")
            if not found["plot_width"]:
                raise SiteError(f"{CONCEPT_PAGE}: the experiment's plot {CONCEPT_PLOT} did not load.")
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(screenshot_dir / "concept.png"))
            if errors:
                raise SiteError(f"JavaScript errors on the pages: {errors}")
        finally:
            browser.close()
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Check the built docs site in headless Chromium; save screenshots.")
    parser.add_argument("site_dir", type=pathlib.Path, help="the built site (mkdocs build)")
    parser.add_argument("screenshot_dir", type=pathlib.Path, help="where home.png and concept.png go")
    args = parser.parse_args(argv)
    print(check_site(args.site_dir, args.screenshot_dir))


if __name__ == "__main__":
    main()
