// The JS half of ortpipe's Pyodide target (py/ortpipe/targets/pyodide.py): what Python asks of
// onnxruntime-web, the network and tokenizers.js. Python holds ort.Tensor and InferenceSession
// objects as proxies; typed arrays are made and read here, where they are cheap.

const ARRAYS = {
  float32: Float32Array, float64: Float64Array, float16: Uint16Array, // float16: IEEE half bits
  int64: BigInt64Array, uint64: BigUint64Array, int32: Int32Array, uint32: Uint32Array,
  int16: Int16Array, uint16: Uint16Array, int8: Int8Array, uint8: Uint8Array, bool: Uint8Array,
};

/** Typed array of `type` holding `values` (numbers or BigInts). */
function typedArray(type, values) {
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
  }

  /** The text at `url`, or undefined (None in Python) when the server answers 404. */
  async fetchText(url) {
    const response = await fetch(url);
    if (response.status === 404) return undefined;
    if (!response.ok) throw new Error(`GET ${url}: HTTP ${response.status}`);
    return response.text();
  }

  /** Synchronous GET (workers only): for files the core asks about while it parses a config. */
  fetchTextSync(url) {
    const request = new XMLHttpRequest();
    request.open('GET', url, false);
    request.send();
    if (request.status === 404) return undefined;
    if (request.status !== 200) throw new Error(`GET ${url}: HTTP ${request.status}`);
    return request.responseText;
  }

  /** Whether the server has `url` (a synchronous HEAD). */
  existsSync(url) {
    const request = new XMLHttpRequest();
    request.open('HEAD', url, false);
    request.send();
    return request.status === 200;
  }

  /** The bytes at `url`, reporting download progress under `name`. */
  async fetchBytes(url, name) {
    const response = await fetch(url);
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
      this.onProgress({ phase: 'download', file: name, loaded, total });
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
   * An InferenceSession from a model URL or from bytes (kernels).
   * @param {string|Uint8Array} source
   * @param {{name: string, device: string, gpuOutputs: boolean, externalData: string[]}} options
   *   gpuOutputs keeps every output on the GPU (WebGPU only); externalData lists the URLs of
   *   weight files beside the graph.
   */
  async createSession(source, options) {
    const ort = options.device === 'wasm' ? await this.wasmOrt() : this.ort;
    const bytes = typeof source === 'string' ? await this.fetchBytes(source, options.name) : source;
    this.onProgress({ phase: 'session', file: options.name });
    const sessionOptions = {
      executionProviders: [options.device],
      graphOptimizationLevel: 'all',
      logSeverityLevel: 3, // errors only: ortpipe reports what matters itself
      externalData: options.externalData.map((url) => ({ path: url.slice(url.lastIndexOf('/') + 1), data: url })),
    };
    if (options.gpuOutputs) sessionOptions.preferredOutputLocation = 'gpu-buffer';
    return ort.InferenceSession.create(bytes, sessionOptions);
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
    const data = logits.data;
    const tokens = new BigInt64Array(batch);
    for (let b = 0; b < batch; b++) {
      const start = (b * seq + seq - 1) * vocab;
      let best = 0;
      for (let i = 1; i < vocab; i++) if (data[start + i] > data[start + best]) best = i;
      tokens[b] = BigInt(best);
    }
    return new this.ort.Tensor('int64', tokens, [batch]);
  }

  /** A small CPU tensor's values as numbers. */
  toList(tensor) {
    return Array.from(tensor.data, Number);
  }

  tokenizer(tokenizerJson, configJson) {
    return new this.tokenizers.Tokenizer(JSON.parse(tokenizerJson), configJson ? JSON.parse(configJson) : {});
  }

  /** A chat template renderer: (messagesJson, addGenerationPrompt) -> text. */
  chatTemplate(source, specialTokensJson) {
    const template = new this.jinja.Template(source);
    const tokens = JSON.parse(specialTokensJson);
    return (messagesJson, addGenerationPrompt) => template.render({
      messages: JSON.parse(messagesJson), add_generation_prompt: addGenerationPrompt, ...tokens,
    });
  }
}
