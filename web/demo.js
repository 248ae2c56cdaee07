// The demo page (index.html): load a model folder (a device, a variant), stream a generation with
// the sampling settings of its panel, show its speed; for a folder whose loop makes no tokens, play
// the audio, draw the image or show the embedding it makes. The status line follows the work at
// hand and ends with it: loading progress while a model loads, then what the generation did. Once a
// model has loaded it registers the service worker (sw.js) that keeps the whole bundle for offline
// use: precaching tens of megabytes must not slow down the first load, which fills the browser's
// HTTP cache with most of them anyway.

import { load, webgpuAvailable } from './ortpipe.js';

const $ = (id) => document.getElementById(id);
let pipe = null;
let chat = null; // chat mode's conversation with `pipe`, from its first message
let loadedKey = null; // "url|device|dtype" of the loaded pipeline
let loading = false; // a load is running: its progress events update the status
let offlineEnabled = false; // whether sw.js was registered

async function init() {
  const gpu = await webgpuAvailable();
  const option = $('device').querySelector('option[value=webgpu]');
  option.disabled = !gpu;
  option.textContent = gpu ? 'WebGPU' : 'WebGPU (not available in this browser)';
  $('device').querySelector('option[value=auto]').textContent = `Auto (${gpu ? 'WebGPU' : 'WebAssembly'})`;
  const [versions, models] = await Promise.all([json('versions.json'), json('models/index.json')]);
  if (versions) {
    $('versions').textContent = Object.entries(versions).map(([name, v]) => `${name} ${v}`).join(' · ');
  }
  for (const name of models ?? []) {
    $('models').append(new Option(`models/${name}/`));
  }
  // the first bundled model, unless the field holds a URL or is being typed into (a value set between the
  // typist's select-all and their text would have the text appended to it)
  const field = $('model-url');
  if (models?.length && !field.value && document.activeElement !== field) field.value = `models/${models[0]}/`;
}

async function json(url) {
  const response = await fetch(url);
  return response.ok ? response.json() : null;
}

/** The pipeline for the form's model and device, loading it when they changed. */
async function ensureLoaded() {
  const url = $('model-url').value.trim();
  const device = $('device').value;
  const dtype = $('dtype').value || null;
  if (!url) throw new Error('Enter the URL of a model folder, for example models/NAME/');
  if (pipe && loadedKey === `${url}|${device}|${dtype}`) return pipe;
  pipe?.dispose();
  pipe = null;
  chat = null; // it belonged to the pipeline just disposed
  $('model-info').textContent = '';
  const started = performance.now();
  showProgress(0, 'Starting…');
  loading = true;
  try {
    pipe = await load(url, { device, dtype, onProgress });
  } finally {
    loading = false;
    endProgress('');
  }
  loadedKey = `${url}|${device}|${dtype}`;
  $('denoising').hidden = pipe.info.loop !== 'denoising';
  $('mask-field').hidden = pipe.info.loop !== 'denoising';
  $('token-options').hidden = pipe.info.loop !== 'autoregressive';
  $('settings').hidden = pipe.info.loop !== 'autoregressive';

  enableOffline();
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  $('stat-load').textContent = `${seconds} s`;
  $('model-info').textContent = describe(url, pipe.info);
  showDefaults(pipe.info.defaults);
  endProgress(`Loaded in ${seconds} s`);
  return pipe;
}

/** What was loaded: the folder, the device (and wasm threads), the variant of each session. */
function describe(url, { device, threads, files, dtypes, tokenizer }) {
  const where = device === 'webgpu' ? 'WebGPU' : `WebAssembly, ${threads} thread${threads === 1 ? '' : 's'}`;
  const variants = Object.entries(files).map(([session, file]) => `${dtypes[session]} (${file})`);
  return `${url} on ${where} · ${[...new Set(variants)].join(', ')}` +
    (tokenizer ? '' : ' · no tokenizer.json: give the prompt as token ids');
}

function onProgress({ phase, file, loaded, total, message, early }) {
  if (!loading) return; // a kernel opened during a generation, or a late event: not the user's wait
  if (phase === 'download') {
    const mb = (n) => (n / 1e6).toFixed(1);
    showProgress(total ? loaded / total : null, `Downloading ${file}: ${mb(loaded)}${total ? ` of ${mb(total)}` : ''} MB`);
  } else if (phase === 'session') {
    showProgress(null, `Preparing ${file}${early ? ' while Python starts' : ''}…`);
  } else if (phase !== 'ready') {
    showProgress(null, message);
  }
}

function showProgress(fraction, text) {
  const bar = $('progress');
  bar.hidden = false;
  if (fraction === null) bar.removeAttribute('value');
  else bar.value = fraction;
  $('status').textContent = text;
}

/** The work is over: no progress bar, and `text` says how it ended. */
function endProgress(text) {
  $('progress').hidden = true;
  $('status').textContent = text;
}

/** A number field's value; what the browser could not read as a number (its value then "") is an error,
 * never taken as empty. */
function numberIn(input) {
  if (input.validity.badInput) {
    const hint = input.dataset.setting ? ', or clear it for the model\'s default' : '';
    throw new Error(`${input.dataset.setting ?? input.id} is not a number: correct it${hint}`);
  }
  return input.value === '' ? undefined : Number(input.value);
}

/** The sampling panel's options: the fields that are filled in, with the embed API's names. */
function samplingOptions() {
  const options = {};
  if ($('do-sample').value) options.doSample = $('do-sample').value === 'true';
  for (const input of document.querySelectorAll('#settings input[data-setting]')) {
    const value = numberIn(input);
    if (value !== undefined) options[input.dataset.setting] = value;
  }
  return options;
}

/** The model's defaults as the panel's placeholders, and in its summary line. */
function showDefaults(defaults) {
  const names = { temperature: 'temperature', topK: 'top_k', topP: 'top_p', minP: 'min_p',
    repetitionPenalty: 'repetition_penalty', frequencyPenalty: 'frequency_penalty', presencePenalty: 'presence_penalty',
    seed: 'seed', promptLookupNumTokens: 'prompt_lookup_num_tokens' };
  for (const input of document.querySelectorAll('#settings input[data-setting]')) {
    const value = defaults?.[names[input.dataset.setting]];
    input.placeholder = value === null || value === undefined ? '' : String(value);
  }
  $('do-sample').options[0].textContent = `Model default (${defaults?.do_sample ? 'sample' : 'greedy'})`;
  updateSummary();
}

function updateSummary() {
  let chosen;
  try {
    chosen = Object.entries(samplingOptions()).map(([k, v]) => `${k} ${v}`);
  } catch (error) {
    $('settings-summary').textContent = `(${error.message})`;
    return;
  }
  $('settings-summary').textContent = chosen.length ? `(${chosen.join(', ')})` : '(the model\'s defaults)';
}

function promptOptions() {
  const text = $('prompt').value;
  if (!$('prompt-is-ids').checked) return { prompt: text };
  const ids = text.split(/[\s,]+/).filter(Boolean).map(Number);
  if (!ids.length || ids.some((id) => !Number.isInteger(id) || id < 0)) {
    throw new Error('Token ids must be non-negative integers separated by commas or spaces');
  }
  return { promptIds: ids };
}

async function generate(event) {
  event.preventDefault();
  $('error').textContent = '';
  setRunning(true);
  let tokens = [];
  const output = $('output');
  const chatting = $('chat-mode').checked;
  $('media').replaceChildren();
  if (!chatting) output.replaceChildren();
  delete output.dataset.tokens;
  for (const id of ['stat-ttft', 'stat-speed', 'stat-tokens']) $(id).textContent = '–';
  try {
    const maxNewTokens = numberIn($('max-new-tokens'));
    let stream;
    let target = output; // where the streamed text goes
    if (chatting) {
      if ($('prompt-is-ids').checked || $('images').files.length) {
        throw new Error('A chat message is text: untick "The prompt is token ids" and clear the images');
      }
      const model = await ensureLoaded();
      if (!chat) { // a new conversation (chat mode just started, or another model was loaded)
        output.replaceChildren();
        chat = await model.chat(samplingOptions()); // a chat keeps its settings: "New chat" takes new ones
      }
      const message = $('prompt').value;
      target = Object.assign(document.createElement('div'), { className: 'turn assistant' });
      output.append(Object.assign(document.createElement('div'), { className: 'turn user', textContent: message }),
        target);
      $('status').textContent = 'Generating…';
      stream = chat.stream(message, { maxNewTokens });
      $('prompt').value = '';
    } else {
      const options = { ...promptOptions(), maxNewTokens };
      if ($('images').files.length) options.images = [...$('images').files];
      const model = await ensureLoaded();
      if (model.info.loop !== 'autoregressive') { // the sampling panel is for token loops
        await makeOutputs(model, options);
        return;
      }
      Object.assign(options, samplingOptions());
      // an encoder-decoder answers the prompt (a translation, ...): the answer starts on a line of its own
      const shown = (options.prompt ?? '') + (model.info.text_encoder && options.prompt ? '\n' : '');
      output.append(Object.assign(document.createElement('span'), { className: 'prompt', textContent: shown }));
      $('status').textContent = 'Generating…';
      stream = model.stream(options);
    }
    let step = await stream.next();
    while (!step.done) {
      tokens.push(step.value.token);
      target.append(step.value.text || (pipe.info.tokenizer ? '' : `${step.value.token} `));
      $('stat-tokens').textContent = tokens.length;
      step = await stream.next();
    }
    showResult(step.value);
    endProgress(`Generated ${step.value.tokens.length} tokens (${step.value.finishReason})`);
  } catch (error) {
    $('error').textContent = `${error.name}: ${error.message}`;
    endProgress(tokens.length ? `Stopped after ${tokens.length} tokens` : '');
  } finally {
    setRunning(false);
  }
}

/** A single_pass or denoising request: its audio, image or embedding on the page, a bar per step. */
async function makeOutputs(model, { maxNewTokens, ...options }) {
  if (model.info.loop === 'denoising') {
    Object.assign(options, {
      numSteps: numberIn($('num-steps')), guidanceScale: numberIn($('guidance-scale')),
      seed: numberIn($('image-seed')),
    });
    if ($('negative-prompt').value && options.guidanceScale > 1) options.negativePrompt = $('negative-prompt').value;
    if (options.images) options.strength = numberIn($('strength')); // image-to-image
    if ($('mask').files.length) options.mask = $('mask').files[0]; // inpainting (refused without an image)
  }
  options.onProgress = ({ step, steps }) => showProgress(step / steps, `Step ${step} of ${steps}`);
  let result;
  try {
    result = await model.generate(options);
  } finally {
    $('progress').hidden = true;
  }
  for (const [name, output] of Object.entries(result.outputs)) $('media').append(outputElement(name, output));
  const { timings } = result;
  $('status').textContent = timings.steps
    ? `${timings.steps} steps, ${Math.round(timings.stepMs)} ms a step` : `${Math.round(timings.prefillMs)} ms`;
  $('output').dataset.outputs = Object.keys(result.outputs).join(',');
  $('output').dataset.finishReason = result.finishReason;
}

/** An element showing a named output: an audio player, a canvas, or a line of values. */
function outputElement(name, output) {
  if (output.audio) {
    const audio = Object.assign(document.createElement('audio'), { controls: true, title: name });
    audio.src = URL.createObjectURL(wavBlob(output.audio, output.samplingRate));
    return audio;
  }
  if (output.image) {
    const canvas = Object.assign(document.createElement('canvas'), { width: output.image.width, height: output.image.height });
    canvas.title = name;
    canvas.getContext('2d').putImageData(output.image, 0, 0);
    return canvas;
  }
  const values = Array.from(output.data.slice(0, 6), (v) => Number(v).toFixed(4)).join(', ');
  return Object.assign(document.createElement('code'), { textContent: `${name} [${output.dims}]: ${values}, …` });
}

/** 16-bit PCM WAV of mono float samples. */
function wavBlob(samples, rate) {
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const text = (at, s) => [...s].forEach((c, i) => view.setUint8(at + i, c.charCodeAt(0)));
  text(0, 'RIFF'); view.setUint32(4, 36 + samples.length * 2, true); text(8, 'WAVEfmt ');
  view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
  view.setUint32(24, rate, true); view.setUint32(28, rate * 2, true); view.setUint16(32, 2, true);
  view.setUint16(34, 16, true); text(36, 'data'); view.setUint32(40, samples.length * 2, true);
  samples.forEach((v, i) => view.setInt16(44 + i * 2, Math.round(Math.max(-1, Math.min(1, v)) * 32767), true));
  return new Blob([view], { type: 'audio/wav' });
}

/** Chat mode on or off, or a new conversation: the old one is forgotten. */
function resetChat() {
  chat?.dispose();
  chat = null;
  $('output').replaceChildren();
  $('new-chat').hidden = !$('chat-mode').checked;
}

function showResult({ tokens, timings, finishReason }) {
  $('output').dataset.tokens = tokens.join(',');
  $('output').dataset.finishReason = finishReason;
  $('stat-ttft').textContent = `${Math.round(timings.firstTokenMs)} ms`;
  const drafts = timings.draftedTokens ? ` (speculative: ${timings.acceptedTokens} of ${timings.draftedTokens} drafts taken)` : '';
  $('stat-speed').textContent = tokens.length > 1 ? `${timings.decodeTokensPerS.toFixed(1)} tok/s${drafts}` : '–';
  $('stat-tokens').textContent = `${tokens.length} (${finishReason})`;
}

function setRunning(running) {
  $('generate').disabled = running;
  $('load').disabled = running;
  $('new-chat').disabled = running;
  $('stop').disabled = !running;
}

/** Register sw.js (once) and say in the footer when the page works offline. */
async function enableOffline() {
  if (offlineEnabled || !('serviceWorker' in navigator)) return;
  offlineEnabled = true;
  const updating = Boolean(navigator.serviceWorker.controller);
  navigator.serviceWorker.addEventListener('controllerchange', () => {
    if (updating) $('offline').textContent = 'A new version was installed: reload the page to use it.';
    else if (!self.crossOriginIsolated) isolatedByReload();
  });
  try {
    await navigator.serviceWorker.register('sw.js');
    await navigator.serviceWorker.ready;
    if (!$('offline').textContent) $('offline').textContent = 'Works offline';
  } catch (error) {
    $('offline').textContent = `Not available offline: ${error.message}`;
  }
}

$('load-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  $('error').textContent = '';
  setRunning(true);
  try {
    await ensureLoaded();
  } catch (error) {
    $('error').textContent = `${error.name}: ${error.message}`;
    endProgress('');
  } finally {
    setRunning(false);
    $('stop').disabled = true;
  }
});

$('generate-form').addEventListener('submit', generate);
$('settings').addEventListener('input', updateSummary);
$('stop').addEventListener('click', () => pipe?.interrupt());
$('chat-mode').addEventListener('change', resetChat);
$('new-chat').addEventListener('click', resetChat);
/**
 * Whether to make the page cross-origin isolated with sw.js's headers: on a host that does not send
 * them, wasm runs one thread. Loopback hosts are left alone (`ortpipe web --coop` sends the headers
 * itself); ?isolate=1 or ?isolate=0 decides.
 */
function wantsIsolation() {
  const asked = new URLSearchParams(location.search).get('isolate');
  if (asked !== null) return asked === '1';
  return !['localhost', '127.0.0.1', '[::1]'].includes(location.hostname);
}

/** sw.js now answers this page's requests: reload once to be isolated, unless a model is in use. */
function isolatedByReload() {
  if (!wantsIsolation() || sessionStorage.getItem('ortpipe-isolation-reload')) return;
  if (pipe || loading) {
    $('offline').textContent = 'Reload the page to run on several threads.';
    return;
  }
  sessionStorage.setItem('ortpipe-isolation-reload', '1'); // once per tab: never a reload loop
  location.reload();
}

init();
updateSummary();
if (navigator.serviceWorker?.controller) enableOffline(); // installed on an earlier visit: look for updates
else if (!self.crossOriginIsolated && self.isSecureContext && wantsIsolation()) enableOffline(); // a static host
