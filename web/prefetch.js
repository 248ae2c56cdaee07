// Early downloads of a model folder's graphs, started by the worker while Python starts.
//
// Which graphs a folder needs is the core's decision (py/ortpipe/config, py/ortpipe/detect.py),
// made once Python runs, a second or more after the page asked for the model. Meanwhile this
// guesses the same files: every name in genai_config.json that ends in ".onnx", or, with no
// genai_config.json, the first of detection's candidates that exists; then the weight files beside
// each. Bridge.fetchBytes and Bridge.createSession take a download from here when the core asks for
// its URL, and Bridge.existsSync the answers of the probes. A wrong guess costs a download nobody
// takes, which `drop` aborts; it never changes what is loaded.

// py/ortpipe/detect.py's DECODER_FILES, in its order (tests/web/test_prefetch.py compares them).
export const DECODER_FILES = [
  'model.onnx', 'decoder_model_merged.onnx', 'decoder_model.onnx',
  'onnx/model.onnx', 'onnx/decoder_model_merged.onnx', 'onnx/decoder_model.onnx',
];
// py/ortpipe/targets/pyodide.py's EXTERNAL_DATA: weights stored beside a graph.
export const EXTERNAL_DATA = ['.data', '_data'];

export class Prefetch {
  /**
   * @param {string} base the model folder's URL, ending in "/"
   * @param {(url: string, name: string, signal: AbortSignal) => Promise<Uint8Array>} download
   *   fetches a file's bytes, reporting progress under `name`
   */
  constructor(base, download) {
    this.base = base;
    this.download = download;
    this.downloads = new Map(); // url -> Promise<Uint8Array | undefined>
    this.probed = new Map(); // url -> whether it exists
    this.abort = new AbortController();
    this.start().catch(() => {}); // a failed guess is no error: the core fetches what it needs itself
  }

  async start() {
    const config = await fetch(this.base + 'genai_config.json', { signal: this.abort.signal });
    let graphs;
    if (config.ok) {
      graphs = [...new Set(onnxNames(JSON.parse(await config.text())))];
    } else {
      const found = await Promise.all(DECODER_FILES.map((file) => this.exists(file)));
      graphs = DECODER_FILES.filter((_, i) => found[i]).slice(0, 1);
    }
    await Promise.all(graphs.map(async (file) => {
      if (!(this.known(this.base + file) ?? await this.exists(file))) return;
      this.fetch(file);
      const weights = EXTERNAL_DATA.map((suffix) => file + suffix);
      const found = await Promise.all(weights.map((name) => this.exists(name)));
      weights.filter((_, i) => found[i]).forEach((name) => this.fetch(name));
    }));
  }

  /** Whether `file` exists (a HEAD request), remembered for `known`. */
  async exists(file) {
    const url = this.base + file;
    const response = await fetch(url, { method: 'HEAD', signal: this.abort.signal });
    this.probed.set(url, response.ok);
    return response.ok;
  }

  fetch(file) {
    const url = this.base + file;
    const bytes = this.download(url, file, this.abort.signal).catch(() => undefined);
    this.downloads.set(url, bytes);
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

  /** Abort what nobody took. */
  drop() {
    this.abort.abort();
    this.downloads.clear();
  }
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
