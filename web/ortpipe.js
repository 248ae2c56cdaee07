// ortpipe's embed API: run a generative ONNX model folder in the browser.
//
//   import { load } from './ortpipe.js';
//   const pipe = await load('models/tiny/', { device: 'auto', onProgress: console.log });
//   const { tokens, text, timings } = await pipe.generate({ prompt: 'def add(a, b):', maxNewTokens: 32 });
//   for await (const chunk of pipe.stream({ prompt: 'Hello' })) output.textContent += chunk.text;
//   const chat = await pipe.chat(); const reply = await chat.say('Hi!', { maxNewTokens: 64 });
//   const { image } = await sd.generate({ prompt: 'a red cube', numSteps: 20, seed: 1 });  // a diffusers folder
//   const { audio, samplingRate } = await tts.speak('Hello!');                              // a VITS folder
//   const { data, dims } = await embedder.embed(['one text', 'another']);                  // sentence-transformers
//   pipe.dispose();
//
// Each pipeline owns a Web Worker (worker.js) that runs Python (Pyodide) and onnxruntime-web; the
// page's thread only passes messages. Every file is loaded from this module's origin. A disposed
// pipeline's worker is kept for a while, its model unloaded, so that the next load() need not start
// Python again.

const WORKER_URL = new URL('./worker.js', import.meta.url);
const SPARE_WORKER_MS = 60_000; // how long a disposed pipeline's worker waits for the next load()

let spare = null; // {worker, timer}: an idle worker whose Python and onnxruntime-web are running

/** An error ortpipe reports: `name` is ConfigError (the model folder), GenerationError (the request), ... */
export class OrtpipeError extends Error {
  constructor({ name, message }) {
    super(message);
    this.name = name;
  }
}

/**
 * Load a model folder: a URL prefix holding genai_config.json (v1 or v2) and its ONNX files, or
 * an Optimum / transformers.js export (model.onnx or onnx/model.onnx beside config.json).
 * @param {string|URL} modelUrl the folder's URL, relative to the page or absolute
 * @param {{device?: 'auto'|'webgpu'|'wasm', dtype?: string|Object<string, string>, allowPlugins?: boolean,
 *   onProgress?: (p: Progress) => void}} [options]
 *   device: "auto" (the default) takes WebGPU when the browser has an adapter, else wasm.
 *   dtype: the model variant when the folder holds several exports of a graph (transformers.js's
 *   names: "fp32" model.onnx, "q8" model_quantized.onnx, "q4" model_q4.onnx, "fp16", "q4f16", ...),
 *   for every session or per session name; by default the device's fastest the folder has.
 *   allowPlugins: run the folder's plugin (pipeline.plugin, Python code from its wheel), if it has one;
 *   without it such a folder is refused.
 * @returns {Promise<Pipeline>}
 * @throws {OrtpipeError} when the folder cannot be run (a ConfigError lists every problem)
 */
export async function load(modelUrl, options = {}) {
  if (modelUrl instanceof URL) modelUrl = modelUrl.href;
  if (typeof modelUrl !== 'string' || !modelUrl) {
    throw new OrtpipeError({
      name: 'OrtpipeError', message: `load() takes the model folder's URL (a string or URL), not ${kindOf(modelUrl)}`,
    });
  }
  const { device: asked, dtype = null, allowPlugins = false, onProgress, ...unknown } = optionsObject(
    options, 'load()', 'OrtpipeError');
  const device = asked ?? 'auto'; // null, as undefined: the default
  const names = Object.keys(unknown);
  if (names.length) {
    throw new OrtpipeError({
      name: 'OrtpipeError',
      message: `load() takes device, dtype, allowPlugins and onProgress, not ${names.join(', ')}`,
    });
  }
  if (!['auto', 'wasm', 'webgpu'].includes(device)) { // checked here too: a function would not reach the worker
    const shown = typeof device === 'string' ? JSON.stringify(device) : typeof device;
    const message = `device must be "auto", "webgpu" or "wasm", not ${shown}`;
    throw new OrtpipeError({ name: 'OrtpipeError', message });
  }
  if (typeof allowPlugins !== 'boolean') {
    throw new OrtpipeError({ name: 'OrtpipeError', message: 'load(): allowPlugins must be true or false' });
  }
  const pipe = new Pipeline(takeWorker(), onProgress);
  const url = folderUrl(modelUrl);
  try {
    pipe.info = await pipe._call('load', { modelUrl: url, device, dtype, allowPlugins });
  } catch (error) {
    pipe.dispose();
    throw error;
  }
  return pipe;
}

/** A model folder's absolute URL, ending in "/": `url` is relative to the page or absolute. */
function folderUrl(url) {
  return new URL(url.endsWith('/') ? url : `${url}/`, globalThis.location?.href).href;
}

/** The spare worker if there is one, else a new worker. */
function takeWorker() {
  if (!spare) return new Worker(WORKER_URL, { type: 'module' });
  const { worker, timer } = spare;
  clearTimeout(timer);
  spare = null;
  return worker;
}

/** Keep an idle worker (its model unloaded) for the next load(), or stop it if one is kept already. */
function keepWorker(worker) {
  if (spare) {
    worker.terminate();
    return;
  }
  worker.postMessage({ type: 'unload' });
  const timer = setTimeout(() => {
    if (spare?.worker === worker) spare = null;
    worker.terminate();
  }, SPARE_WORKER_MS);
  spare = { worker, timer };
}

/** Whether this browser offers a WebGPU adapter (what device "auto" would pick). */
export async function webgpuAvailable() {
  return Boolean(await globalThis.navigator?.gpu?.requestAdapter().catch(() => null));
}

/** A loaded model. Create it with `load()`. Generations queue: one runs at a time. */
export class Pipeline {
  constructor(worker, onProgress) {
    /** What was loaded: {device, sessions, files, dtypes, eos, tokenizer, max_length, model_type, load_ms}. */
    this.info = null;
    this._worker = worker;
    this._onProgress = onProgress;
    this._calls = new Map(); // id -> {resolve, reject, onChunk}
    this._nextId = 1;
    this._idle = Promise.resolve(); // settles when the last generation queued has ended
    this._queued = 0; // generations asked for so far, numbered from 1
    this._running = 0; // the number of the generation the worker is running
    this._interruptedUpTo = 0; // queued generations up to this number start interrupted
    this._cancelled = new Set(); // queued generations whose stream was left before they started
    this._workerFailed = false; // a failed worker is never kept for the next load()
    worker.onmessage = ({ data }) => this._receive(data);
    worker.onerror = (event) => {
      this._workerFailed = true;
      this._failAll(new OrtpipeError({
        name: 'WorkerError',
        message: event.message || `the worker (${WORKER_URL}) failed to start: is it served as JavaScript?`,
      }));
    };
  }

  /**
   * Generate until eos, the length limit or `interrupt()`; for a folder whose loop makes no tokens
   * (single_pass, denoising), its named outputs (`result.outputs`, `result.image`, `result.audio`).
   * `options.onProgress` gets each denoising step ({phase: 'step', step, steps}).
   * @param {GenerateOptions} options
   * @returns {Promise<GenerateResult>}
   */
  generate(options) {
    return this._result(options);
  }

  /**
   * Speech for `text` from a text-to-speech folder (VITS, MMS-TTS).
   * @param {string} text
   * @returns {Promise<{audio: Float32Array, samplingRate: number}>}
   */
  async speak(text, options = {}) {
    const { audio } = await this._result(options, undefined, { prompt: text }, 'speak()');
    if (!audio) throw new OrtpipeError({ name: 'GenerationError', message: 'speak needs a folder whose output is audio' });
    return audio;
  }

  /**
   * Sentence embeddings (a sentence-transformers folder): float32 [texts, dim], pooled and normalised as
   * the folder says, or as `pooling` ('mean', 'cls', 'max', 'lasttoken') and `normalize` say; texts run
   * in batches of `batchSize`, padded.
   * @param {string|string[]} texts
   * @param {{batchSize?: number, pooling?: string, normalize?: boolean,
   *   onProgress?: (p: Progress) => void}} [options]
   * @returns {Promise<{data: Float32Array, dims: number[]}>}
   */
  async embed(texts, options = {}) {
    const { onProgress, ...given } = optionsObject(options, 'embed()');
    // every other key goes to the core, which refuses those it does not take
    const defined = Object.fromEntries(Object.entries({ texts, ...given }).filter(([, v]) => v !== undefined));
    const result = await this._enqueue(() => this._call('embed', { options: pythonOptions(defined) }, undefined,
      onProgress));
    const embedding = Object.values(result.outputs ?? {}).find((o) => o.kind === 'embedding');
    return { data: embedding.data, dims: embedding.dims };
  }

  /**
   * Generate, yielding each token as it comes: `{token, text}` (text is "" while a character or a
   * possible stop string is incomplete).
   * @param {GenerateOptions} options
   * @returns {AsyncGenerator<Chunk, GenerateResult>} the generator's return value is the result;
   *   leaving the loop early interrupts the generation
   */
  stream(options) {
    return this._chunks(options);
  }

  /**
   * A multi-turn chat over one KV cache, rendered with the folder's chat template: each turn runs
   * only its own new tokens. The settings (sampling, `maxLength` of the whole conversation) hold
   * for every turn.
   * @param {ChatOptions} [options]
   * @returns {Promise<Chat>}
   */
  async chat(options = {}) {
    const settings = pythonOptions(optionsObject(options, 'chat()'));
    const number = await this._enqueue(() => this._call('chat', { options: settings }));
    return new Chat(this, number);
  }

  async _result(options, chat, extra = {}, what = 'generate()') {
    const started = performance.now();
    let firstToken = null;
    const { call } = this._generate(options, () => { firstToken ??= performance.now(); }, chat, extra, what);
    return finish(await call, started, firstToken);
  }

  async *_chunks(options, chat, extra = {}, what = 'stream()') {
    const chunks = [];
    let wake = null;
    const started = performance.now();
    let firstToken = null;
    const { call, cancel } = this._generate(options, (chunk) => {
      firstToken ??= performance.now();
      chunks.push(chunk);
      wake?.();
    }, chat, extra, what);
    let settled = false;
    call.then(() => { settled = true; wake?.(); }, () => { settled = true; wake?.(); });
    try {
      while (true) {
        if (chunks.length) {
          yield chunks.shift();
        } else if (settled) {
          return finish(await call, started, firstToken);
        } else {
          await new Promise((resolve) => { wake = resolve; });
          wake = null;
        }
      }
    } finally {
      if (!settled) cancel();
    }
  }

  /**
   * Stop the running generation after the tokens being computed (greedy decode steps run in
   * bursts of up to 50 ms), and any generation queued behind it; their results say "interrupt".
   */
  interrupt() {
    this._interruptedUpTo = this._queued;
    this._worker?.postMessage({ type: 'interrupt' });
  }

  /**
   * Free the model's memory. The pipeline cannot be used afterwards. Its worker is stopped, or,
   * when no generation was running or queued, kept a while for the next `load()`.
   */
  dispose() {
    const worker = this._worker;
    if (!worker) return;
    this._worker = null; // the worker may serve another pipeline now: never message it again
    worker.onmessage = null;
    worker.onerror = null;
    const idle = this._calls.size === 0;
    this._failAll(disposedError());
    if (idle && !this._workerFailed) keepWorker(worker);
    else worker.terminate();
  }

  /**
   * Queue a generation: each waits for the one before to end. `cancel` interrupts this one only,
   * whether it runs or waits.
   */
  _generate(options, onChunk, chat, extra, what) {
    const { onProgress, ...given } = optionsObject(options, what); // a function stays on this side
    const twice = Object.keys(extra).find((key) => key in given); // speak(text, {prompt}), say(content, {content})
    if (twice) {
      const message = `${what} takes its text as its first argument, not ${twice} in its options`;
      throw new OrtpipeError({ name: 'GenerationError', message });
    }
    const rest = { ...given, ...extra };
    const number = ++this._queued;
    const call = this._enqueue(() => {
      this._running = number;
      const interrupted = number <= this._interruptedUpTo || this._cancelled.delete(number);
      const type = chat === undefined ? 'generate' : 'say'; // a chat's turn
      return this._call(type, { options: pythonOptions(rest), interrupted, chat }, onChunk, onProgress);
    });
    const cancel = () => {
      if (this._running === number) this._worker?.postMessage({ type: 'interrupt' });
      else this._cancelled.add(number);
    };
    return { call, cancel };
  }

  /** Run `start()` (a call to the worker) after everything queued before it has ended. */
  _enqueue(start) {
    const call = this._idle.then(start);
    this._idle = call.then(() => {}, () => {});
    return call;
  }

  _call(type, message, onChunk, onProgress) {
    if (!this._worker) return Promise.reject(disposedError());
    const id = this._nextId++;
    return new Promise((resolve, reject) => {
      this._calls.set(id, { resolve, reject, onChunk, onProgress });
      this._worker.postMessage({ type, id, ...message });
    });
  }

  _receive(data) {
    const call = this._calls.get(data.id);
    if (data.type === 'progress') {
      const { type, id, ...progress } = data;
      (call?.onProgress ?? this._onProgress)?.(progress);
      return;
    }
    if (!call) return;
    if (data.type === 'chunks') {
      for (const { token, text, stage } of data.chunks) {
        call.onChunk?.(stage === undefined ? { token, text } : { token, text, stage });
      }
      return;
    }
    this._calls.delete(data.id);
    if (data.type === 'result') call.resolve(data.value);
    else call.reject(new OrtpipeError(data.error));
  }

  _failAll(error) {
    for (const call of this._calls.values()) call.reject(error);
    this._calls.clear();
  }
}

/**
 * A conversation (Pipeline.chat). Turns, rewinds and the pipeline's other generations run one at a
 * time, in the order they were asked for.
 */
export class Chat {
  constructor(pipeline, number) {
    this._pipeline = pipeline;
    this._number = number;
  }

  /**
   * The reply to a user turn.
   * @param {string} content the user's message
   * @param {{maxNewTokens?: number}} [options]
   * @returns {Promise<GenerateResult>}
   */
  say(content, options = {}) {
    return this._pipeline._result(options, this._number, { content }, 'say()');
  }

  /**
   * The reply to a user turn, token by token, as `Pipeline.stream` gives them.
   * @returns {AsyncGenerator<Chunk, GenerateResult>}
   */
  stream(content, options = {}) {
    return this._pipeline._chunks(options, this._number, { content }, 'a chat\'s stream()');
  }

  /**
   * Drop the last turn: the user's message and the reply.
   * @returns {Promise<number[]>} the conversation's token ids after it
   */
  rewind() {
    const pipeline = this._pipeline;
    return pipeline._enqueue(() => pipeline._call('rewind', { chat: this._number }));
  }

  /** Forget the conversation (the pipeline stays). */
  dispose() {
    this._pipeline._worker?.postMessage({ type: 'closeChat', chat: this._number });
  }
}

const disposedError = () => new OrtpipeError({ name: 'OrtpipeError', message: 'the pipeline was disposed' });

/** What a value is, for a message: "a number", "an array", "a Date", "null". */
function kindOf(value) {
  if (value === null) return 'null';
  if (Array.isArray(value)) return 'an array';
  if (typeof value === 'object') return `a ${value.constructor?.name ?? 'object'}`;
  return `a ${typeof value}`;
}

/** A call's options: an object ({...}), or undefined or null for none; anything else is refused (a
 * number or a string spread to nothing, or to its characters' indexes), as an onProgress that is no
 * function is. */
function optionsObject(options, what, name = 'GenerationError') {
  if (options === undefined || options === null) return {};
  const prototype = typeof options === 'object' ? Object.getPrototypeOf(options) : undefined;
  if (prototype !== Object.prototype && prototype !== null) {
    const prompt = typeof options === 'string' && what === 'generate()';
    const hint = prompt ? ` (a prompt is {prompt: ${JSON.stringify(options.slice(0, 20))}})` : '';
    throw new OrtpipeError({ name, message: `${what} takes an options object, {...}, not ${kindOf(options)}${hint}` });
  }
  if (options.onProgress !== undefined && typeof options.onProgress !== 'function') {
    const found = kindOf(options.onProgress);
    throw new OrtpipeError({ name, message: `${what}: onProgress must be a function, not ${found}` });
  }
  return options;
}
const camelToSnake = (key) => key.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
const snakeToCamel = (key) => key.replace(/_([a-z])/g, (_, c) => c.toUpperCase());

// Options handed to the worker as they are (images, tensors); the others travel to Python as JSON.
const AS_GIVEN = new Set(['images', 'mask', 'inputs', 'latents']);

/** The JS options with Python's names (maxNewTokens -> max_new_tokens), image URLs made absolute. */
function pythonOptions(options) {
  const named = Object.fromEntries(Object.entries(options ?? {}).map(([k, v]) => {
    const key = camelToSnake(k);
    return [key, AS_GIVEN.has(key) ? v : jsonValue(key, v)];
  }));
  if (Array.isArray(named.images)) named.images = named.images.map(absoluteImageUrl);
  if (named.mask !== undefined && named.mask !== null) named.mask = absoluteImageUrl(named.mask);
  // a draft model folder is a URL relative to the page, as the model's is
  if (typeof named.draft_model === 'string' && named.draft_model) named.draft_model = folderUrl(named.draft_model);
  return named;
}

/**
 * An option's value as JSON carries it to Python: a typed array becomes an array of numbers (token ids
 * from a tokenizer), a BigInt a number. What JSON would drop or change without a word (NaN and
 * infinities become null, a Date a string) and what cannot travel at all (a function, a symbol) is a
 * GenerationError naming the option.
 */
function jsonValue(key, value) {
  const refuse = (what) => {
    throw new OrtpipeError({
      name: 'GenerationError',
      message: `${key} must be plain data (finite numbers, strings, booleans, null, arrays and objects of them), `
        + `not ${what}`,
    });
  };
  if (typeof value === 'bigint') {
    return Number.isSafeInteger(Number(value)) ? Number(value) : refuse(`the BigInt ${value}`);
  }
  if (typeof value === 'number') return Number.isFinite(value) ? value : refuse(String(value));
  if (typeof value === 'function' || typeof value === 'symbol') return refuse(`a ${typeof value}`);
  if (ArrayBuffer.isView(value) && !(value instanceof DataView)) return Array.from(value, (v) => jsonValue(key, v));
  if (Array.isArray(value)) return value.map((v) => jsonValue(key, v));
  if (value !== null && typeof value === 'object') {
    const prototype = Object.getPrototypeOf(value);
    if (prototype !== Object.prototype && prototype !== null) return refuse(`a ${value.constructor?.name ?? 'object'}`);
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, jsonValue(key, v)]));
  }
  return value;
}

/** A URL relative to the page, resolved here: the worker's base URL is its script's. A URL that does
 * not parse is left for the worker to report, naming the image. */
function absoluteImageUrl(source) {
  if (source instanceof URL) return source.href;
  if (typeof source !== 'string' || !URL.canParse(source, globalThis.location?.href)) return source;
  return new URL(source, globalThis.location?.href).href;
}

/** Python's result with JS names, plus what the page measured. */
function finish(result, started, firstToken) {
  const timings = Object.fromEntries(Object.entries(result.timings).map(([k, v]) => [snakeToCamel(k), v]));
  timings.totalMs = performance.now() - started;
  timings.firstTokenMs = firstToken === null ? null : firstToken - started;
  const finished = { tokens: result.tokens, text: result.text, finishReason: result.finish_reason, timings };
  if (result.language) finished.language = result.language;
  if (result.stages) {
    finished.stages = Object.fromEntries(Object.entries(result.stages).map(([name, stage]) => [
      name, { tokens: stage.tokens, finishReason: stage.finish_reason }]));
  }
  if (result.outputs) {
    finished.outputs = Object.fromEntries(Object.entries(result.outputs).map(([name, output]) => [
      name, Object.fromEntries(Object.entries(output).map(([k, v]) => [snakeToCamel(k), v]))]));
    const all = Object.values(finished.outputs);
    finished.image = all.find((o) => o.image)?.image;
    const audio = all.find((o) => o.audio);
    if (audio) finished.audio = { audio: audio.audio, samplingRate: audio.samplingRate };
  }
  return finished;
}
