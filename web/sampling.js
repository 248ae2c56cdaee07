// Token selection of fused decode steps (a Decode's pick, py/ortpipe/sampling/sampler.py `Pick`) in
// the JS Decoder: the sampler's chain of kernels over one row of logits, with the arithmetic of
// py/ortpipe/targets/cpython/sampling.py (its docstring gives it), so that a seeded run gives the
// same tokens on every target. Scores are float32 (a Float32Array rounds each one as the kernels
// do); probabilities are float64, summed in index order over the scores left (a dropped score
// would add an exact 0).

export class Picker {
  /**
   * @param {{sample: boolean, temperature: number, top_k: number, top_p: number, min_p: number,
   *   penalty: number, seen: number[], banned: number[], uniforms: number[], frequency: number,
   *   presence: number, counts: number[][], bias: number[][]}} pick
   * @param {number} vocab
   * @param {Uniforms} [uniforms] the burst's uniforms (a draft model's Picker shares the model's)
   */
  constructor(pick, vocab, uniforms = null) {
    this.pick = pick;
    this.vocab = vocab;
    this.seen = new Set(pick.seen);
    this.counts = new Map(pick.counts); // id -> times generated, for the frequency and presence penalties
    this.counting = Boolean(pick.frequency || pick.presence);
    this.uniforms = uniforms ?? new Uniforms(pick.uniforms);
    this.buffer = new Float32Array(vocab);
    this.penalty = Math.fround(pick.penalty);
    this.temperature = Math.fround(pick.temperature);
    this.topK = pick.top_k > 0 && pick.top_k < vocab ? pick.top_k : 0;
  }

  /**
   * The next step's token from the logits' `vocab` values at `start` of `data` (Float32Array, or
   * Uint16Array of float16 bits); throws NON_FINITE on NaN or +Infinity.
   */
  select(data, start) {
    const scores = this.scores(data, start);
    const token = this.pick.sample ? drawn(this.kept(scores), this.uniforms.peek(0)) : argmax(scores);
    this.took([token]);
    return token;
  }

  /** The burst selected `tokens`: their uniforms taken (one a token, when sampling), and seen from now
   * on, for the repetition penalty. */
  took(tokens) {
    if (this.pick.sample) this.uniforms.taken += tokens.length;
    if (this.pick.penalty !== 1) for (const token of tokens) this.seen.add(token);
    if (this.counting) for (const token of tokens) this.counts.set(token, (this.counts.get(token) ?? 0) + 1);
  }

  /** The processed float32 scores of one row of logits, after the text and `drafts` (reused: read
   * them before the next call). */
  scores(data, start, drafts = []) {
    const { pick, vocab, buffer: scores } = this;
    if (data instanceof Uint16Array) {
      for (let i = 0; i < vocab; i++) scores[i] = halfToFloat(data[start + i]);
    } else {
      scores.set(data.subarray(start, start + vocab));
    }
    for (let i = 0; i < vocab; i++) {
      const value = scores[i];
      if (value !== value || value === Infinity) throw new Error(NON_FINITE);
    }
    for (const [id, bias] of pick.bias) scores[id] += Math.fround(bias); // the logit bias
    const seen = drafts.length && pick.penalty !== 1 ? new Set([...this.seen, ...drafts]) : this.seen;
    for (const id of seen) {
      const value = scores[id];
      scores[id] = value < 0 ? value * this.penalty : value / this.penalty;
    }
    let counts = this.counts;
    if (drafts.length && this.counting) {
      counts = new Map(counts);
      for (const token of drafts) counts.set(token, (counts.get(token) ?? 0) + 1);
    }
    // each amount rounded to float32 once, the difference rounded by the Float32Array (as float32 arithmetic)
    for (const [id, n] of counts) scores[id] -= Math.fround(n * pick.frequency + pick.presence);
    for (const id of pick.banned) scores[id] = -Infinity;
    if (pick.sample) for (let i = 0; i < vocab; i++) scores[i] /= this.temperature;
    return scores;
  }

  /** {ids, e}: the ids top-k, top-p and min-p leave (in index order), and exp(score - the largest)
   * of each (the largest is never dropped). */
  kept(scores) {
    const { pick, vocab, topK } = this;
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
    return { ids, e: Float64Array.from(ids, (id) => Math.exp(scores[id] - top)) };
  }

  /** A draft model's draft after `drafts` from its row of logits at `start`, drawn with the uniform of
   * its position (not taken: the model's selections take them). */
  sample(data, start, drafts) {
    return drawn(this.kept(this.scores(data, start, drafts)), this.uniforms.peek(drafts.length));
  }

  /**
   * [drafts accepted, the token after them] of a speculative round whose check gave the rows at
   * `starts` of `data` (one per checked position): the longest prefix of drafts equal to the rows'
   * own selections, each as a plain step there would select (sampling: with the uniform of its
   * position, left for `took`), as py/ortpipe/targets/cpython/sampling.py's `check`.
   */
  check(data, starts, drafts) {
    for (let i = 0; ; i++) {
      const scores = this.scores(data, starts[i], drafts.slice(0, i));
      const token = this.pick.sample ? drawn(this.kept(scores), this.uniforms.peek(i)) : argmax(scores);
      if (i === drafts.length || token !== drafts[i]) return [i, token];
    }
  }
}

/** The uniform numbers of a burst, one a token, taken in order. */
export class Uniforms {
  constructor(values) {
    this.values = values;
    this.taken = 0;
  }

  /** The i-th number after those taken, not taken. */
  peek(i) {
    return Math.fround(this.values[this.taken + i]);
  }
}

/** The first id whose running sum of `e`, in index order, reaches u times the sum. */
function drawn({ ids, e }, u) {
  const cdf = new Float64Array(e.length);
  let total = 0;
  e.forEach((value, j) => { total += value; cdf[j] = total; });
  const target = u * total;
  let j = 0;
  while (cdf[j] < target) j++;
  return ids[j];
}

/** The first index of the largest score. */
function argmax(scores) {
  let token = 0;
  for (let i = 1; i < scores.length; i++) if (scores[i] > scores[token]) token = i;
  return token;
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

/** The k-th largest of `values`, duplicates counted: a min-heap of the k largest so far (indexed
 * loops and plain swaps: this runs over the whole vocabulary at every sampled step). */
function kthLargest(values, k) {
  const heap = new Float64Array(k);
  let size = 0;
  const n = values.length;
  for (let v = 0; v < n; v++) {
    const value = values[v];
    if (size < k) {
      let i = size++;
      heap[i] = value;
      while (i > 0) { // sift up
        const parent = (i - 1) >> 1;
        if (heap[parent] <= heap[i]) break;
        const swap = heap[parent];
        heap[parent] = heap[i];
        heap[i] = swap;
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
        const swap = heap[least];
        heap[least] = heap[i];
        heap[i] = swap;
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
