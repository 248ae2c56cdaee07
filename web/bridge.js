// The JS half of ortpipe's Pyodide target (py/ortpipe/targets/pyodide.py): what Python asks of
// onnxruntime-web, the network and tokenizers.js. Python holds ort.Tensor and InferenceSession
// objects as proxies; typed arrays are made and read here, where they are cheap.

import { Picker, halfToFloat, NON_FINITE } from './sampling.js';

// The longest text a chat template may render (py/ortpipe/templates.py MAX_RENDERED).
const MAX_RENDERED = 1 << 20;

/** The template's own raise_exception: it refused the conversation. */
class TemplateRefusal extends Error {}

const ARRAYS = {
  float32: Float32Array, float64: Float64Array, float16: Uint16Array, // float16: IEEE half bits
  int64: BigInt64Array, uint64: BigUint64Array, int32: Int32Array, uint32: Uint32Array,
  int16: Int16Array, uint16: Uint16Array, int8: Int8Array, uint8: Uint8Array, bool: Uint8Array,
};

/** Typed array of `type` holding `values` (numbers or BigInts). */
export function typedArray(type, values) {
  const Array_ = ARRAYS[type];
  if (!Array_) throw new Error(`ortpipe cannot make ${type} tensors`);
  if (Array_ === BigInt64Array || Array_ === BigUint64Array) return Array_.from(values, (v) => BigInt(v));
  return Array_.from(values, Number);
}

export class Bridge {
  /**
   * @param {object} ort the onnxruntime-web module
   * @param {object} tokenizers the @huggingface/tokenizers module
   * @param {object} jinja the @huggingface/jinja module
   * @param {(progress: object) => void} onProgress
   * @param {() => Promise<object>} [wasmOrt] the wasm build of onnxruntime-web, for sessions on
   *   "wasm" when `ort` is the WebGPU build: that build's CPU kernels lack some types (float64 Cast)
   */
  constructor(ort, tokenizers, jinja, onProgress, wasmOrt = async () => ort) {
    this.ort = ort;
    this.wasmOrt = wasmOrt;
    this.tokenizers = tokenizers;
    this.jinja = jinja;
    this.onProgress = onProgress;
    this.prefetch = null; // the model folder's early downloads (web/prefetch.js), if the worker made them
    this.templates = []; // compiled chat templates, by id
    this.kernels = new Map(); // kernel name -> a promise of its session
    this.graphs = new Map(); // graph URL -> its bytes, read by Python and waiting for createSession
  }

  /**
   * Synchronous GET (workers only): for the small files the core reads while it loads a folder.
   * The bytes, or undefined (None in Python) when the server answers 404; Python decodes them.
   */
  fetchBytesSync(url) {
    const early = this.prefetch?.ready(url);
    if (early !== undefined) return early ?? undefined; // null: the prefetch found no such file
    const request = new XMLHttpRequest();
    request.open('GET', url, false);
    request.responseType = 'arraybuffer';
    request.send();
    if (request.status === 404) return undefined;
    if (request.status !== 200) throw new Error(`GET ${url}: HTTP ${request.status}`);
    return new Uint8Array(request.response);
  }

  /** Whether the server has `url` (a synchronous HEAD, unless the prefetch already asked). */
  existsSync(url) {
    const known = this.prefetch?.known(url);
    if (known !== undefined) return known;
    const request = new XMLHttpRequest();
    request.open('HEAD', url, false);
    request.send();
    return request.status === 200;
  }

  /** The bytes at `url`, reporting download progress under `name` (or the prefetch's download). */
  async fetchBytes(url, name) {
    return await this.prefetch?.take(url) ?? downloadBytes(url, name, this.onProgress);
  }

  /**
   * A graph's bytes, for Python to read its structure before the session is made; they are kept
   * for that session (createSession with the same URL), so the graph is downloaded once.
   */
  async readGraph(url) {
    const bytes = await this.fetchBytes(url, url.slice(url.lastIndexOf('/') + 1));
    this.graphs.set(url, bytes);
    return bytes;
  }

  /**
   * An InferenceSession from a model URL or from bytes (kernels).
   * @param {string|Uint8Array} source
   * @param {{name: string, device: string, gpuOutputs: boolean, externalData: string[]}} options
   *   gpuOutputs keeps every output on the GPU (WebGPU only); externalData lists the URLs of
   *   weight files beside the graph.
   */
  async createSession(source, options) {
    const ort = options.device === 'wasm' ? await this.wasmOrt() : this.ort;
    const optimized = Boolean(options.optimized);
    let bytes = source;
    if (typeof source === 'string') {
      const early = await this.prefetch?.session(source, options.externalData, optimized);
      bytes = early ? null : this.graphs.get(source) ?? await this.fetchBytes(source, options.name);
      this.graphs.delete(source);
      if (early) return early; // created while Python started, with these options
    }
    if (!options.kernel) this.onProgress({ phase: 'session', file: options.name });
    // the bytes, downloaded here when the prefetch has none (a draft model's): onnxruntime-web's own
    // download of a URL needs a file system its worker build lacks
    const externalData = await Promise.all(options.externalData.map(async (url) => ({
      url, data: await this.fetchBytes(url, url.slice(url.lastIndexOf('/') + 1)),
    })));
    return createInferenceSession(ort, bytes, sessionOptions(options.device, externalData, options.gpuOutputs, optimized));
  }

  /** The session's inputs and outputs as JSON: [{name, type, shape}], shape null when unknown. */
  signature(session) {
    const describe = (names, metadata) => names.map((name, i) => {
      const meta = metadata?.[i];
      return meta?.isTensor
        ? { name, type: meta.type, shape: meta.shape.length ? Array.from(meta.shape) : null }
        : { name, type: null, shape: null };
    });
    return JSON.stringify({
      inputs: describe(session.inputNames, session.inputMetadata),
      outputs: describe(session.outputNames, session.outputMetadata),
    });
  }

  /** Run `session` on tensors named `names`; the outputs named `outputs`, in that order. */
  async run(session, names, tensors, outputs) {
    const feeds = {};
    names.forEach((name, i) => { feeds[name] = tensors[i]; });
    const result = await session.run(feeds, outputs);
    return outputs.map((name) => result[name]);
  }

  /**
   * Runs one after another, each as `run` or `runKernel` takes it ([session or null, kernel name, graph,
   * device, names, tensors, outputs]): onnxruntime-web's wasm build fails two runs in flight at once
   * (measured with 1.30: two text encoders of one init level gave a TypeError from inside its run).
   */
  async runEach(calls) {
    const results = [];
    for (const [session, name, graph, device, names, tensors, outputs] of calls) {
      results.push(session
        ? await this.run(session, names, tensors, outputs)
        : await this.runKernel(name, graph, device, names, tensors, outputs));
    }
    return results;
  }

  tensor(type, values, dims) {
    return new this.ort.Tensor(type, typedArray(type, values), dims);
  }

  /** A tensor of `dims` filled with `value` (for float16, the IEEE half bits). */
  full(type, dims, value) {
    const Array_ = ARRAYS[type];
    if (!Array_) throw new Error(`ortpipe cannot make ${type} tensors`);
    const data = new Array_(dims.reduce((a, b) => a * b, 1));
    if (value) data.fill(Array_ === BigInt64Array || Array_ === BigUint64Array ? BigInt(value) : value);
    return new this.ort.Tensor(type, data, dims);
  }

  /**
   * The argmax_last kernel's twin for CPU float32 logits [batch, seq, vocab] -> int64 [batch]: the
   * first index of the maximum at the last position. A session run would cost more than the work.
   */
  argmaxLast(logits) {
    const [batch, seq, vocab] = logits.dims;
    const tokens = new BigInt64Array(batch);
    for (let b = 0; b < batch; b++) {
      tokens[b] = BigInt(argmaxRow(logits.data, (b * seq + seq - 1) * vocab, vocab));
    }
    return new this.ort.Tensor('int64', tokens, [batch]);
  }

  /**
   * The token the last row of `logits` gives as `pickJson` (the core's Pick, as JSON) selects it: a
   * request's first token, chosen as the Decoder's steps choose theirs (sampling.js).
   */
  async pickLast(logits, pickJson) {
    const vocab = logits.dims[logits.dims.length - 1];
    const data = logits.location === 'gpu-buffer' ? await logits.getData() : logits.data;
    return new Picker(JSON.parse(pickJson), vocab).select(data, data.length - vocab);
  }

  /** Fused greedy decode steps of one request on `session` (see Decoder below). */
  decoder(session, spec) {
    return new Decoder(this.ort, session, spec);
  }

  /** A small CPU tensor's values as numbers. */
  toList(tensor) {
    return Array.from(tensor.data, Number);
  }

  tokenizer(tokenizerJson, configJson) {
    return this.prefetch?.tokenizer(tokenizerJson, configJson)
      ?? new this.tokenizers.Tokenizer(JSON.parse(tokenizerJson), configJson ? JSON.parse(configJson) : {});
  }

  /** The text of a generation as it grows (TextStream below), decoded with `tokenizer`. */
  textStream(tokenizer, window, context) {
    return new TextStream(tokenizer, window, context);
  }

  /**
   * Compile a chat template with @huggingface/jinja: JSON {id} to render it by, or {error: {kind,
   * message}} (ortpipe.templates.TemplateFailure's kinds).
   */
  chatTemplate(source) {
    try {
      this.templates.push(new this.jinja.Template(source));
      return JSON.stringify({ id: this.templates.length - 1 });
    } catch (error) {
      return JSON.stringify({ error: { kind: 'syntax', message: String(error?.message ?? error).slice(0, 300) } });
    }
  }

  /** Render template `id` with the JSON context: JSON {text} or {error: {kind, message}}. */
  renderTemplate(id, contextJson) {
    const { Interpreter, Environment } = this.jinja;
    // The template's raise_exception must be told from any other error. Template.render declares
    // the library's own, which a context cannot replace: for this call, the interpreter replaces it.
    const refuse = new Environment().set('raise_exception', (message) => { throw new TemplateRefusal(String(message)); });
    const run = Interpreter.prototype.run;
    Interpreter.prototype.run = function runRefusing(program) {
      this.global.variables.set('raise_exception', refuse);
      return run.call(this, program);
    };
    try {
      const text = this.templates[id].render(JSON.parse(contextJson));
      if (text.length > MAX_RENDERED) {
        return JSON.stringify({ error: { kind: 'limit', message: `the output passed ${MAX_RENDERED} characters` } });
      }
      return JSON.stringify({ text });
    } catch (error) {
      const message = String(error?.message ?? error).slice(0, 300);
      return JSON.stringify({ error: { kind: error instanceof TemplateRefusal ? 'refused' : 'render', message } });
    } finally {
      Interpreter.prototype.run = run;
    }
  }

  /** Start making the session of kernel `name` from `graph` on `device` (a failure shows at its run). */
  warmKernel(name, graph, device) {
    const session = this.createSession(graph, { name, device, gpuOutputs: false, externalData: [], kernel: true });
    session.catch(() => {}); // a failure is reported by the run that awaits it
    this.kernels.set(name, session);
  }

  /**
   * Run the kernel session `name` (ortpipe's kernel graphs), made from `graph` (its bytes, given
   * on the first run only) on `device`: the outputs named `outputs`, in that order.
   */
  async runKernel(name, graph, device, names, tensors, outputs) {
    if (!this.kernels.has(name)) {
      if (!graph) throw new Error(`kernel ${name} has no session and no graph`);
      this.warmKernel(name, graph, device);
    }
    return this.run(await this.kernels.get(name), names, tensors, outputs);
  }
}

/**
 * The JS twin of the core's TextStream (py/ortpipe/tokenizer.py, which explains the method): text
 * deltas of a growing list of ids that never end inside a character, from the decoded window of
 * the latest `window` ids. Strings are sliced here in UTF-16 units and there in code points, but
 * only ever by the length of a prefix of the same string, so the deltas are the same.
 */
export class TextStream {
  constructor(tokenizer, window, context) {
    this.tokenizer = tokenizer;
    this.window = window;
    this.context = context;
    this.options = { skip_special_tokens: true, clean_up_tokenization_spaces: false }; // as JsTokenizer
    this.ids = [];
    this.start = 0;
    this.sent = '';
  }

  decodeWindow() {
    return this.tokenizer.decode(this.ids.slice(this.start), this.options);
  }

  push(token) {
    this.ids.push(token);
    const text = this.decodeWindow();
    if (text.endsWith('\ufffd') || !text.startsWith(this.sent)) return '';
    const delta = text.slice(this.sent.length);
    this.sent = text;
    if (this.ids.length - this.start > this.window) {
      this.start = this.ids.length - this.context;
      this.sent = this.decodeWindow();
    }
    return delta;
  }

  /** Each token's delta, as JSON (one string crosses into Python). */
  pushMany(...tokens) {
    return JSON.stringify(tokens.map((token) => this.push(token)));
  }

  flush() {
    const text = this.decodeWindow();
    const delta = text.startsWith(this.sent) ? text.slice(this.sent.length) : '';
    this.sent = text;
    return delta;
  }
}

/**
 * The options of every model session: `device`'s EP, all graph optimisations (none for a graph
 * `optimized` ahead for this device), the weight files ([{url, data}]: data a URL or the bytes),
 * outputs on the GPU when `gpuOutputs` (WebGPU). The worker's early sessions (web/prefetch.js) are
 * made with the same.
 */
export function sessionOptions(device, externalData, gpuOutputs, optimized = false) {
  const options = {
    executionProviders: [device],
    graphOptimizationLevel: optimized ? 'disabled' : 'all',
    logSeverityLevel: 3, // errors only: ortpipe reports what matters itself
    externalData: externalData.map(({ url, data }) => ({ path: url.slice(url.lastIndexOf('/') + 1), data })),
  };
  if (gpuOutputs) options.preferredOutputLocation = 'gpu-buffer';
  return options;
}

// onnxruntime-web module -> its latest session creation on WebGPU (settled either way)
const creatingOnGpu = new WeakMap();

/**
 * `ort.InferenceSession.create(bytes, options)`, one at a time on WebGPU: onnxruntime-web's WebGPU EP
 * refuses a session while another is being created ("another WebGPU EP inference session is being
 * created"), and the worker makes its early sessions, the core's and the kernels' concurrently.
 */
export function createInferenceSession(ort, bytes, options) {
  const gpu = options.executionProviders.some((ep) => (typeof ep === 'string' ? ep : ep.name) === 'webgpu');
  if (!gpu) return ort.InferenceSession.create(bytes, options);
  const previous = creatingOnGpu.get(ort) ?? Promise.resolve();
  const session = previous.then(() => ort.InferenceSession.create(bytes, options));
  creatingOnGpu.set(ort, session.catch(() => {}));
  return session;
}

/** The bytes at `url`, reporting download progress to `onProgress` under `name`. */
export async function downloadBytes(url, name, onProgress, signal = undefined) {
  const response = await fetch(url, { signal });
  if (!response.ok) throw new Error(`GET ${url}: HTTP ${response.status}`);
  const total = Number(response.headers.get('Content-Length')) || 0;
  const chunks = [];
  let loaded = 0;
  const reader = response.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    chunks.push(value);
    loaded += value.length;
    onProgress({ phase: 'download', file: name, loaded, total });
  }
  const bytes = new Uint8Array(loaded);
  let at = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, at);
    at += chunk.length;
  }
  return bytes;
}

/**
 * The first index of the largest of `vocab` values from `start` (float16 as IEEE half bits). A NaN
 * or an infinite maximum is an error, as under CPython (numpy's argmax picks the NaN).
 */
export function argmaxRow(data, start, vocab) {
  const row = data.subarray(start, start + vocab);
  const values = row instanceof Uint16Array ? Float32Array.from(row, halfToFloat) : row;
  let best = 0;
  let nan = values[0] !== values[0];
  for (let i = 1; i < vocab; i++) {
    if (values[i] > values[best]) best = i;
    else if (values[i] !== values[i]) nan = true;
  }
  if (nan || !Number.isFinite(values[best])) throw new Error(NON_FINITE);
  return best;
}


// How long one burst of decode steps may run before its tokens go back to Python (and on to the
// page): few enough crossings per token that they cost next to nothing, and text still arrives
// several times a second on the slowest models.
const BURST_MS = 50;

/**
 * Decode steps of one request on one decoder session, fused: the core's `Decode`
 * (py/ortpipe/execute/work.py). The KV cache lives here between steps (past name -> ort.Tensor,
 * each present becoming the next past, concat or shared buffer alike), so steps cross into
 * Python as token ids instead of a tensor proxy per cache entry, several steps at a time
 * (`burst`). Each step takes the argmax of its logits, or selects as the burst's pick says
 * (sampling.js). The Python driver reads the cache back through `current` when a generic run needs it.
 */
export class Decoder {
  /**
   * @param {{name: string, ids: [string, string], mask: [string, string]|null, positions: [string, string]|null,
   *   presents: Object<string, string>, outputs: string[], logits: string, vocab: number,
   *   capacity: number, eos: number[], gpu: boolean, grow: boolean}} spec names and dtypes of the
   *   session's decode feeds; `presents` maps each present output to its past input; a burst stops
   *   after a token in `eos`; `gpu`: outputs stay on the GPU; `grow`: a shared buffer
   *   (GroupQueryAttention's) is fed as a concat cache, only the positions it holds (see `narrow`).
   */
  constructor(ort, session, spec) {
    this.ort = ort;
    this.session = session;
    this.spec = spec;
    this.presents = Object.entries(spec.presents);
    this.others = spec.outputs.filter((name) => name !== spec.logits && !(name in spec.presents));
    this.cache = {};
    this.fixed = {}; // inputs fed the same tensor at every step of the request (Python owns them)
    this.eos = new Set(spec.eos);
    // one row of ones; the mask of a step is a view of its first past + 1 values
    this.ones = spec.mask ? typedArray(spec.mask[1], new Array(spec.capacity).fill(1)) : null;
  }

  /** Take over `tensors` as the cache entries `names`: from now on this decoder disposes them. */
  seed(names, tensors) {
    names.forEach((name, i) => this.put(name, tensors[i]));
  }

  /** Feed `tensors` as the inputs `names` at every step (an encoder-decoder's encoder states, mask, cache
   * branch flag and cross-attention cache); they stay Python's, never disposed here. */
  fix(names, tensors) {
    names.forEach((name, i) => { this.fixed[name] = tensors[i]; });
  }

  current(name) {
    return this.cache[name];
  }

  /** Make `tensor` the cache entry `name`, disposing the one it replaces (GPU buffers). */
  put(name, tensor) {
    const old = this.cache[name];
    if (this.spec.gpu && old && old !== tensor) old.dispose();
    this.cache[name] = tensor;
  }

  /** Forget the entry `name` (Python dropped it), disposing its GPU buffer. */
  drop(name) {
    this.put(name, undefined);
    delete this.cache[name];
  }

  /** Forget the entry `name` without disposing it: another owner took it. */
  forget(name) {
    delete this.cache[name];
  }

  /**
   * Steps from `token` at position `past`, each feeding the token the one before selected, until
   * `limit` tokens, an eos or BURST_MS: the selected tokens. `pick`: how each step selects (the
   * core's Pick), or null for the argmax.
   */
  async burst(token, past, limit, pick = null) {
    if (this.spec.grow) this.narrow(past);
    const tokens = [];
    const started = performance.now();
    this.picker = pick ? new Picker(pick, this.spec.vocab) : null;
    for (;;) {
      token = await this.step(token, past);
      tokens.push(token);
      const spent = performance.now() - started;
      if (tokens.length >= limit || this.eos.has(token) || spent >= BURST_MS) return tokens;
      past += 1;
    }
  }

  /**
   * Cut each buffer of the request's capacity down to the `past` positions it holds. onnxruntime-web
   * cannot write a present into its past in place: a step copies the whole buffer in and out, and
   * GroupQueryAttention copies it once more. Fed only the positions held, it returns a present one
   * position longer (the concat cache), so a step copies what it uses; on a 512-position buffer
   * that halves the demo model's decode time. The cache the core reads back is such a shorter
   * buffer, which GroupQueryAttention takes as well. Sliding-window rings are not of the capacity.
   */
  narrow(past) {
    for (const [name, tensor] of Object.entries(this.cache)) {
      const [batch, heads, length, size] = tensor.dims;
      if (tensor.dims.length !== 4 || length !== this.spec.capacity || length <= past) continue;
      const data = new tensor.data.constructor(batch * heads * past * size);
      for (let row = 0; row < batch * heads; row++) {
        data.set(tensor.data.subarray(row * length * size, (row * length + past) * size), row * past * size);
      }
      this.cache[name] = new this.ort.Tensor(tensor.type, data, [batch, heads, past, size]);
    }
  }

  /** One step: `token` at position `past`; the token selected from the logits' last row. */
  async step(token, past) {
    const { ids, mask, positions } = this.spec;
    const feeds = { ...this.fixed, ...this.cache };
    const { Tensor } = this.ort;
    feeds[ids[0]] = new Tensor(ids[1], typedArray(ids[1], [token]), [1, 1]);
    if (mask) feeds[mask[0]] = new Tensor(mask[1], this.ones.subarray(0, past + 1), [1, past + 1]);
    if (positions) feeds[positions[0]] = new Tensor(positions[1], typedArray(positions[1], [past]), [1, 1]);
    let result;
    try {
      result = await this.session.run(feeds, this.spec.outputs);
    } catch (cause) {
      const error = new Error(`session "${this.spec.name}" failed on a decode step at position ${past}: `
        + `${cause?.message ?? cause}`);
      error.name = 'OrtpipeError';
      throw error;
    }
    for (const [present, pastName] of this.presents) this.put(pastName, result[present]);
    const logits = result[this.spec.logits];
    const data = this.spec.gpu ? await logits.getData() : logits.data;
    if (this.spec.gpu) {
      logits.dispose();
      for (const name of this.others) result[name].dispose();
    }
    try {
      const start = data.length - this.spec.vocab;
      return this.picker ? this.picker.select(data, start) : argmaxRow(data, start, this.spec.vocab);
    } catch (cause) {
      const error = new Error(`session "${this.spec.name}" gave NaN or infinite logits on the decode step at `
        + `position ${past}: the model's weights or inputs are broken`);
      error.name = 'OrtpipeError';
      throw error;
    }

  }
}
