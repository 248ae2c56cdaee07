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
