// Early downloads of a model folder's graphs, started by the worker while Python starts.
//
// Which graphs a folder needs is the core's decision (py/ortpipe/config, py/ortpipe/detect.py,
// py/ortpipe/variants.py), made once Python runs, a second or more after the page asked for the
// model. Meanwhile this guesses the same files: every name in genai_config.json that ends in
// ".onnx", or, with no genai_config.json, the first of detection's candidates that exists; of each,
// the variant the core will choose for the device (variants.js); then the weight files beside it.
// Once a graph and its weights are here, its session is created as well (`open`), with the options
// the core will ask for; the tokenizer files are read and the tokenizer made (`tokenizer`). The
// Bridge takes the downloads, sessions, probes' answers, small files and the tokenizer from here. A wrong guess costs a download or a
// session nobody takes, which `drop` aborts or releases; it never changes what is loaded.

import { chooseVariant, optimizedAhead, variantFiles } from './variants.js';

// py/ortpipe/detect.py's DECODER_FILES, in its order (tests/web/test_prefetch.py compares them).
export const DECODER_FILES = [
  'model.onnx', 'decoder_model_merged.onnx', 'decoder_model.onnx',
  'onnx/model.onnx', 'onnx/decoder_model_merged.onnx', 'onnx/decoder_model.onnx',
];
// py/ortpipe/targets/pyodide.py's EXTERNAL_DATA: weights stored beside a graph.
export const EXTERNAL_DATA = ['.data', '_data'];
// py/ortpipe/model.py's tokenizer files.
const TOKENIZER_FILES = ['tokenizer.json', 'tokenizer_config.json'];

export class Prefetch {
  /**
   * @param {string} base the model folder's URL, ending in "/"
   * @param {(url: string, name: string, signal: AbortSignal) => Promise<Uint8Array>} download
   *   fetches a file's bytes, reporting progress under `name`
   * @param {{device?: Promise<{device: string, f16: boolean}>, dtype?: string|Object<string, string>,
   *   open?: (file: string, bytes: Uint8Array, weights: {url: string, data: Uint8Array}[]) => Promise<object>}} [options]
   *   the device the model will run on, the dtype load() was given, and how to create a session
   */
  constructor(base, download, {
    device = Promise.resolve({ device: 'wasm', f16: true }), dtype = null, open = null, tokenizer = null,
  } = {}) {
    this.base = base;
    this.download = download;
    this.device = device;
    this.dtype = dtype;
    this.open = open;
    this.downloads = new Map(); // url -> Promise<Uint8Array | undefined>
    this.sessions = new Map(); // graph url -> {weights: [url], session: Promise<session | undefined>}
    this.probed = new Map(); // url -> whether it exists
    this.files = new Map(); // url -> the bytes of a small file, or null when it does not exist
    this.early = null; // {json, config, tokenizer}: made from the tokenizer files
    this.abort = new AbortController();
    this.started = this.start().catch(() => {}); // a failed guess is no error: the core fetches what it needs
    this.readTokenizer(tokenizer).catch(() => {});
  }

  /** Read tokenizer.json and tokenizer_config.json, and make the tokenizer (`make`) from them. */
  async readTokenizer(make) {
    const [json, config] = await Promise.all(TOKENIZER_FILES.map((name) => this.small(name)));
    if (json && make) this.early = { json, config, tokenizer: await make(json, config) };
  }

  /** A small file's text (its bytes kept for `ready`), or null when it does not exist. */
  async small(name) {
    const url = this.base + name;
    const response = await fetch(url, { signal: this.abort.signal });
    const bytes = response.ok ? new Uint8Array(await response.arrayBuffer()) : null;
    if (response.ok || response.status === 404) this.files.set(url, bytes);
    this.probed.set(url, response.ok);
    return bytes && new TextDecoder().decode(bytes);
  }

  /** The bytes of a small file read here (null: it does not exist); undefined if not read (yet). */
  ready(url) {
    return this.files.get(url);
  }

  /** The tokenizer made here, when made from these texts (the core read the same files). */
  tokenizer(json, config) {
    const early = this.early;
    return early && early.json === json && early.config === (config ?? null) ? early.tokenizer : undefined;
  }

  async start() {
    const config = await this.small('genai_config.json');
    let graphs;
    if (config) {
      graphs = configGraphs(JSON.parse(config));
    } else {
      const candidates = await Promise.all(DECODER_FILES.map((file) => this.variants(file)));
      const first = candidates.findIndex((found) => Object.keys(found).length);
      graphs = first < 0 ? [] : [{ file: DECODER_FILES[first], dtype: await this.configDtype(DECODER_FILES[first]) }];
    }
    const { device, f16 } = await this.device;
    await Promise.all(graphs.map(async ({ file, session, dtype }) => {
      const asked = typeof this.dtype === 'string' ? this.dtype : this.dtype?.[session];
      const chosen = chooseVariant(await this.variants(file), device, asked ?? dtype, f16);
      if (!chosen) return;
      const bytes = this.fetch(chosen);
      const names = EXTERNAL_DATA.map((suffix) => chosen + suffix);
      const found = await Promise.all(names.map((name) => this.exists(name)));
      const weights = names.filter((_, i) => found[i]).map((name) => ({ url: this.base + name, data: this.fetch(name) }));
      if (this.open) this.openEarly(chosen, bytes, weights);
    }));
  }

  /** Every variant of `file`'s graph that exists: dtype -> name. */
  async variants(file) {
    const names = Object.entries(variantFiles(file));
    const found = await Promise.all(names.map(([, name]) => this.known(this.base + name) ?? this.exists(name)));
    return Object.fromEntries(names.filter((_, i) => found[i]));
  }

  /** The dtype config.json's transformers.js_config names for a detected graph (as detect.py reads it). */
  async configDtype(file) {
    const text = await this.small('config.json');
    let dtype = text ? (JSON.parse(text) ?? {})['transformers.js_config']?.dtype : undefined;
    if (dtype && typeof dtype === 'object') dtype = dtype[variantFiles(file).fp32.slice(0, -5).split('/').pop()];
    return typeof dtype === 'string' && dtype !== 'auto' ? dtype : undefined;
  }

  /** Create the session of the downloaded graph `file` while Python starts (see `session`). */
  openEarly(file, bytes, weights) {
    const entry = { weights: weights.map(({ url }) => url), optimized: false, session: null };
    entry.session = (async () => {
      const graph = await bytes;
      const data = await Promise.all(weights.map(async ({ url, data }) => ({ url, data: await data })));
      if (!graph || data.some(({ data: d }) => !d) || this.abort.signal.aborted) return undefined;
      entry.optimized = optimizedAhead(graph, (await this.device).device); // as the core will ask
      return this.open(file, graph, data, entry.optimized);
    })().catch(() => undefined); // the core creates it again, and reports what fails
    this.sessions.set(this.base + file, entry);
  }

  /**
   * The session created early for the graph at `url` with these weight files and graph optimisation
   * (`optimized`: none, the graph's own), once; undefined when there is none (or it was made otherwise:
   * then it is released).
   */
  async session(url, weights, optimized = false) {
    const early = this.sessions.get(url);
    if (!early) return undefined;
    this.sessions.delete(url);
    const session = await early.session;
    if (early.weights.join() === weights.join() && early.optimized === optimized) return session;
    session?.release();
    return undefined;
  }

  /** Whether `file` exists (a HEAD request), remembered for `known`. */
  async exists(file) {
    const url = this.base + file;
    const response = await fetch(url, { method: 'HEAD', signal: this.abort.signal });
    this.probed.set(url, response.ok);
    return response.ok;
  }

  /** Start downloading `file`: the promise of its bytes (undefined if the download fails). */
  fetch(file) {
    const url = this.base + file;
    const bytes = this.download(url, file, this.abort.signal).catch(() => undefined);
    this.downloads.set(url, bytes);
    return bytes;
  }

  /** Whether `url` exists, if a probe here found out; else undefined. */
  known(url) {
    return this.probed.get(url);
  }

  /** The download of `url` (a promise of its bytes, or of undefined if it failed), once. */
  take(url) {
    const bytes = this.downloads.get(url);
    this.downloads.delete(url);
    return bytes;
  }

  /** Abort what nobody took, and release the sessions nobody took. */
  async drop() {
    this.abort.abort();
    this.downloads.clear();
    this.files.clear();
    this.early = null;
    const sessions = [...this.sessions.values()];
    this.sessions.clear();
    await Promise.all(sessions.map(async ({ session }) => (await session)?.release()));
  }
}

/** The graphs a parsed genai_config.json names: [{file, session, dtype}] (v2: its sessions' files
 * and dtypes; v1: every string naming an ONNX file). */
function configGraphs(config) {
  const sessions = config?.version === 2 ? config.pipeline?.sessions : null;
  const named = Object.entries(sessions && typeof sessions === 'object' ? sessions : {})
    .filter(([, spec]) => onnxNames(spec?.file).length)
    .map(([session, spec]) => ({ file: spec.file, session, dtype: typeof spec.dtype === 'string' ? spec.dtype : undefined }));
  return named.length ? named : [...new Set(onnxNames(config))].map((file) => ({ file }));
}

/** Every string in a parsed genai_config.json that names an ONNX file. */
function onnxNames(value) {
  if (typeof value === 'string') {
    const inside = !value.startsWith('/') && !value.split('/').includes('..'); // as the core requires
    return value.endsWith('.onnx') && inside ? [value] : [];
  }
  if (Array.isArray(value)) return value.flatMap(onnxNames);
  if (value && typeof value === 'object') return Object.values(value).flatMap(onnxNames);
  return [];
}
