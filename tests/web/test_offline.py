"""After one visit the demo page works with the server gone: its service worker (web/sw.js)
precaches the bundle of asset-manifest.json (build/web.py) and answers from that cache. The demo
page registers it once a model has loaded; the tests that need no model register it themselves.

Each test serves a bundle from a server of its own (so that it may shut it down) to a fresh
persistent browser profile. No page.route here: Playwright's routing and service workers interfere;
requests are watched through the context's request events.
"""

from __future__ import annotations

import functools
import json
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from build import web

import ortpipe
from ortpipe.static_server import BundleHandler

PROMPT = "def fib(n):"
NEW_TOKENS = 16

# Runs in the page once the service worker controls it: what its cache holds of the manifest.
CACHED = """async () => {
  const manifest = await (await fetch('asset-manifest.json')).json();
  const cache = await caches.open(`ortpipe-${manifest.version}`);
  const stored = new Set((await cache.keys()).map((request) => new URL(request.url).pathname.slice(1)));
  const missing = Object.keys(manifest.files).filter((path) => !stored.has(path));
  return {version: manifest.version, missing};
}"""

# Runs in the page: wait (up to a minute) until the only cache left is the one named.
UNTIL_ONLY_CACHE = """async (name) => {
  const deadline = Date.now() + 60_000;
  while ((await caches.keys()).join() !== name) {
    if (Date.now() > deadline) throw new Error(`caches: ${await caches.keys()}, not just ${name}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}"""


class RecordingHandler(BundleHandler):
    """Notes the path of every request it answers in its server's `paths`."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.server.paths.append(urlsplit(self.path).path)




@pytest.fixture
def serve() -> Iterator[Callable[[Path], tuple[ThreadingHTTPServer, str]]]:
    """Serve a bundle on a server of the test's own, which it may shut down; returns (server, URL).
    The server's `paths` lists what it was asked for."""
    servers = []

    def start(root: Path) -> tuple[ThreadingHTTPServer, str]:
        handler = functools.partial(RecordingHandler, directory=str(root), coop=False, quiet=True)
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.paths = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def profile(browser_type: Any, browser_type_launch_args: dict, tmp_path: Path) -> Iterator[Any]:
    """A fresh persistent browser profile: what a user's browser keeps between visits."""
    context = browser_type.launch_persistent_context(tmp_path / "profile", **browser_type_launch_args)
    yield context
    context.close()


def record_requests(context: Any) -> list[Any]:
    requests: list[Any] = []
    context.on("request", lambda request: requests.append(request))
    return requests


def first_page(context: Any) -> Any:
    return context.pages[0] if context.pages else context.new_page()


def install(context: Any, url: str) -> Any:
    """Open the demo page, register the service worker and wait until it controls the page: its
    install, which precaches the bundle, has succeeded."""
    page = first_page(context)
    page.goto(url)
    page.evaluate("navigator.serviceWorker.register('sw.js')")
    page.wait_for_function("navigator.serviceWorker.controller !== null", timeout=60_000)
    return page


def generate(page: Any) -> dict[str, str]:
    """Generate on the demo page as a user would; the tokens and the text (prompt included)."""
    # The page fills in the first bundled model once it has read models/index.json: wait for that
    # (and for the browser's restoring of the form after a reload) before typing over it.
    page.wait_for_function("document.querySelectorAll('#models option').length > 0")
    page.fill("#model-url", "models/v2/")

    page.select_option("#device", "wasm")
    page.fill("#prompt", PROMPT)
    page.fill("#max-new-tokens", str(NEW_TOKENS))
    page.click("#generate")
    page.wait_for_selector("#output[data-tokens], #error:not(:empty)", timeout=120_000)
    assert page.text_content("#error") == ""
    return {"tokens": page.get_attribute("#output", "data-tokens"), "text": page.text_content("#output")}


def stop(server: ThreadingHTTPServer, url: str) -> None:
    """Shut the server down and check that nothing answers on its port any more."""
    server.shutdown()
    server.server_close()
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port), timeout=5):
        pass


def test_the_page_generates_offline_after_one_visit(profile: Any, serve: Any, bundle: Path,
                                                     models: dict[str, Path]) -> None:
    expected = ortpipe.load(models["v2"]).generate(PROMPT, max_new_tokens=NEW_TOKENS)
    server, url = serve(bundle)
    requests = record_requests(profile)
    page = first_page(profile)
    page.goto(url)
    online = generate(page)
    assert online == {"tokens": ",".join(map(str, expected.tokens)), "text": PROMPT + expected.text}
    page.wait_for_function("document.getElementById('offline').textContent === 'Works offline'",
                           timeout=60_000)
    manifest = json.loads((bundle / web.ASSET_MANIFEST).read_text())
    assert page.evaluate(CACHED) == {"version": manifest["version"], "missing": []}

    stop(server, url)
    seen_online = len(requests)
    page.reload()
    offline = generate(page)
    assert offline == online

    assert_same_origin([r.url for r in requests], url)
    # What the page and its worker asked for after the reload (not the service worker's own tries).
    after = [r for r in requests[seen_online:] if r.service_worker is None]
    assert any(r.url.endswith("pyodide.asm.wasm") for r in after), "no request for Pyodide after the reload"
    unanswered = [r.url for r in after if not (r.response() and r.response().from_service_worker)]
    assert not unanswered, f"requests the service worker did not answer: {unanswered}"


def test_a_rebuilt_bundle_replaces_the_cache_downloading_only_what_changed(
        profile: Any, serve: Any, bundle: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(bundle, tmp_path / "web")
    old = web.write_asset_manifest(copy)["version"]  # other tests may have added model folders
    server, url = serve(copy)
    requests = record_requests(profile)
    page = install(profile, url)
    assert page.evaluate(CACHED) == {"version": old, "missing": []}

    (copy / "models" / "index.json").write_text('["v2"]\n')
    new = web.write_asset_manifest(copy)["version"]
    assert new != old
    seen = len(server.paths)
    page.reload()
    page.evaluate(UNTIL_ONLY_CACHE, f"ortpipe-{new}")

    assert set(server.paths[seen:]) == {"/sw.js", "/asset-manifest.json", "/models/index.json"}
    assert page.evaluate(CACHED) == {"version": new, "missing": []}
    page.wait_for_function("document.getElementById('offline').textContent.startsWith('A new version')")
    assert_same_origin([r.url for r in requests], url)


def test_the_bundle_is_an_installable_app(profile: Any, serve: Any, bundle: Path) -> None:
    """Chromium's own check: a web app manifest with a usable icon, a service worker, a secure origin."""
    _, url = serve(bundle)
    requests = record_requests(profile)
    page = install(profile, url)
    cdp = profile.new_cdp_session(page)
    manifest = cdp.send("Page.getAppManifest")
    assert manifest["errors"] == []
    assert json.loads(manifest["data"])["display"] == "standalone"
    assert cdp.send("Page.getInstallabilityErrors")["installabilityErrors"] == []
    assert_same_origin([r.url for r in requests], url)


def assert_same_origin(urls: list[str], page_url: str) -> None:
    origin = urlsplit(page_url)[:2]
    assert urls, "no request was recorded"
    strays = [u for u in urls if urlsplit(u)[:2] != origin and not u.startswith(("data:", "blob:"))]
    assert not strays, f"requests left {origin}: {strays}"


def test_a_static_host_gets_cross_origin_isolation_from_the_service_worker(
        profile: Any, serve: Any, bundle: Path, models: dict[str, Path]) -> None:
    """A server that sends no COOP/COEP headers (a static host): the demo page registers sw.js at
    once, which adds them, and reloads itself once it is in control; wasm then runs threaded.
    (Loopback hosts opt in with ?isolate=1: `ortpipe web --coop` sends the headers itself.)"""
    expected = ortpipe.load(models["v2"]).generate(prompt_ids=[5, 17, 42, 8], max_new_tokens=NEW_TOKENS)
    _, url = serve(bundle)
    page = first_page(profile)
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: frame == page.main_frame and navigations.append(frame.url))
    page.goto(f"{url}?isolate=1")
    page.wait_for_function("self.crossOriginIsolated", timeout=120_000)
    assert navigations == [f"{url}?isolate=1"] * 2  # the first load, and the one reload
    got = page.evaluate("""async (maxNewTokens) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load('models/v2/', {device: 'wasm'});
      const {tokens} = await pipe.generate({promptIds: [5, 17, 42, 8], maxNewTokens});
      const threads = pipe.info.threads;
      pipe.dispose();
      return {tokens, threads, cores: navigator.hardwareConcurrency};
    }""", NEW_TOKENS)
    assert got["tokens"] == expected.tokens
    assert got["threads"] == min(4, got["cores"]) and got["threads"] > 1
    page.goto(url)  # no ?isolate=1 on a loopback host: no reload, and isolated all the same (sw.js's headers)
    assert page.evaluate("self.crossOriginIsolated")
