// Model variants, as py/ortpipe/variants.py chooses them (tests/web/test_prefetch.py compares the
// tables): the worker's early downloads must guess the file the core will open.

// dtype -> what transformers.js appends to a graph's file name.
export const SUFFIXES = {
  fp32: '', fp16: '_fp16', q8: '_quantized', int8: '_int8', uint8: '_uint8', q4: '_q4', q4f16: '_q4f16',
  bnb4: '_bnb4',
};
// A device's order of preference (variants.py says why).
export const DEFAULTS = {
  wasm: ['q8', 'int8', 'uint8', 'fp32', 'fp16', 'q4', 'q4f16', 'bnb4'],
  cpu: ['q4', 'q8', 'int8', 'uint8', 'q4f16', 'fp32', 'fp16', 'bnb4'],
  gpu: ['fp16', 'fp32', 'q4f16', 'q4', 'bnb4', 'q8', 'int8', 'uint8'],
};
export const ROWS = { wasm: 'wasm', webgpu: 'gpu', cuda: 'gpu', tensorrt: 'gpu', dml: 'gpu', coreml: 'gpu' };
// Variants that compute in float16: a WebGPU adapter without shader-f16 cannot run them.
export const HALF = ['fp16', 'q4f16'];

/** The graph's plain name: "onnx/model" for "onnx/model_q4.onnx". */
export function base(file) {
  const stem = file.endsWith('.onnx') ? file.slice(0, -'.onnx'.length) : file;
  const suffixes = Object.values(SUFFIXES).filter(Boolean).sort((a, b) => b.length - a.length);
  const suffix = suffixes.find((s) => stem.endsWith(s) && stem.length > s.length && !stem.endsWith(`/${s}`));
  return suffix ? stem.slice(0, -suffix.length) : stem;
}

/** Every variant file name of `file`'s graph: dtype -> name. */
export function variantFiles(file) {
  const stem = base(file);
  return Object.fromEntries(Object.entries(SUFFIXES).map(([dtype, suffix]) => [dtype, `${stem}${suffix}.onnx`]));
}

/**
 * The file a session runs, from the variants that exist (dtype -> name): the one `dtype` names,
 * else the device's first (without float16 graphs unless `f16`); undefined when the one asked for
 * is missing (the core reports it).
 */
export function chooseVariant(found, device, dtype, f16 = true) {
  if (dtype) return found[dtype];
  const row = DEFAULTS[ROWS[device] ?? 'cpu'].filter((candidate) => f16 || !HALF.includes(candidate));
  return found[row.find((candidate) => candidate in found)];
}

const OPTIMIZED_FOR = 'ortpipe.optimized_for'; // py/ortpipe/variants.py: a graph optimized ahead says so

/**
 * Whether the graph in `bytes` was optimized ahead for `device`'s provider (py/ortpipe/variants.py's
 * `optimized_ahead`, which the core applies to the sessions it creates): for the early session, made
 * before Python runs. Its metadata_props (ModelProto field 14) are found by walking the model's
 * top-level fields, each skipped by its length; bytes that are no model give false.
 */
export function optimizedAhead(bytes, device) {
  return device === 'wasm' && graphMetadata(bytes, OPTIMIZED_FOR) === 'CPUExecutionProvider';
}

/** The value of the graph's metadata_props entry `key` (the last, as the core reads them), or null. */
export function graphMetadata(bytes, key) {
  let at = 0;
  let found = null;
  const varint = (end) => {
    let value = 0;
    for (let scale = 1; at < end; scale *= 128) {
      const byte = bytes[at++];
      value += (byte & 0x7f) * scale;
      if (byte < 0x80) return value;
    }
    throw new RangeError('truncated');
  };
  /** [field, wire type, value or [start, end] of a length-delimited field] of the next field before `end`. */
  const next = (end) => {
    const tag = varint(end);
    const wire = tag & 7;
    if (wire === 0) return [tag >>> 3, wire, varint(end)];
    if (wire === 1 || wire === 5) { at += wire === 1 ? 8 : 4; return [tag >>> 3, wire, null]; }
    if (wire !== 2) throw new RangeError('not a model');
    const length = varint(end);
    const start = at;
    at += length;
    if (at > end) throw new RangeError('truncated');
    return [tag >>> 3, wire, [start, at]];
  };
  const text = ([start, end]) => new TextDecoder().decode(bytes.subarray(start, end));
  try {
    while (at < bytes.length) {
      const [field, wire, span] = next(bytes.length);
      if (field !== 14 || wire !== 2) continue;
      const after = at;
      at = span[0];
      let name = null;
      let value = null;
      while (at < span[1]) {
        const [inner, innerWire, innerSpan] = next(span[1]);
        if (innerWire === 2 && inner === 1) name = text(innerSpan);
        if (innerWire === 2 && inner === 2) value = text(innerSpan);
      }
      at = after;
      if (name === key) found = value;
    }
  } catch {
    return null; // no model: the core reads it and says what is wrong
  }
  return found;
}
