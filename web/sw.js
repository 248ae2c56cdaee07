// The service worker that makes the bundle work offline. On install it downloads every file of
// asset-manifest.json (written by build/web.py), checks each against its SHA-256 and stores them in
// a cache named after the manifest's version; files unchanged since the previous version are
// copied from its cache instead. It then answers the bundle's requests from that cache, going to
// the network only for files the manifest does not list (model folders added after the build).
// On activate it deletes the caches of older versions.
//
// Every response it gives (from the cache or the network) carries the COOP/COEP headers that make
// the page cross-origin isolated, which threaded wasm needs: on a static host that sends no such
// headers, the page is isolated from its first load under this worker on (web/demo.js reloads once).

// build/web.py replaces "unbuilt" with the manifest's version: a rebuilt bundle changes this
// script, which is what makes the browser install the new version.
const BUNDLE_VERSION = "unbuilt";
const CACHE_PREFIX = 'ortpipe-';
const CACHE_NAME = `${CACHE_PREFIX}${BUNDLE_VERSION}`;
const MANIFEST = 'asset-manifest.json';
const DOWNLOAD_LANES = 4; // files downloaded at once while installing

const scope = () => self.registration.scope;
let manifestPromise = null; // this version's manifest, read back from the cache once

self.addEventListener('install', (event) => {
  event.waitUntil(precache().then(() => self.skipWaiting()));
});

self.addEventListener('activate', (event) => {
  event.waitUntil(deleteOldCaches().then(() => self.clients.claim()));
});

self.addEventListener('fetch', (event) => {
  const { request } = event;
  const path = bundlePath(request.url);
  if (path === null || (request.method !== 'GET' && request.method !== 'HEAD')) return;
  event.respondWith(respond(request, path).then(isolated));
});

// What `ortpipe web --coop` (ortpipe/static_server.py) sends: the page may share memory with its workers.
const ISOLATION_HEADERS = { 'Cross-Origin-Opener-Policy': 'same-origin', 'Cross-Origin-Embedder-Policy': 'require-corp' };

/** `response` with the isolation headers (a response the page cannot read is passed on as it is). */
function isolated(response) {
  if (response.type === 'opaque' || response.type === 'opaqueredirect' || response.status === 0) return response;
  const headers = new Headers(response.headers);
  for (const [name, value] of Object.entries(ISOLATION_HEADERS)) headers.set(name, value);
  return new Response(response.body, { status: response.status, statusText: response.statusText, headers });
}

/** Download, check and store every file of the manifest; any failure fails the install. */
async function precache() {
  const response = await fetch(new URL(MANIFEST, scope()), { cache: 'no-cache' });
  if (!response.ok) throw new Error(`${MANIFEST}: HTTP ${response.status}`);
  const manifest = await response.clone().json();
  if (manifest.version !== BUNDLE_VERSION) {
    throw new Error(`${MANIFEST} is version ${manifest.version}, sw.js ${BUNDLE_VERSION}: `
      + 'the bundle changed while installing');
  }
  const cache = await caches.open(CACHE_NAME);
  const previous = await previousVersions();
  await inLanes(Object.entries(manifest.files), DOWNLOAD_LANES, async ([path, hash]) => {
    if (await cache.match(fileUrl(path))) return; // stored by an install that was cut short
    await cache.put(fileUrl(path), await reuse(previous, path, hash) ?? await download(path, hash));
  });
  await cache.put(fileUrl(MANIFEST), response); // last: its presence means the cache is complete
}

/** A file's response, checked against its hash, as it will be stored. */
async function download(path, hash) {
  const response = await fetch(fileUrl(path), { cache: 'no-cache' });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  const body = await response.arrayBuffer();
  const got = await sha256(body);
  if (!got.startsWith(hash)) {
    throw new Error(`${path}: SHA-256 ${got.slice(0, hash.length)}, the manifest says ${hash}`);
  }
  return withBody(body, response);
}

/** The complete caches of older versions with their manifests, newest first. */
async function previousVersions() {
  const found = [];
  for (const name of (await olderCaches()).reverse()) {
    const cache = await caches.open(name);
    const stored = await cache.match(fileUrl(MANIFEST));
    if (stored) found.push({ cache, files: (await stored.json()).files });
  }
  return found;
}

/** The cached response of an older version with the same hash, if any. */
async function reuse(previous, path, hash) {
  for (const { cache, files } of previous) {
    if (files[path] === hash) {
      const response = await cache.match(fileUrl(path));
      if (response) return response;
    }
  }
  return null;
}

async function deleteOldCaches() {
  await Promise.all((await olderCaches()).map((name) => caches.delete(name)));
}

/** The names of other versions' caches, oldest first. */
async function olderCaches() {
  return (await caches.keys()).filter((name) => name.startsWith(CACHE_PREFIX) && name !== CACHE_NAME);
}

/**
 * Files of the manifest come from the cache (HEAD requests get its headers without the body).
 * Other files come from the network; when it is unreachable, a file in a folder the manifest
 * covers is answered 404, as the server would: the core probes for optional files.
 */
async function respond(request, path) {
  const manifest = await currentManifest();
  const file = path === '' ? 'index.html' : path;
  if (manifest?.files[file]) {
    const cached = await caches.match(fileUrl(file), { cacheName: CACHE_NAME });
    if (cached) return request.method === 'HEAD' ? withBody(null, cached) : cached;
  }
  try {
    return await fetch(request);
  } catch (error) {
    if (!manifest || !coversFolder(manifest, file)) throw error;
    return new Response(null, { status: 404, statusText: 'Not Found' });
  }
}

/** This version's manifest, or null while the cache is incomplete. */
function currentManifest() {
  manifestPromise ??= caches.match(fileUrl(MANIFEST), { cacheName: CACHE_NAME })
    .then((response) => response?.json() ?? null);
  return manifestPromise.then((manifest) => {
    if (manifest === null) manifestPromise = null; // try again on the next request
    return manifest;
  });
}

function coversFolder(manifest, file) {
  const folder = file.slice(0, file.lastIndexOf('/') + 1);
  return Object.keys(manifest.files).some((path) => path.startsWith(folder));
}

/** The path of `url` inside the service worker's scope ("" for the scope itself), else null. */
function bundlePath(url) {
  const { origin, pathname } = new URL(url);
  const base = new URL(scope());
  if (origin !== base.origin || !pathname.startsWith(base.pathname)) return null;
  return decodeURIComponent(pathname.slice(base.pathname.length));
}

const fileUrl = (path) => new URL(path.split('/').map(encodeURIComponent).join('/'), scope()).href;

/** A response with `body` and the status and headers of `response`. */
function withBody(body, { status, statusText, headers }) {
  return new Response(body, { status, statusText, headers });
}

async function sha256(buffer) {
  const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', buffer));
  return Array.from(digest, (byte) => byte.toString(16).padStart(2, '0')).join('');
}

/** Run `work` on every item, at most `lanes` at a time. */
async function inLanes(items, lanes, work) {
  const queue = [...items];
  const lane = async () => {
    while (queue.length) await work(queue.shift());
  };
  await Promise.all(Array.from({ length: Math.min(lanes, queue.length) }, lane));
}
