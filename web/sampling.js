// Token selection of fused decode steps (a Decode's pick, py/ortpipe/sampling/sampler.py `Pick`) in
// the JS Decoder: the sampler's chain of kernels over one row of logits, with the arithmetic of
// py/ortpipe/targets/cpython/sampling.py (its docstring gives it), so that a seeded run gives the
// same tokens on every target. Scores are float32 (a Float32Array rounds each one as the kernels
// do); probabilities are float64, summed in index order over the scores left (a dropped score
// would add an exact 0).

export class Picker {
  /**
   * @param {{sample: boolean, temperature: number, top_k: number, top_p: number, min_p: number,
   *   penalty: number, seen: number[], banned: number[], uniforms: number[]}} pick
   * @param {number} vocab
   */
  constructor(pick, vocab) {
    this.pick = pick;
    this.vocab = vocab;
    this.seen = new Set(pick.seen);
    this.step = 0;
    this.scores = new Float32Array(vocab);
    this.penalty = Math.fround(pick.penalty);
    this.temperature = Math.fround(pick.temperature);
  }

  /**
   * The next step's token from the logits' `vocab` values at `start` of `data` (Float32Array, or
   * Uint16Array of float16 bits); throws NON_FINITE on NaN or +Infinity.
   */
  select(data, start) {
    const { pick, vocab, scores } = this;
    if (data instanceof Uint16Array) {
      for (let i = 0; i < vocab; i++) scores[i] = halfToFloat(data[start + i]);
    } else {
      scores.set(data.subarray(start, start + vocab));
    }
    let top = -Infinity;
    for (let i = 0; i < vocab; i++) {
      const value = scores[i];
      if (value !== value || value === Infinity) throw new Error(NON_FINITE);
      if (value > top) top = value;
    }
    for (const id of this.seen) {
      const value = scores[id];
      scores[id] = value < 0 ? value * this.penalty : value / this.penalty;
    }
    for (const id of pick.banned) scores[id] = -Infinity;
    let token;
    if (pick.sample) {
      for (let i = 0; i < vocab; i++) scores[i] /= this.temperature;
      token = this.draw(Math.fround(pick.uniforms[this.step]));
    } else {
      token = 0;
      for (let i = 1; i < vocab; i++) if (scores[i] > scores[token]) token = i;
    }
    this.step += 1;
    if (pick.penalty !== 1) this.seen.add(token);
    return token;
  }

  /** Top-k, top-p, min-p, then the draw with `u`, over the ids left (in index order). */
  draw(u) {
    const { pick, vocab, scores } = this;
    const topK = pick.top_k > 0 && pick.top_k < vocab ? pick.top_k : 0;
    const floor = topK ? kthLargest(scores, topK) : -Infinity;
    let ids = [];
    for (let i = 0; i < vocab; i++) if (scores[i] >= floor && scores[i] > -Infinity) ids.push(i);
    if (pick.top_p < 1) {
      const probs = probabilities(ids, scores);
      const { order, count } = topP(ids, scores, probs, pick.top_p, topK || vocab);
      const threshold = scores[ids[order[count - 1]]];
      ids = ids.filter((id) => scores[id] >= threshold);
    }
    if (pick.min_p > 0) {
      const probs = probabilities(ids, scores);
      const least = Math.max(...probs) * pick.min_p;
      ids = ids.filter((_, j) => probs[j] >= least);
    }
    const top = maximum(ids, scores);
    const cdf = new Float64Array(ids.length);
    let sum = 0;
    ids.forEach((id, j) => { sum += Math.exp(scores[id] - top); cdf[j] = sum; });
    const target = u * sum;
    let j = 0;
    while (cdf[j] < target) j++;
    return ids[j];
  }
}

export const NON_FINITE = "the model's logits are NaN or infinite";

function maximum(ids, scores) {
  let top = -Infinity;
  for (const id of ids) if (scores[id] > top) top = scores[id];
  return top;
}

/** exp(score - the largest) over their sum in index order, for each of `ids`. */
function probabilities(ids, scores) {
  const top = maximum(ids, scores);
  const e = ids.map((id) => Math.exp(scores[id] - top));
  let total = 0;
  for (const value of e) total += value;
  return e.map((value) => value / total);
}

/**
 * Top-p over `ids` (the positions into it): the highest scores first, ties by the lower id, at
 * most `limit` of them (the kernel's top-k); `count` of them are kept, those whose probability
 * above is below p. Only a prefix of the order is sorted, grown until the count is known.
 */
function topP(ids, scores, probs, p, limit) {
  const byRank = (a, b) => scores[ids[b]] - scores[ids[a]] || a - b;
  for (let size = 64; ; size *= 4) {
    const order = firstInRank(ids, scores, Math.min(size, limit, ids.length)).sort(byRank);
    let above = 0;
    let count = 0;
    while (count < order.length && above < p) above += probs[order[count++]];
    if (above >= p || order.length === Math.min(limit, ids.length)) return { order, count };
  }
}

/** The positions of the `size` highest scores among `ids` (ties: the lower positions), unordered. */
function firstInRank(ids, scores, size) {
  if (size >= ids.length) return ids.map((_, j) => j);
  const threshold = kthLargest(Float32Array.from(ids, (id) => scores[id]), size);
  const above = [];
  const at = [];
  ids.forEach((id, j) => {
    if (scores[id] > threshold) above.push(j);
    else if (scores[id] === threshold) at.push(j);
  });
  return above.concat(at.slice(0, size - above.length));
}

/** The k-th largest of `values`, duplicates counted: a min-heap of the k largest so far. */
function kthLargest(values, k) {
  const heap = new Float64Array(k);
  let size = 0;
  for (const value of values) {
    if (size < k) {
      let i = size++;
      heap[i] = value;
      while (i > 0) { // sift up
        const parent = (i - 1) >> 1;
        if (heap[parent] <= heap[i]) break;
        [heap[parent], heap[i]] = [heap[i], heap[parent]];
        i = parent;
      }
    } else if (value > heap[0]) {
      heap[0] = value;
      for (let i = 0; ;) { // sift down
        const left = 2 * i + 1;
        const right = left + 1;
        let least = i;
        if (left < k && heap[left] < heap[least]) least = left;
        if (right < k && heap[right] < heap[least]) least = right;
        if (least === i) break;
        [heap[least], heap[i]] = [heap[i], heap[least]];
        i = least;
      }
    }
  }
  return heap[0];
}

export function halfToFloat(bits) {
  const exponent = (bits >> 10) & 0x1f;
  const magnitude = exponent === 0 ? (bits & 0x3ff) * 2 ** -24
    : exponent === 0x1f ? ((bits & 0x3ff) ? NaN : Infinity)
      : (1 + (bits & 0x3ff) / 1024) * 2 ** (exponent - 15);
  return bits & 0x8000 ? -magnitude : magnitude;
}
