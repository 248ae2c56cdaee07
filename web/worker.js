// The module Web Worker behind ortpipe.js. It boots Pyodide and onnxruntime-web from this origin
// and hands each message to ortpipe's Python side (py/ortpipe/targets/pyodide.py `Worker.task`),
// whose Task it pumps: every answer says what to await next (a session run or a session to open,
// a burst of the JS Decoder's fused decode steps), carries the chunks generated so far, and ends
// with `done` or a typed `error`. Messages in: load, generate, chat, say, rewind, closeChat,
// interrupt, unload, embed. Messages out: progress, chunks, result, error; each reply carries the id of
// the message it answers (progress: a denoising step or a batch of texts done, or loading). A result
// with named outputs (pipeline.output) carries them as typed arrays: audio as {audio: Float32Array,
// samplingRate}, an image as {image: ImageData}, other tensors (embeddings) as {data, dims}. After `unload` the worker can load another model without starting Python
// and onnxruntime-web again.

import { Bridge, createInferenceSession, downloadBytes, sessionOptions } from './bridge.js';
import { checkSources, decodeImages } from './images.js';
import { Prefetch } from './prefetch.js';
import { speculator } from './speculate.js';

// One onnxruntime-web build per device (see build/web.py).
const ORT_BUILDS = { wasm: './ort/ort.wasm.min.mjs', webgpu: './ort/ort.webgpu.min.mjs' };
// Python's memory after start-up with ortpipe imported, made by build/python_snapshot.mjs.
const SNAPSHOT = './pyodide/python-snapshot.bin';
// A one-node graph (ortpipe's argmax kernel, copied by build/web.py). onnxruntime-web fetches and
// compiles its wasm at its first session: this one makes that happen while Python starts.
const ORT_START_MODEL = './ort/start.onnx';

let worker = null; // the Python Worker, once a model is loaded
let bridge = null; // the bridge the loaded model's sessions were made with
let generating = false; // a generation or chat turn is running
let interruptedEarly = false; // an interrupt that came while a generation's images were decoding
// Started once and kept across models (promises; forgotten when they fail, to be tried again).
let pythonStarted = null; // Pyodide with ortpipe unpacked
const ortStarted = {}; // device -> the onnxruntime-web module

const here = (path) => new URL(path, import.meta.url).href;
const progress = (event) => self.postMessage({ type: 'progress', ...event });

self.onmessage = ({ data }) => {
  if (data.type === 'load') answer(data.id, () => load(data.modelUrl, data.device, data.dtype, data.allowPlugins));
  else if (data.type === 'generate') answer(data.id, () => generate(data.id, data.options, data.interrupted));
  else if (data.type === 'say') {
    answer(data.id, () => run(data.id, 'say', { ...data.options, chat: data.chat, interrupted: data.interrupted }));
  } else if (data.type === 'chat') answer(data.id, () => run(data.id, 'chat', data.options));
  else if (data.type === 'embed') {
    answer(data.id, () => run(data.id, 'embed', { ...data.options, interrupted: data.interrupted }));
  }
  else if (data.type === 'rewind') answer(data.id, () => run(data.id, 'rewind', { chat: data.chat }));
  else if (data.type === 'closeChat') worker?.close_chat(data.chat);
  else if (data.type === 'interrupt') interrupt();
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

  /** Speculative rounds over Decoders (web/speculate.js). */
  speculator(target, draft, spec, narrowGraphs) {
    return speculator(this, target, draft, spec, narrowGraphs);
  }
}

/** An error the page sees as an OrtpipeError with this name. */
class TaskError extends Error {
  constructor({ type, message }) {
    super(message);
    this.name = type;
  }
}

async function answer(id, work) {
  try {
    self.postMessage({ type: 'result', id, value: await work() });
  } catch (error) {
    if (!(error instanceof TaskError)) console.error(error);
    self.postMessage({ type: 'error', id, error: { name: error?.name ?? 'Error', message: String(error?.message ?? error) } });
  }
}

async function load(modelUrl, device, dtype, allowPlugins = false) {
  if (worker) throw new Error('this worker already holds a model; load() another pipeline instead');
  // The model's graphs start downloading now, while Python and onnxruntime-web start (modelUrl is
  // absolute and ends in "/": ortpipe.js's load made it so), and their sessions are created as
  // soon as they are here.
  const resolving = resolveDevice(device);
  const prefetch = new Prefetch(modelUrl, (url, name, signal) => downloadBytes(url, name, progress, signal), {
    device: resolving.catch(() => ({ device: 'wasm', f16: true })), dtype,
    open: async (file, bytes, weights, optimized) => (
      openEarly(file, bytes, weights, (await resolving).device, optimized)),
    tokenizer: async (json, config) => {
      const { Tokenizer } = await import('./vendor/tokenizers.mjs');
      return new Tokenizer(JSON.parse(json), config ? JSON.parse(config) : {});
    },
  });
  try {
    const { device: resolved, f16 } = await resolving;
    const [python, ort, tokenizers, jinja] = await runtime(resolved);
    const modelBridge = new ModelBridge(ort, tokenizers, jinja, progress, () => ortBuild('wasm'));
    modelBridge.prefetch = prefetch;
    const target = python.pyimport('ortpipe.targets.pyodide');
    const loading = target.Worker(modelBridge);
    target.destroy();
    try {
      const options = { url: modelUrl, device: resolved, dtype, f16, allow_plugins: allowPlugins === true };
      const info = await pump(loading.task('load', JSON.stringify(options)));
      info.threads = ort.env.wasm.numThreads; // wasm threads: more than one needs a cross-origin isolated page
      for (const note of info.notes) console.warn(`ortpipe: ${note}`);
      [worker, bridge] = [loading, modelBridge];
      progress({ phase: 'ready', message: 'Ready' });
      return info;
    } catch (error) {
      loading.destroy();
      await modelBridge.release();
      throw error;
    }
  } finally {
    await prefetch.drop(); // what the core did not take; its probes' answers stay true
  }
}

/** A model session made from early downloads, with the options the core asks for (bridge.js). */
async function openEarly(file, bytes, weights, device, optimized) {
  const ort = await ortBuild(device);
  progress({ phase: 'session', file, early: true });
  return createInferenceSession(ort, bytes, sessionOptions(device, weights, device === 'webgpu', optimized));
}

/** Run the Python task `kind` to its end: its value, named outputs read. */
async function run(id, kind, options) {
  if (!worker) throw new Error('no model is loaded');
  return withOutputs(await pump(worker.task(kind, JSON.stringify(options)), id));
}

/** Stream one generation; `interrupted` (by the page, before it started) ends it at once. */
async function generate(id, options, interrupted) {
  if (!worker) throw new Error('no model is loaded');
  interruptedEarly = interrupted;
  const { images, mask, latents, inputs, ...settings } = options;
  // null or absent: none; any other value is checked (0, false or "" is no way to say none)
  const [imaged, masked, latent] = [images, mask, latents].map((value) => value !== undefined && value !== null);
  if (imaged) checkSources(images);
  // refused by the core before any is decoded (or fetched) when the folder reads none
  const given = imaged && images.length !== 0;
  if (given || masked) await pump(worker.task('media', JSON.stringify({ images: given, mask: masked })), id);
  if (inputs !== undefined && inputs !== null && (typeof inputs !== 'object' || Array.isArray(inputs))) {
    const found = Array.isArray(inputs) ? 'an array' : `a ${typeof inputs}`;
    throw new TaskError({
      type: 'GenerationError', message: `inputs must be an object of named tensors, {name: {data, dims}}, not ${found}`,
    });
  }
  const tensors = imaged ? await imageTensors(images) : null;
  // inpainting's mask, decoded as images are (a value of the wrong kind is refused there)
  const maskTensor = masked ? (await imageTensors([mask], 'the mask'))[0] : undefined;
  const named = inputs || latent ? inputTensors({ ...inputs, ...(latent ? { latents } : {}) }) : undefined;
  const json = JSON.stringify({ ...settings, interrupted: interruptedEarly });
  const task = worker.task('generate', json, tensors, named, maskTensor);
  return withOutputs(await pump(task, id));
}

// The element type of a request input, from its typed array.
const INPUT_TYPES = [
  [Float32Array, 'float32'], [BigInt64Array, 'int64'], [Int32Array, 'int32'], [Uint8Array, 'uint8'],
  [Int8Array, 'int8'], [Float64Array, 'float64'],
];

/**
 * A request's named tensors ({name: {data, dims}}: a typed array, or plain numbers for float32) as
 * onnxruntime-web tensors; the core checks them against the inputs of the graphs that read them.
 * `latents` (a denoising request's initial latents) is one of them.
 */
function inputTensors(inputs) {
  const tensors = {};
  for (const [name, value] of Object.entries(inputs)) {
    const { data, dims } = value ?? {};
    const size = Array.isArray(dims) ? dims.reduce((a, b) => a * b, 1) : NaN;
    const type = Array.isArray(data) ? 'float32' : INPUT_TYPES.find(([kind]) => data instanceof kind)?.[1];
    if (!type || data.length !== size) {
      throw new TaskError({
        type: 'GenerationError',
        message: `input "${name}" must be {data, dims}: a typed array (Float32Array, BigInt64Array, Int32Array, `
          + 'Uint8Array, Int8Array, Float64Array) or numbers, with as many values as the dims hold, '
          + 'e.g. latents: {data: Float32Array, dims: [1, channels, height, width]}',
      });
    }
    tensors[name] = new bridge.ort.Tensor(type, Array.isArray(data) ? Float32Array.from(data) : data, dims);
  }
  return tensors;
}


/** The named outputs of a result, read from their tensors (Python holds them until then). */
async function withOutputs(value) {
  if (!value?.outputs || !worker) return value;
  try {
    for (const { name, kind, tensor, samplingRate, rgba } of worker.take_outputs()) {
      const data = await tensor.getData();
      const dims = [...tensor.dims];
      value.outputs[name] = { ...value.outputs[name], ...outputValue(kind, data, dims, samplingRate) };
      if (rgba && dims[0] === 1) value.outputs[name].image = imageData(await rgba.getData(), dims);
    }
  } finally {
    worker.release_outputs();
  }
  return value;
}

/** What the page gets of a named output: audio as the web platform plays it, other tensors (an image's
 * float values, [1, height, width, 3] in [0, 1]; embeddings) as their data and dims. */
function outputValue(kind, data, dims, samplingRate) {
  if (kind === 'audio' && (dims.length === 1 || dims[0] === 1)) return { audio: data, samplingRate };
  return { data, dims };
}

/** The first image of RGBA bytes [batch, height, width, 4], as a canvas draws it. */
function imageData(rgba, [, height, width]) {
  return new ImageData(new Uint8ClampedArray(rgba.buffer, rgba.byteOffset, height * width * 4), width, height);
}

function interrupt() {
  if (generating) worker?.interrupt();
  else interruptedEarly = true;
}

// Fused decode steps chain promises that onnxruntime-web's wasm build resolves at once, so no
// message (an interrupt) would be read until the generation ends: between answers, yield to the
// event loop if this long has passed.
const YIELD_EVERY_MS = 10;
const tasks = new MessageChannel();

/** Resolves in a new task, after the messages already queued (no setTimeout clamping). */
function nextTask() {
  return new Promise((resolve) => {
    tasks.port1.onmessage = () => resolve();
    tasks.port2.postMessage(0);
  });
}

/**
 * The one pump: answer the Python Task until it is done. `id`: the message whose page call gets
 * the chunks. Python's answers are JSON; only the awaited values (ort.Tensors, sessions) and the
 * Decoder cross as objects.
 */
async function pump(task, id) {
  generating = true;
  let decoder = null;
  const decoded = task.decoded; // one proxy of the bound method for the whole task
  try {
    let yielded = performance.now();
    for (let reply = JSON.parse(task.advance()); ;) {
      if (reply.chunks?.length) self.postMessage({ type: 'chunks', id, chunks: reply.chunks });
      for (const { what, step, steps } of reply.progress ?? []) {
        self.postMessage({ type: 'progress', id, phase: what, step, steps });
      }
      if (reply.error) throw new TaskError(reply.error);
      if (reply.next === 'done') return reply.value;
      if (performance.now() - yielded > YIELD_EVERY_MS) {
        await nextTask();
        yielded = performance.now();
      }
      let next;
      try {
        if (reply.next === 'decode') {
          if (reply.fresh) decoder = task.decoder;
          next = decoded(...await decoder.burst(...reply.decode));
        } else {
          next = task.advance(await task.pending);
        }
      } catch (error) {
        next = task.fail(String(error?.message ?? error));
      }
      reply = JSON.parse(next);
    }
  } finally {
    generating = false;
    decoded.destroy();
    task.destroy();
  }
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

/** Drop the model and release its sessions; Python and onnxruntime-web stay for the next one. */
async function unload() {
  const [oldWorker, oldBridge] = [worker, bridge];
  worker = null;
  bridge = null;
  oldWorker?.destroy();
  await oldBridge?.release();
}

/** `promise`, after arranging for `forget()` to run if it rejects. */
function forgetOnFailure(promise, forget) {
  promise.catch(forget);
  return promise;
}

/**
 * {device: "wasm" or "webgpu", f16: whether it runs float16 graphs}: "auto" takes WebGPU when the
 * browser has an adapter. A WebGPU adapter without the shader-f16 feature cannot run them.
 */
async function resolveDevice(device) {
  if (!['auto', 'wasm', 'webgpu'].includes(device)) {
    // ortpipe.js's load() refuses these first (a function or a BigInt never reaches here)
    const message = `device must be "auto", "webgpu" or "wasm", not ${JSON.stringify(device)}`;
    throw new TaskError({ type: 'OrtpipeError', message });
  }
  if (device === 'wasm') return { device: 'wasm', f16: true };
  const adapter = await navigator.gpu?.requestAdapter().catch(() => null);
  if (adapter) return { device: 'webgpu', f16: adapter.features.has('shader-f16') };
  if (device === 'webgpu') {
    const message = 'WebGPU is not available in this browser (no GPU adapter); use device "wasm" or "auto"';
    throw new TaskError({ type: 'OrtpipeError', message });
  }
  return { device: 'wasm', f16: true };
}

/** Pyodide with ortpipe's package unpacked into its site-packages, started from the bundle's memory
 * snapshot (build/python_snapshot.mjs): the interpreter comes up with ortpipe already imported.
 * `_loadSnapshot` is a private option of Pyodide's loader, hence the exact version in package.json.
 * A helper worker (web/unpack.js) fetches and unpacks the snapshot and ortpipe's zip on a thread of
 * its own, while this one starts onnxruntime-web and creates the model's sessions. */
async function startPython() {
  const unpacked = unpackElsewhere();
  const { loadPyodide } = await import('./pyodide/pyodide.mjs');
  const python = await loadPyodide({ indexURL: here('./pyodide/'), _loadSnapshot: unpacked.snapshot });
  // The snapshot holds memory, not files: ortpipe's kernels and modules it imports later are read
  // from site-packages. And Python's `random` would start from the build's seed on every page: it
  // is seeded here from the page's crypto (unseeded requests take their seeds from it).
  const sitePackages = python.runPython("import sysconfig; sysconfig.get_path('purelib')");
  const files = await unpacked.files;
  if (files) {
    for (const [path, bytes] of files) {
      const file = `${sitePackages}/${path}`;
      python.FS.mkdirTree(file.slice(0, file.lastIndexOf('/')));
      python.FS.writeFile(file, bytes);
    }
  } else {
    python.unpackArchive(await bundleFile('./ortpipe.zip'), 'zip', { extractDir: sitePackages });
  }
  const entropy = Array.from(crypto.getRandomValues(new Uint32Array(8)), (word) => word.toString(16).padStart(8, '0'));
  python.runPython(`import random; random.seed(0x${entropy.join('')})`);
  return python;
}

/**
 * {snapshot, files}: promises of the snapshot's bytes and of ortpipe's files ([[path, bytes]]), from
 * the helper worker; where a worker cannot start one (or the helper fails), the snapshot is read on
 * this thread and `files` is null (Python unpacks the zip itself).
 */
function unpackElsewhere() {
  let helper = null;
  try {
    helper = typeof Worker === 'undefined' ? null : new Worker(here('./unpack.js'), { type: 'module' });
  } catch {
    helper = null;
  }
  if (!helper) return { snapshot: snapshot(), files: Promise.resolve(null) };
  const settle = {};
  const snapshotBytes = new Promise((resolve) => { settle.snapshot = resolve; });
  const files = new Promise((resolve) => { settle.files = resolve; });
  helper.onmessage = ({ data }) => {
    if (data.snapshot) settle.snapshot(new Uint8Array(data.snapshot));
    else if (data.files) settle.files(data.files);
    else if (data.of === 'snapshot') settle.snapshot(snapshot()); // read here, which reports what fails
    else settle.files(null);
  };
  helper.onerror = () => {
    settle.snapshot(snapshot());
    settle.files(null);
  };
  Promise.allSettled([snapshotBytes, files]).then(() => helper.terminate());
  helper.postMessage({ snapshot: here(SNAPSHOT), zip: here('./ortpipe.zip') });
  return { snapshot: snapshotBytes, files };
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
async function imageTensors(sources, label) {
  const decoded = await decodeImages(sources, label);
  return decoded.map(({ rgb, width, height }) => new bridge.ort.Tensor('uint8', rgb, [height, width, 3]));
}
