// The benchmark page (bench.html, driven by build/bench_web.py): one engine per page load, or all interleaved.
//
//   bench.html?engine=ortpipe&model=20m&threads=1&newTokens=128&warmupRuns=1&warmRuns=3&prompt=5,17,...
//   bench.html?engine=ortpipe,transformers.js,ort&...   (interleaved: every engine in one page)
//
// Engines: "ortpipe" (ortpipe.js: Pyodide over onnxruntime-web in ortpipe's worker),
// "transformers.js" (@huggingface/transformers in a worker, over the onnxruntime-web build ortpipe
// bundles; ids only, no text), "transformers.js-text" (the same, streaming text as well with its
// TextStreamer, the way ortpipe's stream gives each token's text), "transformers.js-own-ort" (ids
// only, over the onnxruntime-web it bundles itself) and "ort" (a hand-written greedy loop over ortpipe's onnxruntime-web build, in a worker: the kernels'
// time, nothing else).
// Every engine runs in a worker and every time is taken here, on the page's thread, when a token
// arrives. The first generation gives the cold start (navigation start to its first token); the
// warm ones give time to first token and decode tokens/s. window.benchResult settles to the
// measurements, or to {error}.
//
// Interleaved (several engines named): the page loads every engine, then the engines take turns
// generation by generation, the order rotated each turn, so that each engine's runs meet the same
// moments of a noisy machine. No cold start is measured then (the engines load one after another);
// window.benchResult settles to {interleaved: [one result per engine]}.
//
// An engine may name a model variant and a mode: "ortpipe@q8", "transformers.js@q8:sampled",
// "ort@q4acc0" (the floor takes any file suffix: onnx/model_q4acc0.onnx). ":sampled" generates with
// SAMPLING instead of greedily (seeded where the engine takes a seed); the floor is greedy only.
//
// This file is also the worker of every engine but ortpipe (new Worker(bench.js)).

const IN_WORKER = typeof window === 'undefined';
const here = (path) => new URL(path, import.meta.url).href;
// The sampled mode's settings: the demo model's defaults (models/demo/genai_config.json), one seed.
const SAMPLING = { temperature: 0.7, topK: 40, topP: 0.95, seed: 1 };
// transformers.js's file name suffixes (ortpipe's web/variants.js); the floor takes other suffixes too.
const SUFFIXES = {
  fp32: '', fp16: '_fp16', q8: '_quantized', int8: '_int8', uint8: '_uint8', q4: '_q4', q4f16: '_q4f16', bnb4: '_bnb4',
};

/** "ortpipe@q8:sampled" -> {name: "ortpipe", dtype: "q8", sampled: true}. */
function parseEngine(spec) {
  const [head, mode = ''] = spec.split(':');
  const [name, dtype = null] = head.split('@');
  return { name, dtype, sampled: mode === 'sampled' };
}

// --- the page ------------------------------------------------------------------------------------

async function runPage(params) {
  const settings = {
    engine: params.get('engine'),
    model: params.get('model'),
    threads: Number(params.get('threads')),
    newTokens: Number(params.get('newTokens')),
    warmRuns: Number(params.get('warmRuns')),
    warmupRuns: Number(params.get('warmupRuns') ?? 0),
    prompt: params.get('prompt').split(',').map(Number),
    profile: params.has('profile'), // a traced run: code must be named by its URL
  };
  const names = settings.engine.split(',');
  const unknown = names.filter((spec) => !PAGE_ENGINES[parseEngine(spec).name]);
  if (unknown.length) throw new Error(`unknown engine ${unknown}; expected ${Object.keys(PAGE_ENGINES)}`);
  if (names.length > 1) return { interleaved: await runInterleaved(names, settings) };
  const open = PAGE_ENGINES[parseEngine(settings.engine).name];
  show(`${settings.engine}: loading models/${settings.model}/`);
  const engine = await open(settings);
  const loadedMs = performance.now();
  // The first generation starts the clock at navigation start (performance.now() is 0 there).
  const cold = await timeGeneration(engine, settings, 0);
  // Unmeasured: the browser finishes optimising the wasm code (it tiers up in the background).
  for (let i = 0; i < settings.warmupRuns; i++) {
    show(`${settings.engine}: warm-up run ${i + 1} of ${settings.warmupRuns}`);
    await timeGeneration(engine, settings, performance.now());
  }
  // The marks delimit the measured runs in a Chrome trace (build/bench_web.py --profile).
  performance.mark('bench-warm-start');
  const warm = [];
  for (let i = 0; i < settings.warmRuns; i++) {
    show(`${settings.engine}: warm run ${i + 1} of ${settings.warmRuns}`);
    warm.push(await timeGeneration(engine, settings, performance.now()));
  }
  performance.mark('bench-warm-end');
  engine.dispose();
  show(`${settings.engine}: done`);
  return {
    engine: settings.engine, model: settings.model, threads: settings.threads, versions: engine.versions,
    crossOriginIsolated: self.crossOriginIsolated, loadPhases: engine.phases, loadedMs,
    coldStartMs: cold.firstTokenMs, cold, warm,
  };
}

/** Every engine of `names` in this page, taking turns: one result per engine, as runPage's. */
async function runInterleaved(names, settings) {
  const engines = [];
  for (const name of names) {
    show(`${name}: loading models/${settings.model}/`);
    engines.push(await PAGE_ENGINES[parseEngine(name).name]({ ...settings, engine: name }));
  }
  const results = names.map((name, i) => ({
    engine: name, model: settings.model, threads: settings.threads, versions: engines[i].versions,
    crossOriginIsolated: self.crossOriginIsolated, loadPhases: engines[i].phases, loadedMs: null,
    coldStartMs: null, cold: null, warm: [],
  }));
  const turns = async (count, what, record) => {
    for (let turn = 0; turn < count; turn++) {
      for (let k = 0; k < engines.length; k++) {
        const i = (k + turn) % engines.length; // who goes first rotates
        show(`${names[i]}: ${what} ${turn + 1} of ${count}`);
        record(i, await timeGeneration(engines[i], settings, performance.now()));
      }
    }
  };
  await turns(1, 'first run', (i, timed) => { results[i].cold = timed; }); // its tokens are checked
  await turns(settings.warmupRuns, 'warm-up run', () => {});
  performance.mark('bench-warm-start');
  await turns(settings.warmRuns, 'warm run', (i, timed) => results[i].warm.push(timed));
  performance.mark('bench-warm-end');
  for (const engine of engines) engine.dispose();
  show(`${names}: done`);
  return results;
}

/** Generate once; times are taken when each token reaches this thread. */
async function timeGeneration(engine, { prompt, newTokens }, started) {
  const tokens = [];
  const arrivals = [];
  const reported = await engine.generate(prompt, newTokens, (token) => {
    arrivals.push(performance.now());
    tokens.push(token);
  });
  const decodeMs = arrivals.at(-1) - arrivals[0];
  return {
    tokens,
    firstTokenMs: arrivals[0] - started,
    decodeTokensPerS: (tokens.length - 1) / (decodeMs / 1000),
    medianTokenMs: median(tokenIntervals(arrivals)),
    reported, // the engine's own timings, when it has any
  };
}

// Arrivals closer than this came in one message (a burst of decode steps): no model here decodes
// a token in less.
const SAME_MESSAGE_MS = 1;

/** Each token's interval: tokens that arrive together share the time since the arrival before. */
function tokenIntervals(arrivals) {
  const intervals = [];
  for (let i = 1; i < arrivals.length;) {
    let end = i + 1;
    while (end < arrivals.length && arrivals[end] - arrivals[end - 1] < SAME_MESSAGE_MS) end++;
    intervals.push(...new Array(end - i).fill((arrivals[end - 1] - arrivals[i - 1]) / (end - i)));
    i = end;
  }
  return intervals;
}

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

function show(text) {
  document.getElementById('status').textContent = text;
}

const PAGE_ENGINES = {
  ortpipe: openOrtpipe,
  'transformers.js': openWorkerEngine,
  'transformers.js-text': openWorkerEngine,
  'transformers.js-own-ort': openWorkerEngine,
  ort: openWorkerEngine,
};

/**
 * ortpipe through its embed API. Its worker (web/worker.js, configureOrt) takes min(4, cores)
 * threads on a cross-origin isolated page and one thread otherwise; it has no option to set them.
 */
async function openOrtpipe({ engine, model, threads }) {
  const { dtype, sampled } = parseEngine(engine);
  const chosen = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
  if (threads !== chosen) {
    throw new Error(`ortpipe's worker will use ${chosen} threads here, not ${threads}: serve the page `
      + `${threads > 1 ? 'with' : 'without'} COOP/COEP on a machine with ${threads} cores`);
  }
  const [{ load }, versions] = await Promise.all([
    import('./ortpipe.js'), fetch(here('./versions.json')).then((r) => r.json()),
  ]);
  const phases = {}; // when each load phase (runtime, download, session, ready) began
  const onProgress = ({ phase }) => { phases[phase] ??= performance.now(); };
  const pipe = await load(here(`./models/${model}/`), { device: 'wasm', dtype, onProgress });
  const mode = sampled ? { doSample: true, ...SAMPLING } : { doSample: false };
  return {
    versions: {
      ortpipe: versions.ortpipe, 'onnxruntime-web': versions['onnxruntime-web'], pyodide: versions.pyodide,
      dtype: Object.values(pipe.info.dtypes).join(','),
    },
    phases,
    async generate(prompt, newTokens, onToken) {
      const stream = pipe.stream({ promptIds: prompt, maxNewTokens: newTokens, ...mode });
      for (let next = await stream.next(); ; next = await stream.next()) {
        if (next.done) return next.value.timings;
        onToken(next.value.token);
      }
    },
    dispose: () => pipe.dispose(),
  };
}

/** An engine that runs in a worker of this file: load, then generate on request. */
async function openWorkerEngine({ engine, model, threads, profile }) {
  const worker = new Worker(import.meta.url, { type: 'module' });
  let pending = null; // {resolve, reject, onToken} of the message being answered
  worker.onmessage = ({ data }) => {
    if (data.type === 'token') pending.onToken(data.token);
    else if (data.type === 'error') pending.reject(new Error(data.message));
    else pending.resolve(data.value);
  };
  worker.onerror = (event) => pending?.reject(new Error(event.message || 'the benchmark worker failed'));
  const call = (message, onToken) => new Promise((resolve, reject) => {
    pending = { resolve, reject, onToken };
    worker.postMessage(message);
  });
  const modelUrl = here(`./models/${model}/`);
  const versions = await call({ type: 'load', engine, modelUrl, model, threads, profile });
  return {
    versions,
    generate: (prompt, newTokens, onToken) => call({ type: 'generate', prompt, newTokens }, onToken),
    dispose: () => worker.terminate(),
  };
}

// --- the worker ----------------------------------------------------------------------------------

function serveEngine() {
  const opened = {};
  self.onmessage = async ({ data }) => {
    try {
      let value;
      if (data.type === 'load') {
        Object.assign(opened, await WORKER_ENGINES[parseEngine(data.engine).name](data));
        value = opened.versions;
      } else {
        const onToken = (token) => self.postMessage({ type: 'token', token });
        await opened.generate(data.prompt, data.newTokens, onToken);
      }
      self.postMessage({ type: 'result', value });
    } catch (error) {
      self.postMessage({ type: 'error', message: String(error?.stack ?? error) });
    }
  };
}

const WORKER_ENGINES = {
  'transformers.js': (options) => openTransformersJs(options, 'ortpipe'),
  'transformers.js-text': (options) => openTransformersJs(options, 'ortpipe', { text: true }),
  'transformers.js-own-ort': (options) => openTransformersJs(options, 'own'),
  ort: openOrtLoop,
};

/**
 * transformers.js over the model folder, from this origin only. `ortBuild` picks its
 * onnxruntime-web: "ortpipe" hands it the build ortpipe runs (ort/ort.wasm.min.mjs) through the
 * globalThis[Symbol.for('onnxruntime')] hook it reads at import, so that both engines run the
 * same kernels; "own" keeps the onnxruntime-web JS bundled in transformers.min.js, with the wasm
 * build it would fetch from a CDN (the asyncify one) served from tjs/ instead. By default
 * transformers.js fetches that build into the Cache API and compiles it from bytes; a profiled run
 * lets onnxruntime-web load it by URL, so the profile can tell its code from the rest.
 */
async function openTransformersJs({ engine, model, modelUrl, threads, profile }, ortBuild, { text = false } = {}) {
  const { dtype, sampled } = parseEngine(engine);
  if (ortBuild === 'ortpipe') globalThis[Symbol.for('onnxruntime')] = await import('./ort/ort.wasm.min.mjs');
  const tjs = await import('./tjs/transformers.min.js');
  const { env } = tjs;
  env.allowRemoteModels = false;
  env.allowLocalModels = true;
  env.localModelPath = here('./models/');
  env.useBrowserCache = false; // ortpipe keeps no copy of the model either
  env.useWasmCache = ortBuild === 'own' && !profile;
  env.backends.onnx.wasm.wasmPaths = ortBuild === 'own' ? {
    mjs: here('./tjs/ort-wasm-simd-threaded.asyncify.mjs'),
    wasm: here('./tjs/ort-wasm-simd-threaded.asyncify.wasm'),
  } : here('./ort/');
  env.backends.onnx.wasm.numThreads = threads;
  // With an onnxruntime handed in, transformers.js lists no devices and refuses "wasm": ask
  // onnxruntime for the wasm EP directly.
  const device = ortBuild === 'own'
    ? { device: 'wasm' }
    : { device: 'auto', session_options: { executionProviders: ['wasm'] } };
  const lm = await tjs.AutoModelForCausalLM.from_pretrained(model, { ...device, dtype: dtype ?? 'fp32' });
  // transformers.js draws with Math.random: no seed
  const mode = sampled
    ? { do_sample: true, temperature: SAMPLING.temperature, top_k: SAMPLING.topK, top_p: SAMPLING.topP }
    : { do_sample: false };
  // Made from the folder's files: AutoTokenizer's existence check skips local files given by http URL.
  const tokenizer = text ? new tjs.PreTrainedTokenizer(...await Promise.all(
    ['tokenizer.json', 'tokenizer_config.json'].map((file) => fetch(`${modelUrl}${file}`).then((r) => r.json())),
  )) : null;
  return {
    versions: { 'transformers.js': env.version, 'onnxruntime-web': env.backends.onnx.versions?.web, dtype: dtype ?? 'fp32' },
    async generate(prompt, newTokens, onToken) {
      const ids = (fill) => new tjs.Tensor('int64', BigInt64Array.from(prompt, fill), [1, prompt.length]);
      let inPrompt = true; // generate() streams the prompt first
      let streamed = ''; // the text, when streamed
      const streamer = text ? new tjs.TextStreamer(tokenizer, {
        skip_prompt: true,
        token_callback_function: (tokens) => onToken(Number(tokens[0])),
        callback_function: (piece) => { streamed += piece; },
      }) : {
        put(value) {
          if (!inPrompt) onToken(Number(value[0][0]));
          inPrompt = false;
        },
        end() {},
      };
      await lm.generate({
        input_ids: ids(BigInt), attention_mask: ids(() => 1n), max_new_tokens: newTokens, ...mode,
        streamer,
      });
    },
  };
}

/**
 * The floor: a greedy loop over the graph onnx/model{suffix}.onnx with ortpipe's onnxruntime-web
 * build, feeding each step's present KV back as the next step's past (a concat cache; the model
 * builder's GroupQueryAttention takes one too). Inputs the graph lacks (position_ids) are not fed.
 */
async function openOrtLoop({ engine, modelUrl, threads }) {
  const { dtype, sampled } = parseEngine(engine);
  if (sampled) throw new Error('the floor decodes greedily only');
  const ort = await import('./ort/ort.wasm.min.mjs');
  ort.env.wasm.wasmPaths = here('./ort/');
  ort.env.wasm.numThreads = threads;
  ort.env.logLevel = 'error';
  const config = await fetch(`${modelUrl}config.json`).then((r) => r.json());
  const file = `model${dtype ? SUFFIXES[dtype] ?? `_${dtype}` : ''}.onnx`;
  const weights = [];
  for (const name of [`${file}.data`, `${file}_data`]) { // external data, by either exporter's name
    if ((await fetch(`${modelUrl}onnx/${name}`, { method: 'HEAD' })).ok) weights.push({ path: name, data: `${modelUrl}onnx/${name}` });
  }
  const session = await ort.InferenceSession.create(`${modelUrl}onnx/${file}`, {
    executionProviders: ['wasm'], graphOptimizationLevel: 'all', externalData: weights,
  });
  const headSize = config.head_dim ?? config.hidden_size / config.num_attention_heads;
  const kvDims = [1, config.num_key_value_heads, 0, headSize];
  const int64 = (values) => new ort.Tensor('int64', BigInt64Array.from(values, BigInt), [1, values.length]);
  const pastType = session.inputMetadata.find((m) => m.name.startsWith('past_key_values'))?.type ?? 'float32';
  const Past = pastType === 'float16' ? Uint16Array : Float32Array;
  return {
    versions: { 'onnxruntime-web': ort.env.versions.web, dtype: dtype ?? 'fp32' },
    async generate(prompt, newTokens, onToken) {
      const past = {};
      for (let layer = 0; layer < config.num_hidden_layers; layer++) {
        for (const kind of ['key', 'value']) {
          past[`past_key_values.${layer}.${kind}`] = new ort.Tensor(pastType, new Past(0), kvDims);
        }
      }
      let ids = prompt;
      let length = 0;
      for (let step = 0; step < newTokens; step++) {
        const positions = ids.map((_, i) => length + i);
        length += ids.length;
        const mask = new Array(length).fill(1);
        const feeds = { input_ids: int64(ids), attention_mask: int64(mask), ...past };
        if (session.inputNames.includes('position_ids')) feeds.position_ids = int64(positions);
        const outputs = await session.run(feeds);
        const token = argmaxLast(outputs.logits);
        onToken(token);
        ids = [token];
        for (const name of Object.keys(past)) {
          past[name] = outputs[name.replace('past_key_values', 'present')];
        }
      }
    },
  };
}

function argmaxLast({ data, dims }) {
  const vocab = dims.at(-1);
  const start = data.length - vocab;
  const row = data instanceof Uint16Array ? Float32Array.from(data.subarray(start), halfToFloat) : data.subarray(start);
  let best = 0;
  for (let i = 1; i < vocab; i++) if (row[i] > row[best]) best = i;
  return best;
}

function halfToFloat(bits) {
  const exponent = (bits >> 10) & 0x1f;
  const magnitude = exponent === 0 ? (bits & 0x3ff) * 2 ** -24
    : exponent === 0x1f ? ((bits & 0x3ff) ? NaN : Infinity)
      : (1 + (bits & 0x3ff) / 1024) * 2 ** (exponent - 15);
  return bits & 0x8000 ? -magnitude : magnitude;
}

// --- start (last: everything above is defined) ------------------------------------------------

if (IN_WORKER) {
  serveEngine();
} else {
  window.benchResult = runPage(new URLSearchParams(location.search)).catch((error) => ({
    error: `${error?.name ?? 'Error'}: ${error?.message ?? error}`,
  }));
}
