"""``make screenshots``: the built docs site at 1280 px in headless Chromium.

Opens pages of a built site (``site/`` by default) in headless Chromium, driven through the
DevTools protocol over a pipe (no Python dependency beyond the standard library), and for
each page:

- takes screenshots of the regions named in ``SHOTS`` into the output folder;
- checks the layout: no code block scrolls sideways (clipped), no inline code in a table
  cell breaks in the middle of an identifier, the sidebar's title does not cover its first
  entry at any scroll position, and no image is wider than the content column.

Needs Chromium (Debian: ``apt-get install chromium``; or set ``CHROMIUM``). Prints every
problem and exits 1 if there is one. Usage::

    python ci/screenshots.py [SITE] [OUT]
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

WIDTH, HEIGHT = 1280, 900
# Pages and what to photograph on each: a CSS selector (the first match, scrolled into
# view; the shot is the viewport) or None for the top of the page.
SHOTS: dict[str, list[tuple[str, str | None]]] = {
    "index.html": [("top", None), ("neutral-names", "#the-neutral-api")],
    "recipes.html": [("top", None), ("nnx-recipe", "#flax-nnx")],
    "existing-libraries.html": [("compatibility", "#compatibility")],
    "model-authors.html": [("top", None)],
    "benchmark-report.html": [("top", None), ("core-chart", "#core")],
    "api.html": [("top", None)],
    "haiku.html": [("costs", "#costs-cpu-python-m-benchmarksbench_haiku")],
}
# Every other page is checked too, without screenshots.

LAYOUT_CHECKS = r"""
(() => {
  const problems = [];
  const where = (el) => (el.textContent || '').trim().slice(0, 60);
  for (const pre of document.querySelectorAll('.md-content pre > code')) {
    if (pre.scrollWidth > pre.clientWidth + 1) {
      const longest = Math.max(...pre.textContent.split('\n').map((l) => l.length));
      problems.push(`code block clipped (${pre.scrollWidth} > ${pre.clientWidth} px, ` +
                    `longest line ${longest} chars): ${where(pre)}`);
    }
  }
  const allowed = /[\s,/(\-]/;
  for (const code of document.querySelectorAll('.md-content td code')) {
    for (const node of code.childNodes) {
      if (node.nodeType !== Node.TEXT_NODE) continue;
      const text = node.textContent;
      const range = document.createRange();
      let top = null;
      for (let i = 0; i < text.length; i++) {
        range.setStart(node, i);
        range.setEnd(node, i + 1);
        const rect = range.getBoundingClientRect();
        if (rect.width === 0 && rect.height === 0) continue;
        if (top !== null && rect.top > top + rect.height / 2 && i > 0 &&
            !allowed.test(text[i - 1]) && !allowed.test(text[i])) {
          problems.push(`inline code broken mid-identifier in a table: "${text}" at ` +
                        `"${text.slice(Math.max(0, i - 8), i)}|${text.slice(i, i + 8)}"`);
          break;
        }
        top = rect.top;
      }
    }
  }
  for (const img of document.querySelectorAll('.md-content img')) {
    const column = img.closest('.md-content__inner').getBoundingClientRect().width;
    if (img.naturalWidth && img.getBoundingClientRect().width > column + 1) {
      problems.push(`image wider than the column: ${img.getAttribute('src')}`);
    }
  }
  return problems;
})()
"""

SIDEBAR_CHECK = r"""
(() => {
  const title = document.querySelector('.md-sidebar--primary .md-nav--primary > .md-nav__title');
  const first = document.querySelector(
    '.md-sidebar--primary .md-nav--primary > .md-nav__list > .md-nav__item > .md-nav__link');
  if (!title || !first) return [];
  const t = title.getBoundingClientRect(), f = first.getBoundingClientRect();
  const visible = getComputedStyle(title).display !== 'none' && t.height > 0;
  const overlap = visible && f.top < t.bottom - 1 && f.bottom > t.top + 1 &&
                  f.left < t.right && f.right > t.left;
  // Covered from above is fine while the list has scrolled under the title: compare the
  // scroll of the sidebar's own scroll container.
  const scroller = document.querySelector('.md-sidebar--primary .md-sidebar__scrollwrap');
  return overlap && (!scroller || scroller.scrollTop === 0)
    ? [`sidebar title (${Math.round(t.top)}-${Math.round(t.bottom)} px) overlaps ` +
       `"${first.textContent.trim()}" (${Math.round(f.top)}-${Math.round(f.bottom)} px)`]
    : [];
})()
"""


def _as_fds_3_and_4(reads: int, writes: int) -> None:
    """In the child: its commands on fd 3, its replies on fd 4 (whatever they were)."""
    reads, writes = os.dup(reads), os.dup(writes)  # neither is 3 or 4 now
    os.dup2(reads, 3)
    os.dup2(writes, 4)


class Browser:
    """Headless Chromium driven through ``--remote-debugging-pipe`` (fds 3 and 4)."""

    def __init__(self, executable: str) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="screenshots-")
        # The child reads commands on fd 3 and writes replies on fd 4.
        self._process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile}",
                f"--window-size={WIDTH},{HEIGHT}",
                "about:blank",
            ],
            close_fds=False,
            preexec_fn=lambda: _as_fds_3_and_4(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.page("Page.enable")
        self.page(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH,
            height=HEIGHT,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.call(method, self._session, **params)

    def open(self, url: str) -> None:
        self.page("Page.navigate", url=url)
        for _ in range(100):  # the theme's scripts and the fonts settle
            time.sleep(0.1)
            ready = self.evaluate("document.readyState === 'complete' && document.fonts.status")
            if ready == "loaded":
                break
        time.sleep(0.3)

    def evaluate(self, expression: str) -> Any:
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.page("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except RuntimeError:
            pass
        self._process.wait(timeout=30)
        shutil.rmtree(self._profile, ignore_errors=True)


SEARCH = r"""
(() => {
  const input = document.querySelector('.md-search__input');
  if (!input) return false;
  input.focus();
  input.value = 'interpose_on_import';
  input.dispatchEvent(new Event('input', {bubbles: true}));
  input.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true, key: 't'}));
  return true;
})()
"""


def search_results(browser: Browser, url: str) -> int:
    """How many pages the site's search finds for a word, typed on the page at ``url``."""
    browser.open(url)
    if not browser.evaluate(SEARCH):
        return 0
    for _ in range(50):
        time.sleep(0.2)
        found = browser.evaluate("document.querySelectorAll('.md-search-result__item').length")
        if found:
            return found
    return 0


def _serve(site: Path) -> ThreadingHTTPServer:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (found := shutil.which(name)):
            return found
    sys.exit("make screenshots needs Chromium: apt-get install chromium (or set CHROMIUM)")


def main() -> int:
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "site").resolve()
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "site-screenshots").resolve()
    if not (site / "index.html").is_file():
        sys.exit(f"no built site in {site}: run `make docs` first")
    out.mkdir(parents=True, exist_ok=True)
    browser = Browser(_chromium())
    problems: list[str] = []
    column = None
    try:
        pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
        for page in [p for p in pages if p != "404.html"]:
            browser.open((site / page).as_uri())
            if page == "index.html":
                column = browser.evaluate(
                    "document.querySelector('.md-content__inner').getBoundingClientRect().width"
                )
            found = [f"{page}: {p}" for p in browser.evaluate(LAYOUT_CHECKS)]
            for scroll in (0, 600, 3000):
                browser.evaluate(f"window.scrollTo(0, {scroll})")
                time.sleep(0.15)
                found += [
                    f"{page} (scrolled {scroll} px): {p}" for p in browser.evaluate(SIDEBAR_CHECK)
                ]
            problems += found
            for name, selector in SHOTS.get(page, []):
                if selector and not browser.evaluate(
                    f"!!document.querySelector({json.dumps(selector)})"
                ):
                    problems.append(f"{page}: nothing matches {selector} to photograph")
                    continue
                # From the top, down in one move (scrolling up shows the theme's
                # "Back to top" button), to just below the fixed header.
                browser.evaluate("window.scrollTo(0, 0)")
                time.sleep(0.2)
                if selector:
                    element = f"document.querySelector({json.dumps(selector)})"
                    browser.evaluate(
                        f"window.scrollTo(0, {element}.getBoundingClientRect().top - 56)"
                    )
                time.sleep(0.3)
                path = out / f"{Path(page).stem}-{name}.png"
                browser.screenshot(path)
                print(f"wrote {path}")
        # Search: served over HTTP it must work; from disk it also needs the theme's
        # iframe-worker shim, which the offline plugin loads from unpkg.com.
        server = _serve(site)
        try:
            port = server.server_address[1]
            served = search_results(browser, f"http://127.0.0.1:{port}/index.html")
            browser.screenshot(out / "search-served.png")
        finally:
            server.shutdown()
        if not served:
            problems.append("search finds nothing on the site served over HTTP")
        from_disk = search_results(browser, (site / "index.html").as_uri())
        print(
            f"search for interpose_on_import: {served} pages served over HTTP, "
            f"{from_disk} from disk (0 from disk means no network for the shim)"
        )
    finally:
        browser.close()
    print(f"content column: {column} px wide at {WIDTH} px")
    for problem in problems:
        print("LAYOUT:", problem)
    print(f"{len(problems)} layout problems at {WIDTH} px")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
