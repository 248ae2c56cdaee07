// The page of build/bench_loops_web.py (copied into its bundle as bench-loops.js): one engine, one task per
// page load, on wasm, every time taken on the page's thread.
//
//   bench-loops.html?engine=ortpipe&task=embed&model=st-bench&batch=32&runs=3
//   bench-loops.html?engine=transformers.js&task=embed&model=st-bench&batch=32&runs=3
//   bench-loops.html?engine=ortpipe&task=tts&model=vits-bench&runs=3
//   bench-loops.html?engine=transformers.js&task=tts&model=vits-bench&runs=3
//   bench-loops.html?engine=ort&task=tts&model=vits-bench&runs=3
//   bench-loops.html?engine=ortpipe&task=seq2seq&model=t5-bench&runs=3&tokens=64
//   bench-loops.html?engine=transformers.js&task=seq2seq&model=t5-bench&runs=3&tokens=64
//
// embed: texts.json (the bundle's) embedded in batches of `batch`: ortpipe's embed (its own batches, longest
// first), or transformers.js's feature-extraction pipeline (mean pooling, normalised) on the batches in the
// texts' order ("transformers.js") or longest first by characters ("transformers.js-sorted", as a careful
// caller would batch), over the onnxruntime-web build ortpipe bundles (the same kernels). tts: ortpipe's
// speak, transformers.js's text-to-speech pipeline or a hand-written onnxruntime-web loop ("ort": one
// session.run on the sentence's ids, speech-ids.json in the bundle) on the same sentence, timed per second
// of audio. seq2seq: a greedy generation of exactly `tokens` tokens (min_new_tokens) from the encoder-decoder's
// prompt ids (seq2seq-ids.json in the bundle): ortpipe's generate, or transformers.js's generate on
// AutoModelForSeq2SeqLM (what its text2text-generation pipeline calls), timed per generation.
// window.benchResult settles to {runs: [seconds...], first: [the first 4 embeddings], [the first 64
// samples] or [the tokens]} or {error}.

const here = (path) => new URL(path, import.meta.url).href;
const SPEECH = 'The quick brown fox jumps over the lazy dog while the parser reads each line of the file and '
  + 'keeps the fields it needs.';

async function run(params) {
  const engine = params.get('engine');
  const task = params.get('task');
  const model = params.get('model');
  const runs = Number(params.get('runs'));
  const batch = Number(params.get('batch') ?? 32);
  const texts = task === 'embed' ? await (await fetch(here('./texts.json'))).json() : null;
  const tokens = Number(params.get('tokens') ?? 64);
  const work = task === 'seq2seq' ? await seq2seq(engine, model, tokens)
    : engine === 'ortpipe' ? await ortpipeTask(task, model, batch)
    : engine === 'ort' ? await ortSpeech(model)
    : task === 'tts' ? await transformersJsSpeech(model)
      : await transformersJs(model, batch, engine === 'transformers.js-sorted');
  await work(texts?.slice(0, batch)); // warm-up
  const times = [];
  let last = null;
  for (let i = 0; i < runs; i++) {
    const started = performance.now();
    last = await work(texts);
    times.push((performance.now() - started) / 1000);
  }
  return { engine, task, model, runs: times, ...last };
}

async function ortpipeTask(task, model, batch) {
  const { load } = await import('./ortpipe.js');
  const pipe = await load(`models/${model}/`, { device: 'wasm' });
  if (task === 'tts') {
    return async () => {
      const { audio, samplingRate } = await pipe.speak(SPEECH);
      return { audioSeconds: audio.length / samplingRate, first: Array.from(audio.slice(0, 64)) };
    };
  }
  return async (texts) => {
    const { data, dims } = await pipe.embed(texts, { batchSize: batch });
    return { count: dims[0], first: Array.from(data.slice(0, 4 * dims[1])) };
  };
}

/** A greedy generation of `tokens` tokens from seq2seq-ids.json by ortpipe or transformers.js. */
async function seq2seq(engine, model, tokens) {
  const ids = await (await fetch(here('./seq2seq-ids.json'))).json();
  if (engine === 'ortpipe') {
    const { load } = await import('./ortpipe.js');
    const pipe = await load(`models/${model}/`, { device: 'wasm' });
    return async () => {
      const result = await pipe.generate({ promptIds: ids, maxNewTokens: tokens, minNewTokens: tokens });
      return { first: result.tokens };
    };
  }
  const { tjs } = await transformersJsSetUp(model, false);
  const t5 = await tjs.AutoModelForSeq2SeqLM.from_pretrained(model, {
    device: 'auto', session_options: { executionProviders: ['wasm'] }, dtype: 'fp32',
  });
  const inputIds = new tjs.Tensor('int64', BigInt64Array.from(ids, BigInt), [1, ids.length]);
  const mask = new tjs.Tensor('int64', BigInt64Array.from(ids, () => 1n), [1, ids.length]);
  return async () => {
    const out = await t5.generate({ input_ids: inputIds, attention_mask: mask, max_new_tokens: tokens,
      min_new_tokens: tokens, do_sample: false, num_beams: 1 });
    return { first: Array.from(out.data, Number).slice(1) };
  };
}

/** transformers.js over ortpipe's onnxruntime-web build, one thread, local files only; the folder's
 * tokenizer files (`tokenizer` false: none). */
async function transformersJsSetUp(model, tokenizer = true) {
  globalThis[Symbol.for('onnxruntime')] = await import('./ort/ort.wasm.min.mjs');
  const tjs = await import('./tjs/transformers.min.js');
  const { env } = tjs;
  env.allowRemoteModels = false;
  env.allowLocalModels = true;
  env.localModelPath = here('./models/');
  env.useBrowserCache = false;
  env.backends.onnx.wasm.wasmPaths = here('./ort/');
  env.backends.onnx.wasm.numThreads = 1;
  if (!tokenizer) return { tjs };
  // Made from the folder's files: AutoTokenizer's existence check skips local files given by http URL
  // (as web/bench.js finds).
  const [json, config] = await Promise.all(['tokenizer.json', 'tokenizer_config.json'].map(
    (file) => fetch(here(`./models/${model}/${file}`)).then((r) => r.json())));
  return { tjs, json, config };
}

/** The floor: onnxruntime-web (the build ortpipe bundles) run by hand on the sentence's ids. */
async function ortSpeech(model) {
  const ort = await import('./ort/ort.wasm.min.mjs');
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.wasmPaths = here('./ort/');
  const [bytes, ids, config] = await Promise.all([
    fetch(here(`./models/${model}/onnx/model.onnx`)).then((r) => r.arrayBuffer()),
    fetch(here('./speech-ids.json')).then((r) => r.json()),
    fetch(here(`./models/${model}/config.json`)).then((r) => r.json()),
  ]);
  const session = await ort.InferenceSession.create(new Uint8Array(bytes), {
    executionProviders: ['wasm'], graphOptimizationLevel: 'all',
  });
  const feeds = {
    input_ids: new ort.Tensor('int64', BigInt64Array.from(ids, BigInt), [1, ids.length]),
    attention_mask: new ort.Tensor('int64', BigInt64Array.from(ids, () => 1n), [1, ids.length]),
  };
  return async () => {
    const { waveform } = await session.run(feeds);
    const audio = waveform.data;
    return { audioSeconds: audio.length / config.sampling_rate, first: Array.from(audio.slice(0, 64)) };
  };
}

/** What tjs.pipeline('text-to-speech') makes of a VITS folder. */
async function transformersJsSpeech(model) {
  const { tjs, json, config } = await transformersJsSetUp(model);
  const vits = await tjs.AutoModel.from_pretrained(model, {
    device: 'auto', session_options: { executionProviders: ['wasm'] }, dtype: 'fp32',
  });
  const synth = new tjs.TextToAudioPipeline({
    task: 'text-to-speech', model: vits, tokenizer: new tjs.VitsTokenizer(json, config),
  });
  return async () => {
    const { audio, sampling_rate: rate } = await synth(SPEECH);
    return { audioSeconds: audio.length / rate, first: Array.from(audio.slice(0, 64)) };
  };
}

/** What tjs.pipeline('feature-extraction') makes. */
async function transformersJs(model, batch, sorted) {
  const { tjs, json, config } = await transformersJsSetUp(model);
  const encoder = await tjs.AutoModel.from_pretrained(model, {
    device: 'auto', session_options: { executionProviders: ['wasm'] }, dtype: 'fp32',
  });
  const extractor = new tjs.FeatureExtractionPipeline({
    task: 'feature-extraction', model: encoder, tokenizer: new tjs.BertTokenizer(json, config),
  });
  return async (given) => {
    const texts = sorted ? [...given].sort((a, b) => b.length - a.length) : given;
    const rows = [];
    for (let at = 0; at < texts.length; at += batch) {
      const out = await extractor(texts.slice(at, at + batch), { pooling: 'mean', normalize: true });
      rows.push(out.data);
    }
    const dim = rows[0].length / Math.min(batch, texts.length);
    return { count: texts.length, first: Array.from(rows[0].slice(0, 4 * dim)) };
  };
}

window.benchResult = run(new URLSearchParams(location.search)).catch((error) => ({ error: String(error?.stack ?? error) }));
