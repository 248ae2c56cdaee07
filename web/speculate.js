// Speculative decoding inside a burst of the worker's fused decode steps: the JS twin of the rounds
// the CPython driver runs (py/ortpipe/targets/cpython/speculate.py) and of the core's drafting and
// draft length (py/ortpipe/loops/speculative.py: NgramIndex, DraftLength), which it mirrors rule
// for rule. A round drafts (prompt lookup over the text, or steps of a draft model's
// Decoder: its argmax, or when the request samples a draw from its processed distribution with the
// uniform of the draft's position), runs the model's Decoder once over the pending token and the
// drafts, keeps the longest prefix of drafts equal to its own selections (the argmax, or as the
// request's Picker selects, web/sampling.js) plus its selection after them, and rolls the caches back to
// what was kept: a shared buffer only by its length (the next run's mask says it), a concat cache
// by narrowing each entry (a copy on the CPU; ortpipe's narrow kernel on the GPU). Python hands the
// text and the draft length's state over before a burst (`prepare`) and takes them back after it
// (`state`); tokens cross as ids only. The worker's bridge makes Speculators (`speculator` below).

import { argmaxRow, typedArray } from './bridge.js';
import { NON_FINITE, Picker } from './sampling.js';

// The core's constants (loops/speculative.py).
const MAX_PAUSE = 16;
const HOPELESS_PAUSE = 128;
const SHADOW_STEPS = 8;
const SHADOW_STEPS_MOST = 32; // where the core runs the rounds: looks that draft nothing wait longer
const SAMPLES = 15;
const DECAY = 0.9;
const BURST_MS = 50; // as the plain Decoder's bursts

/** What followed the latest earlier occurrence of each n-gram of the text (NgramIndex). */
export class NgramIndex {
  constructor(size) {
    this.size = size;
    this.reset();
  }

  reset() {
    this.last = Array.from({ length: this.size }, () => new Map());
    this.indexed = 0;
    this.matched = 0; // the length of the n-gram the last proposal matched (0: none)
  }

  propose(tokens, k) {
    const end = tokens.length - 1;
    if (end < this.indexed) this.reset();
    for (let i = this.indexed; i < end; i++) {
      for (let n = 1; n <= Math.min(this.size, i + 1); n++) {
        this.last[n - 1].set(tokens.slice(i - n + 1, i + 1).join(','), i);
      }
    }
    this.indexed = Math.max(this.indexed, end);
    for (let n = Math.min(this.size, tokens.length); n > 0; n--) {
      const at = this.last[n - 1].get(tokens.slice(tokens.length - n).join(','));
      if (at !== undefined) {
        const draft = [];
        for (let i = at + 1; i < at + 1 + k; i++) draft.push(i < tokens.length ? tokens[i] : draft[i - tokens.length]);
        this.matched = n;
        return draft;
      }
    }
    this.matched = 0;
    return [];
  }
}

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const middle = sorted.length >> 1;
  return sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
}

function keepLast(values, value) {
  values.push(value);
  if (values.length > SAMPLES) values.shift();
}

/** The draft length with the most tokens per unit of time (DraftLength). */
export class DraftLength {
  constructor(most, state) {
    this.most = most;
    Object.assign(this, state); // hits, misses (per source), ones, extras, drafts, wait, pause, shadows, overhead, probe
    this.source = 0;
    this.probing = false;
  }

  next(room) {
    this.probing = false;
    if (room <= 0) return 0;
    if (this.wait) {
      this.wait -= 1;
      return 0;
    }
    const most = Math.min(this.most, room);
    if (this.hits.some((_, source) => this.best(most, source))) {
      this.pause = 0;
      return most;
    }
    if (this.shadows) {
      this.wait = this.quiet();
      return 0;
    }
    const pays = this.couldPay(most);
    if (!pays && this.pause !== HOPELESS_PAUSE) { // a first pause, before any probe
      this.pause = HOPELESS_PAUSE;
      this.wait = HOPELESS_PAUSE;
      return 0;
    }
    this.pause = pays ? Math.min(MAX_PAUSE, 2 * this.pause || 1) : HOPELESS_PAUSE;
    this.wait = this.pause;
    this.probing = true;
    return Math.min(this.probe, most);
  }

  fit(source, k) {
    this.source = source;
    if (this.probing) return k;
    const best = k ? this.best(k, source) : 0;
    if (!best && this.overhead) this.wait = this.quiet();
    else if (best && this.shadows) this.pause = 0;
    return best;
  }

  quiet() {
    if (!this.overhead) return SHADOW_STEPS - 1;
    this.pause = Math.min(SHADOW_STEPS_MOST, 2 * this.pause || SHADOW_STEPS);
    return this.pause - 1;
  }

  best(most, source = 0) {
    const rate = this.hits[source] / (this.hits[source] + this.misses[source]);
    const cost = median(this.extras) + median(this.drafts);
    let [best, bestK, tokens, term] = [1, 0, 1, 1];
    for (let k = 1; k <= most; k++) {
      term *= rate;
      tokens += term;
      const spent = 1 + this.overhead + cost * k;
      if (tokens / spent > best) [best, bestK] = [tokens / spent, k];
    }
    return bestK;
  }

  couldPay(most) {
    const cost = median(this.extras) + median(this.drafts);
    for (let k = 1; k <= most; k++) if (k + 1 > 1 + this.overhead + cost * k) return true;
    return false;
  }

  update(drafted, accepted) {
    const s = this.source;
    this.hits[s] = DECAY * this.hits[s] + accepted;
    this.misses[s] = DECAY * this.misses[s] + (accepted < drafted ? 1 : 0);
    if (this.probing) this.probe = accepted === drafted ? Math.min(this.most, 2 * this.probe) : 1;
  }

  shadow(source, taken) {
    this.source = source;
    this.update(1, taken ? 1 : 0);
  }

  /** The median run of one token; 0 before any, or when the clock is too coarse to see one (the
   * browser's timer can read 0 for a fast run: the ratios wait for a measurable one). */
  one() {
    return this.ones.length ? median(this.ones) : 0;
  }

  timed(tokens, seconds) {
    if (tokens === 1) keepLast(this.ones, seconds);
    else if (this.one() > 0) keepLast(this.extras, Math.max(0, (seconds / this.one() - 1) / (tokens - 1)));
  }

  drafted(steps, seconds) {
    if (this.one() > 0 && steps) keepLast(this.drafts, seconds / steps / this.one());
  }

  state() {
    const { hits, misses, ones, extras, drafts, wait, pause, shadows, overhead, probe } = this;
    return { hits, misses, ones, extras, drafts, wait, pause, shadows, overhead, probe };
  }
}

/** Runs of several new tokens at once over a Decoder's session and cache (web/bridge.js). */
class Tokens {
  /** `layout`: "shared" or "concat"; `narrow(tensor, axis, length)`: a GPU tensor narrowed by a kernel. */
  constructor(ort, decoder, layout, seqAxes, narrow) {
    this.ort = ort;
    this.decoder = decoder;
    this.layout = layout;
    this.seqAxes = seqAxes;
    this.narrow = narrow;
  }

  /** Feed `tokens` from position `past`: {data, starts}, the logits and where each new token's row
   * starts in them. */
  async run(tokens, past) {
    const d = this.decoder;
    const { ids, mask, positions, name, vocab, gpu } = d.spec;
    const n = tokens.length;
    const { Tensor } = this.ort;
    const feeds = { ...d.cache };
    feeds[ids[0]] = new Tensor(ids[1], typedArray(ids[1], tokens), [1, n]);
    if (mask) feeds[mask[0]] = new Tensor(mask[1], d.ones.subarray(0, past + n), [1, past + n]);
    if (positions) {
      feeds[positions[0]] = new Tensor(positions[1], typedArray(positions[1], tokens.map((_, i) => past + i)), [1, n]);
    }
    let result;
    try {
      result = await d.session.run(feeds, d.spec.outputs);
    } catch (cause) {
      throw named(`session "${name}" failed on a decode step at position ${past}: ${cause?.message ?? cause}`);
    }
    for (const [present, pastName] of d.presents) d.put(pastName, result[present]);
    const logits = result[d.spec.logits];
    const data = gpu ? await logits.getData() : logits.data;
    if (gpu) {
      logits.dispose();
      for (const other of d.others) result[other].dispose();
    }
    return { data, starts: Array.from({ length: n }, (_, i) => data.length - (n - i) * vocab) };
  }

  /** The argmax of each row (`past`: the first row's position, for the message). */
  picks({ data, starts }, past) {
    try {
      return starts.map((start) => argmaxRow(data, start, this.decoder.spec.vocab));
    } catch {
      throw this.nonFinite(past);
    }
  }

  nonFinite(past) {
    return named(`session "${this.decoder.spec.name}" gave NaN or infinite logits on the decode step at `
      + `position ${past}: the model's weights or inputs are broken`);
  }

  /** Forget the positions from `length` on: a concat cache is narrowed, a shared buffer is not. */
  async keep(length) {
    const d = this.decoder;
    if (this.layout === 'shared') return;
    for (const pastName of Object.keys(this.seqAxes)) {
      const tensor = d.cache[pastName];
      const axis = this.seqAxes[pastName];
      if (tensor.dims[axis] <= length) continue;
      d.put(pastName, d.spec.gpu ? await this.narrow(tensor, axis, length) : narrowed(this.ort, tensor, axis, length));
    }
  }
}

/** A CPU tensor's first `length` positions along `axis`, copied. */
function narrowed(ort, tensor, axis, length) {
  const dims = Array.from(tensor.dims);
  const outer = dims.slice(0, axis).reduce((a, b) => a * b, 1);
  const inner = dims.slice(axis + 1).reduce((a, b) => a * b, 1);
  const data = new tensor.data.constructor(outer * length * inner);
  for (let o = 0; o < outer; o++) {
    data.set(tensor.data.subarray(o * dims[axis] * inner, (o * dims[axis] + length) * inner), o * length * inner);
  }
  dims[axis] = length;
  return new ort.Tensor(tensor.type, data, dims);
}

function named(message) {
  const error = new Error(message);
  error.name = 'OrtpipeError';
  return error;
}

/**
 * Speculative rounds of one request: `burst(token, past, limit)` as the plain Decoder's, drafting
 * by prompt lookup (`spec.ngram`) or with the draft model's Decoder (`draft`).
 * @param {{eos: number[], most: number, ngram: number, layout: string, seqAxes: Object<string, number>,
 *   draftLayout: string, draftSeqAxes: Object<string, number>}} spec the cache layouts and each past
 *   input's sequence axis, of the model and the draft model
 */
export class Speculator {
  constructor(ort, target, draft, spec, narrow) {
    this.target = new Tokens(ort, target, spec.layout, spec.seqAxes, narrow);
    this.draft = draft ? new Tokens(ort, draft, spec.draftLayout, spec.draftSeqAxes, narrow) : null;
    this.eos = new Set(spec.eos);
    this.most = spec.most;
    this.ngram = spec.ngram ? new NgramIndex(spec.ngram) : null;
    this.text = [];
    this.resets = -1;
  }

  /** Before a burst: the text so far (JSON ids, ending with the burst's token), the core's draft
   * length state, how much of the text the draft model has seen, and its count of rewinds. */
  prepare(json) {
    const { tokens, length, draftedTo, resets } = JSON.parse(json);
    if (resets !== this.resets) this.ngram?.reset();
    this.resets = resets;
    this.text = tokens;
    this.length = new DraftLength(this.most, length);
    this.draftedTo = draftedTo;
    this.drafted = 0;
    this.accepted = 0;
    this.rounds = 0;
  }

  /** After a burst: JSON {length, drafted, accepted, rounds, draftedTo} for the core's speculator. */
  state() {
    const { drafted, accepted, rounds, draftedTo } = this;
    return JSON.stringify({ length: this.length.state(), drafted, accepted, rounds, draftedTo });
  }

  /** Rounds from `token` at `past` until `limit` tokens, an eos or BURST_MS. `pick`: how the request
   * selects (the core's Pick; null: the argmax): its Picker checks the drafts, and a sampled request's
   * draft model samples them with the uniforms of their positions (web/sampling.js): no draft
   * length changes the tokens. A round's measured cost takes in its checks and the caches rolled
   * back. */
  async burst(token, past, limit, pick = null) {
    const out = [];
    const started = performance.now();
    let position = past;
    // a shared buffer fed only the positions it holds, as the plain Decoder's bursts feed it (Decoder.narrow)
    if (this.target.decoder.spec.grow) this.target.decoder.narrow(past);
    if (this.draft?.decoder.spec.grow) this.draft.decoder.narrow(this.draftedTo);
    this.picker = pick ? new Picker(pick, this.target.decoder.spec.vocab) : null;
    this.drafter = null;
    if (this.draft && pick?.sample) {
      this.drafter = new Picker(pick, this.draft.decoder.spec.vocab, this.picker.uniforms);
      this.drafter.seen = this.picker.seen;
      this.drafter.counts = this.picker.counts;
    }
    for (;;) {
      let k = this.length.next(limit - out.length - 1);
      let drafts = [];
      if (k && this.draft) {
        k = this.length.fit(0, k);
        if (k) {
          const t = performance.now();
          drafts = await this.draftTokens(k);
          this.length.drafted(drafts.length, (performance.now() - t) / 1000);
        }
      } else if (k) {
        drafts = this.ngram.propose(this.text, k);
        drafts = drafts.slice(0, this.length.fit(Math.max(0, this.ngram.matched - 1), drafts.length));
      }
      const t = performance.now();
      const rows = await this.target.run([this.text[this.text.length - 1], ...drafts], position);
      let accepted;
      let token;
      if (this.picker) {
        try {
          [accepted, token] = this.picker.check(rows.data, rows.starts, drafts);
        } catch (error) {
          if (error.message === NON_FINITE) throw this.target.nonFinite(position);
          throw error;
        }
      } else {
        const picks = this.target.picks(rows, position);
        accepted = 0;
        while (accepted < drafts.length && drafts[accepted] === picks[accepted]) accepted += 1;
        token = picks[accepted];
      }
      const kept = [...drafts.slice(0, accepted), token];
      const eos = kept.findIndex((id) => this.eos.has(id));
      if (eos >= 0) kept.length = eos + 1;
      this.picker?.took(kept);
      const took = Math.min(accepted, kept.length);
      if (drafts.length) {
        this.length.update(drafts.length, took);
        this.drafted += drafts.length;
        this.accepted += took;
        this.rounds += 1;
      } else if (this.ngram && this.length.shadows) { // a plain step: lookup's proposal, checked in its shadow
        const proposal = this.ngram.propose(this.text, 1);
        if (proposal.length) this.length.shadow(this.ngram.matched - 1, proposal[0] === kept[0]);
      }
      await this.target.keep(position + kept.length);
      this.length.timed(drafts.length + 1, (performance.now() - t) / 1000);
      if (this.draft) {
        this.draftedTo = Math.min(this.draftedTo, position + 1 + took);
        await this.draft.keep(this.draftedTo);
      }
      out.push(...kept);
      this.text.push(...kept);
      position += kept.length;
      if (out.length >= limit || this.eos.has(out[out.length - 1]) || performance.now() - started >= BURST_MS) {
        return out;
      }
    }
  }

  /** Up to k tokens of the draft model after the text (it runs what it has not seen first): its
   * argmax, or drawn by the drafter (a sampled request's, with the uniforms of their positions). */
  async draftTokens(k) {
    let fed = this.text.slice(this.draftedTo);
    const drafts = [];
    for (;;) {
      const rows = await this.draft.run(fed, this.draftedTo);
      const last = { data: rows.data, starts: rows.starts.slice(-1) };
      const at = this.draftedTo + fed.length - 1;
      let token;
      if (this.drafter) {
        try {
          token = this.drafter.sample(last.data, last.starts[0], drafts);
        } catch (error) {
          if (error.message === NON_FINITE) throw this.draft.nonFinite(at);
          throw error;
        }
      } else {
        [token] = this.draft.picks(last, at);
      }
      this.draftedTo += fed.length;
      drafts.push(token);
      if (drafts.length === k || this.eos.has(token)) return drafts;
      fed = [token];
    }
  }
}

/**
 * A Speculator over Decoders, with the JSON `spec`, for `bridge` (the worker's, whose method this is);
 * `narrowGraphs` (kernel name -> graph bytes) when a concat cache on the GPU is narrowed by ortpipe's
 * narrow kernel.
 */
export function speculator(bridge, target, draft, spec, narrowGraphs) {
  const narrow = async (tensor, axis, length) => {
    const name = `kernel:narrow_${tensor.type}`;
    const int64 = (value) => bridge.tensor('int64', [value], [1]);
    const [y] = await bridge.runKernel(name, narrowGraphs?.[name], 'webgpu', ['x', 'start', 'end', 'axis'],
      [tensor, int64(0), int64(length), int64(axis)], ['y']);
    return y;
  };
  return new Speculator(bridge.ort, target, draft ?? null, JSON.parse(spec), narrow);
}
