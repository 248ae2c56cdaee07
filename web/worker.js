// The module Web Worker behind ortpipe.js. It boots Pyodide and onnxruntime-web from this origin,
// loads a model with ortpipe's Pyodide target (py/ortpipe/targets/pyodide.py) and streams the
// generated tokens back. Messages in: load, generate (a chat's turn too), chat, rewind, closeChat,
// interrupt, unload. Messages out: progress, chunks, result, error; each reply carries the id of the
// message it answers. After `unload` the worker can load another model without starting Python
// and onnxruntime-web again.

import { Bridge, downloadBytes } from './bridge.js';
import { decodeImages } from './images.js';
import { Prefetch } from './prefetch.js';

// One onnxruntime-web build per device (see build/web.py).
const ORT_BUILDS = { wasm: './ort/ort.wasm.min.mjs', webgpu: './ort/ort.webgpu.min.mjs' };
// Python's memory after start-up with ortpipe imported, made by build/python_snapshot.mjs.
const SNAPSHOT = './pyodide/python-snapshot.bin';
// A one-node graph (ortpipe's argmax kernel, copied by build/web.py). onnxruntime-web fetches and
// compiles its wasm at its first session: this one makes that happen while Python starts.
const ORT_START_MODEL = './ort/start.onnx';
// Errors ortpipe raises on purpose: their message is for the user, the traceback is not.
const ORTPIPE_ERRORS = new Set(['ConfigError', 'GenerationError', 'OrtpipeError']);

let pipe = null; // the Python WebPipeline, once loaded
let bridge = null; // the bridge the loaded model's sessions were made with
let active = null; // the Python Request being generated (or made: its images being preprocessed)
const chats = new Map(); // chat number -> the Python Chat (WebPipeline.chat)
let chatsMade = 0;
// Started once and kept across models (promises; forgotten when they fail, to be tried again).
let pythonStarted = null; // Pyodide with ortpipe unpacked
const ortStarted = {}; // device -> the onnxruntime-web module

const here = (path) => new URL(path, import.meta.url).href;
const progress = (event) => self.postMessage({ type: 'progress', ...event });

self.onmessage = ({ data }) => {
  if (data.type === 'load') answer(data.id, () => load(data.modelUrl, data.device));
  else if (data.type === 'generate') {
    answer(data.id, () => generate(data.id, data.options, data.interrupted, data.chat));
  } else if (data.type === 'chat') answer(data.id, () => openChat(data.options));
  else if (data.type === 'rewind') answer(data.id, () => rewindChat(data.chat));
  else if (data.type === 'closeChat') closeChat(data.chat);
  else if (data.type === 'interrupt') active?.interrupt();
  else if (data.type === 'unload') unload().catch((error) => console.error(error));
};

/** A Bridge that remembers its sessions, so that unloading a model can release them. */
class ModelBridge extends Bridge {
  sessions = [];

  async createSession(source, options) {
    const session = await super.createSession(source, options);
    this.sessions.push(session);
    return session;
  }

  async release() {
    await Promise.all(this.sessions.map((session) => session.release()));
    this.sessions = [];
  }
}

async function answer(id, work) {
  try {
    self.postMessage({ type: 'result', id, value: await work() });
  } catch (error) {
    self.postMessage({ type: 'error', id, error: describeError(error) });
  }
}

/** A plain {name, message} for the page; Python errors lose their traceback unless unexpected. */
function describeError(error) {
  if (error?.type && ORTPIPE_ERRORS.has(error.type)) {
    // The traceback ends with "ortpipe.errors.ConfigError: <message, maybe several lines>".
    const head = new RegExp(`(?:^|\\n)(?:[\\w.]+\\.)?${error.type}: `, 'g');
    const last = [...error.message.matchAll(head)].at(-1);
    const message = last ? error.message.slice(last.index + last[0].length) : error.message;
    return { name: error.type, message: message.trim() };
  }
  console.error(error);
  return { name: error?.type ?? error?.name ?? 'Error', message: String(error?.message ?? error) };
}

async function load(modelUrl, device) {
  if (pipe) throw new Error('this worker already holds a model; load() another pipeline instead');
  // The model's graphs start downloading now, while Python and onnxruntime-web start (modelUrl is
  // absolute and ends in "/": ortpipe.js's load made it so).
  const prefetch = new Prefetch(modelUrl, (url, name, signal) => downloadBytes(url, name, progress, signal));
  try {
    const resolved = await resolveDevice(device);
    const [python, ort, tokenizers, jinja] = await runtime(resolved);
    const modelBridge = new ModelBridge(ort, tokenizers, jinja, progress, () => ortBuild('wasm'));
    modelBridge.prefetch = prefetch;
    const target = python.pyimport('ortpipe.targets.pyodide');
    try {
      pipe = await target.load(modelBridge, modelUrl, resolved);
      bridge = modelBridge;
    } catch (error) {
      await modelBridge.release();
      throw error;
    } finally {
      target.destroy();
    }
  } finally {
    prefetch.drop(); // what the core did not take; its probes' answers stay true
  }
  progress({ phase: 'ready', message: 'Ready' });
  return JSON.parse(pipe.info_json());
}

/** Python, onnxruntime-web for `device`, tokenizers.js and jinja: started by the first load only. */
function runtime(device) {
  if (!pythonStarted || !ortStarted[device]) {
    progress({ phase: 'runtime', message: `Starting Python and onnxruntime-web (${device})` });
  }
  pythonStarted ??= forgetOnFailure(startPython(), () => { pythonStarted = null; });
  return Promise.all([
    pythonStarted, ortBuild(device), import('./vendor/tokenizers.mjs'), import('./vendor/jinja.mjs'),
  ]);
}

/** The onnxruntime-web build for `device`, imported once. */
function ortBuild(device) {
  ortStarted[device] ??= forgetOnFailure(import(ORT_BUILDS[device]).then(configureOrt), () => {
    delete ortStarted[device];
  });
  return ortStarted[device];
}

/** A chat over the loaded model (settings for every turn: sampling, max_length); its number. */
function openChat(options) {
  if (!pipe) throw new Error('no model is loaded');
  chats.set(++chatsMade, pipe.chat_json(JSON.stringify(options)));
  return chatsMade;
}

function chatNumbered(number) {
  const chat = chats.get(number);
  if (!chat) throw new Error('this chat was disposed');
  return chat;
}

/** Drop the chat's last turn; the conversation's ids after it. */
async function rewindChat(number) {
  const chat = chatNumbered(number);
  await pipe.rewind(chat);
  return JSON.parse(pipe.chat_tokens_json(chat));
}

function closeChat(number) {
  chats.get(number)?.destroy();
  chats.delete(number);
}

/** Drop the model and release its sessions; Python and onnxruntime-web stay for the next one. */
async function unload() {
  const [oldPipe, oldBridge] = [pipe, bridge];
  for (const number of [...chats.keys()]) closeChat(number);
  pipe = null;
  bridge = null;
  oldPipe?.destroy();
  await oldBridge?.release();
}

/** `promise`, after arranging for `forget()` to run if it rejects. */
function forgetOnFailure(promise, forget) {
  promise.catch(forget);
  return promise;
}

/** "wasm" or "webgpu": "auto" takes WebGPU when the browser has an adapter. */
async function resolveDevice(device) {
  if (!['auto', 'wasm', 'webgpu'].includes(device)) {
    throw new Error(`device must be "auto", "webgpu" or "wasm", not ${JSON.stringify(device)}`);
  }
  if (device === 'wasm') return 'wasm';
  const adapter = await navigator.gpu?.requestAdapter().catch(() => null);
  if (adapter) return 'webgpu';
  if (device === 'webgpu') {
    throw new Error('WebGPU is not available in this browser (no GPU adapter); use device "wasm" or "auto"');
  }
  return 'wasm';
}

/** Pyodide with ortpipe's package unpacked into its site-packages, started from the bundle's memory
 * snapshot (build/python_snapshot.mjs): the interpreter comes up with ortpipe already imported.
 * `_loadSnapshot` is a private option of Pyodide's loader, hence the exact version in package.json. */
async function startPython() {
  const { loadPyodide } = await import('./pyodide/pyodide.mjs');
  const [python, zip] = await Promise.all([
    loadPyodide({ indexURL: here('./pyodide/'), _loadSnapshot: snapshot() }),
    bundleFile('./ortpipe.zip'),
  ]);
  // The snapshot holds memory, not files: ortpipe's kernels and modules it imports later are read
  // from site-packages. And Python's `random` would start from the build's seed on every page.
  const sitePackages = python.runPython("import sysconfig; sysconfig.get_path('purelib')");
  python.unpackArchive(zip, 'zip', { extractDir: sitePackages });
  python.runPython('import random; random.seed()');
  return python;
}

/** The snapshot's bytes: gzipped in the bundle, unless the server already undid the gzip. */
async function snapshot() {
  const bytes = new Uint8Array(await bundleFile(SNAPSHOT));
  if (bytes[0] !== 0x1f || bytes[1] !== 0x8b) return bytes;
  const unzipped = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
  return new Uint8Array(await new Response(unzipped).arrayBuffer());
}

/** A file of the bundle, as an ArrayBuffer. */
async function bundleFile(path) {
  const response = await fetch(here(path));
  if (!response.ok) {
    throw new Error(`${response.url}: HTTP ${response.status}; rebuild the bundle (python -m build.web)`);
  }
  return response.arrayBuffer();
}

/** The onnxruntime-web module, set to load its wasm files from this origin, its wasm started. */
async function configureOrt(ort) {
  ort.env.wasm.wasmPaths = here('./ort/');
  // Threads need a cross-origin isolated page (COOP/COEP headers: `ortpipe web --coop`).
  ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
  ort.env.logLevel = 'error';
  const model = new Uint8Array(await bundleFile(ORT_START_MODEL));
  const session = await ort.InferenceSession.create(model, { executionProviders: ['wasm'] });
  await session.release();
  return ort;
}

/** The images as uint8 RGB tensors [height, width, 3], made with the loaded model's onnxruntime-web. */
async function imageTensors(sources) {
  const decoded = await decodeImages(sources);
  return decoded.map(({ rgb, width, height }) => new bridge.ort.Tensor('uint8', rgb, [height, width, 3]));
}

// Fused decode steps chain promises that onnxruntime-web's wasm build resolves at once, so no
// message (an interrupt) would be read until the generation ends: between bursts of steps, yield
// to the event loop if this long has passed.
const YIELD_EVERY_MS = 10;
const tasks = new MessageChannel();

/** Resolves in a new task, after the messages already queued (no setTimeout clamping). */
function nextTask() {
  return new Promise((resolve) => {
    tasks.port1.onmessage = () => resolve();
    tasks.port2.postMessage(0);
  });
}

/** Stream one generation, or the reply to a turn of chat number `chat`; `interrupted` (by the
 * page, before it started) ends it at once. */
async function generate(id, options, interrupted, chat) {
  if (!pipe) throw new Error('no model is loaded');
  if (active) throw new Error('a generation is already running: await it, or interrupt() it first');
  // Until the request exists (its images are being preprocessed), an interrupt is only noted.
  const starting = { interrupted, interrupt() { this.interrupted = true; } };
  active = starting;
  let request = null;
  let stepDecoded = null;
  try {
    const { images, ...settings } = options;
    if (chat !== undefined && images) throw new Error('a chat turn takes text only, no images');
    request = chat === undefined
      ? await pipe.request_json(JSON.stringify(settings), images && await imageTensors(images))
      : pipe.say_json(chatNumbered(chat), JSON.stringify(settings));
    if (starting.interrupted) request.interrupt();
    active = request;
    let decoder = null; // the JS Decoder of fused decode steps (py/ortpipe/targets/pyodide.py step_begin)
    stepDecoded = pipe.step_decoded; // one proxy of the bound method for the whole generation
    let yielded = performance.now();
    for (let answer = JSON.parse(pipe.step_begin(request)); ;) {
      if (answer.chunks.length) self.postMessage({ type: 'chunks', id, chunks: answer.chunks });
      if (answer.done) break;
      if (performance.now() - yielded > YIELD_EVERY_MS) {
        await nextTask();
        yielded = performance.now();
      }
      if (answer.decode) {
        if (answer.fresh) decoder = pipe.decoder;
        answer = JSON.parse(stepDecoded(...await decoder.burst(...answer.decode)));
      } else {
        answer = JSON.parse(await pipe.step_rest());
      }
    }
    return JSON.parse(pipe.result_json(request));
  } finally {
    active = null;
    request?.destroy();
    stepDecoded?.destroy();
  }
}
