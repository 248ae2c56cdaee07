// Types of ortpipe's embed API (ortpipe.js).

/** Where a model runs: "auto" takes WebGPU when the browser has an adapter, else wasm. */
export type Device = 'auto' | 'webgpu' | 'wasm';

/**
 * Progress: loading (the runtime starting, a file downloading, a session being prepared), then the
 * work of a loop that makes no tokens: a denoising step, a batch of texts embedded (`step` of `steps`).
 */
export interface Progress {
  phase: 'runtime' | 'download' | 'session' | 'ready' | 'step' | 'batch';
  step?: number;
  steps?: number;
  /** The file being downloaded or prepared. */
  file?: string;
  /** Bytes downloaded so far, and in all (0 when the server does not say). */
  loaded?: number;
  total?: number;
  /** A session made from the early downloads, while Python started. */
  early?: boolean;
  message?: string;
}

/** A model variant, as transformers.js names them (model.onnx fp32, model_quantized.onnx q8, model_q4.onnx, ...). */
export type Dtype = 'fp32' | 'fp16' | 'q8' | 'int8' | 'uint8' | 'q4' | 'q4f16' | 'bnb4';

export interface LoadOptions {
  device?: Device;
  /** The variant to run, for every session or per session name; by default the device's fastest the folder has. */
  dtype?: Dtype | Record<string, Dtype>;
  /** Run the folder's plugin (pipeline.plugin: Python code from the wheel in the folder), if it has one;
   * without it such a folder is refused. */
  allowPlugins?: boolean;
  onProgress?: (progress: Progress) => void;
}

export interface ChatMessage {
  role: string;
  content: string;
}

/**
 * An image for a vision-language model: a URL (relative to the page, or absolute on this origin),
 * a Blob or File (PNG, JPEG, WebP, ... whatever the browser decodes), an ImageBitmap or an ImageData.
 * Files are decoded without colour-space conversion and turned upright by their EXIF orientation;
 * transparent pixels are laid over white. The model folder's image processor config
 * (preprocessor_config.json, ...) says how the pixels become the vision session's inputs.
 */
export type ImageSource = string | URL | Blob | ImageBitmap | ImageData;

/** One of prompt, promptIds and messages; settings default to the model's genai_config.json. */
export interface GenerateOptions {
  /** Text, encoded with the folder's tokenizer.json. */
  prompt?: string;
  /** Token ids (a typed array, e.g. a tokenizer's BigInt64Array, is taken as its numbers). */
  promptIds?: number[] | Int32Array | Uint32Array | BigInt64Array;
  /** A conversation, rendered with tokenizer_config.json's chat_template. */
  messages?: ChatMessage[];
  /**
   * Images, in the order of the image tokens in the prompt (one `tokens.image_token` id each; the
   * pipeline expands it to the image's feature rows). A GenerationError names an image that cannot
   * be fetched or decoded.
   */
  images?: ImageSource[];
  /** Inpainting (a denoising folder with a VAE encoder): an image of the one in `images`' size, white where
   * it is repainted, black where it is kept; `strength` defaults to 1 with it (0.9999 on a Stable Diffusion XL
   * folder, 0.6 on a Stable Diffusion 3 folder, as diffusers' pipelines). */
  mask?: ImageSource;
  /** A denoising folder's initial latents (as diffusers' `latents=`): float32 [1, channels, height, width]. */
  latents?: { data: Float32Array | number[]; dims: number[] };
  /** Tensors for named graph inputs (as CPython's `inputs=`), e.g. a plugin's features; the element type
   * follows the typed array (plain numbers are float32), and the core checks each against its graph. */
  inputs?: Record<string, { data: Float32Array | BigInt64Array | Int32Array | Uint8Array | Int8Array | Float64Array | number[]; dims: number[] }>;

  /** An encoder-decoder's language (a code its generation_config.json's lang_to_id names, e.g. 'en'): the
   * decoder's start ids hold it; without it the model chooses (result.language says which). */
  language?: string;
  /** An encoder-decoder's task, a name its task_to_id gives ('transcribe', 'translate'). */
  task?: string;

  /** Each denoising step as it ends ({phase: 'step', step, steps}); the pipeline's onProgress otherwise. */
  onProgress?: (progress: Progress) => void;
  // generation settings: written by `python -m build.typescript` from py/ortpipe/config/settings.py
  /** Tokens to generate at most. */
  maxNewTokens?: number;
  /** Prompt and generated tokens together, at most. */
  maxLength?: number;
  /** Sample instead of taking the most likely token. */
  doSample?: boolean;
  /** 0 is greedy. */
  temperature?: number;
  /** Keep the k most likely tokens; 0 turns it off. */
  topK?: number;
  /** Keep the most likely tokens up to this probability; 1 turns it off. */
  topP?: number;
  /** Drop tokens less likely than this times the most likely; 0 turns it off. */
  minP?: number;
  /** Divide the scores of tokens seen so far; 1 turns it off. */
  repetitionPenalty?: number;
  /** Subtract this times the number of times a token was generated so far from its score (OpenAI's frequency_penalty; the prompt is not counted); 0 turns it off. */
  frequencyPenalty?: number;
  /** Subtract this from the score of every token generated so far (OpenAI's presence_penalty; the prompt is not counted); 0 turns it off. */
  presencePenalty?: number;
  /** Add a bias to the scores of token ids, {id: bias} with each bias from -100 to 100 (OpenAI's logit_bias: -100 bans a token, 100 all but forces it). */
  logitBias?: Record<number, number>;
  /** The seed of the sampler and of the initial noise: the same seed gives the same tokens or image on every target. */
  seed?: number;
  /** Never repeat an n-gram of this size; 0 turns it off. */
  noRepeatNgramSize?: number;
  /** No eos before prompt and generated tokens reach this length. */
  minLength?: number;
  /** No eos before this many tokens were generated. */
  minNewTokens?: number;
  /** Token ids never generated. */
  suppressTokens?: number[];
  /** Token ids not generated first (the first token after the prompt). */
  beginSuppressTokens?: number[];
  /** The first generated token is this id (BART's and mBART's, whose target language it names). */
  forcedBosTokenId?: number;
  /** The token at the last position the length limit allows is this id (an end of sequence there, as BART's and Marian's searches end). */
  forcedEosTokenId?: number;
  /** Generation ends before any of these strings, which are not returned. */
  stop?: string | string[];
  /** Beam search with this many beams; 1 turns it off. */
  numBeams?: number;
  /** Beam scores are divided by length to this power. */
  lengthPenalty?: number;
  /** Beam search ends once num_beams hypotheses are finished. */
  earlyStopping?: boolean;
  /** Beam search: each beam's scores are log-softmaxed again after its bans (transformers' renormalize_logits; greedy and sampled selections are the same either way). */
  renormalizeLogits?: boolean;
  /** Hypotheses returned by beam search (result.sequences). */
  numReturnSequences?: number;
  /** Give each generated token's log-probability and this many most likely alternatives (chunk.logprob, chunk.top_logprobs). */
  logprobs?: number;
  /** Denoising steps. */
  numSteps?: number;
  /** Classifier-free guidance: above 1 runs a conditional and an unconditional row. */
  guidanceScale?: number;
  /** With guidance: mix in the guided prediction rescaled to the conditional one's standard deviation (diffusers' guidance_rescale, for zero terminal SNR models; 0 keeps it as it is). */
  guidanceRescale?: number;
  /** The noise DDIMScheduler's and TCDScheduler's steps add, 0 (none) to 1 (diffusers' eta: DDIM's share of each step's variance, TCD's gamma; other schedulers refuse it). */
  eta?: number;
  /** What the image should not show (the unconditional row's text). */
  negativePrompt?: string;
  /** Image-to-image: how far the image is noised, 0 to 1 (the last int(num_steps * strength) steps run; 1 keeps nothing of it). */
  strength?: number;
  /** With guidance and no negative prompt: the unconditional row's text states are zeros, the text encoders run on the prompt alone (diffusers' Stable Diffusion XL folders say so in model_index.json). */
  forceZerosForEmptyPrompt?: boolean;
  /** Speculative decoding with drafts looked up in the prompt and the text so far, at most this many tokens a step (transformers' name); 0 turns it off. */
  promptLookupNumTokens?: number;
  /** Speculative decoding with drafts that continue an earlier occurrence of the last this-many tokens (onnxruntime-genai's speculative.ngram_size); 0 turns it off. */
  ngramSize?: number;
  /** Drafted tokens checked in one run at most (speculative decoding; the draft length adapts below it). */
  maxDraftTokens?: number;
  /** Speculative decoding with drafts from this smaller model folder (a path; in the browser a URL; in a config a folder inside the model folder), which must have the model's tokenizer. */
  draftModel?: string;
  // end of the generation settings
}

export interface Chunk {
  /** null for a chunk of a stage whose loop makes no tokens (pipeline.stages). */
  token: number | null;
  /** The text this token completes: "" while a character or a possible stop string is open. */
  text: string;
  /** pipeline.stages: the stage that made this chunk (the first stage's carry the text). */
  stage?: string;
}

export interface Timings {
  loadMs: number;
  /** The first token: prefill run and selection (measured in the worker). */
  prefillMs: number;
  /** Every later token (measured in the worker). */
  decodeMs: number;
  promptTokens: number;
  newTokens: number;
  decodeTokensPerS: number;
  /** Decode steps run fused (plain greedy on one decoder session: the cache stays in onnxruntime-web). */
  fusedSteps: number;
  /** The loops that make no tokens: denoising steps, their mean time, and the final phase (prefillMs is
   * the init phase). */
  steps?: number;
  stepMs?: number;
  finalMs?: number;
  /** Speculative decoding: tokens drafted and checked, and of those the ones the model accepted. */
  draftedTokens: number;
  acceptedTokens: number;
  /** From the call to the first token, as the page saw it (null when no token came). */
  firstTokenMs: number | null;
  /** From the call to the result, as the page saw it. */
  totalMs: number;
}

/** Audio a folder made: mono samples at their rate. */
export interface Audio {
  audio: Float32Array;
  samplingRate: number;
}

/**
 * A named output (pipeline.output) of a folder whose loop makes no tokens: `kind` says what it is;
 * audio and images come as the web platform takes them, other tensors (embeddings) as data and dims.
 */
export interface NamedOutput {
  kind: 'tensor' | 'audio' | 'image' | 'embedding';
  dtype: string;
  shape: number[];
  /** audio */
  audio?: Float32Array;
  samplingRate?: number;
  /** an image (batch 1), RGBA */
  image?: ImageData;
  /** any other tensor, row-major */
  data?: Float32Array | Int32Array | BigInt64Array | Uint8Array;
  dims?: number[];
}

export interface GenerateResult {
  /** Generated ids, prompt excluded (none for the single_pass and denoising loops). */
  tokens: number[];
  text: string;
  /** "done": a single_pass or denoising request ran to its end. */
  finishReason: 'eos' | 'length' | 'stop' | 'interrupt' | 'done';
  timings: Timings;
  /** The named outputs, by name. */
  outputs?: Record<string, NamedOutput>;
  /** The first image output, and the first audio output. */
  image?: ImageData;
  audio?: Audio;
  /** pipeline.stages: each stage's ids and finish reason (tokens and text above are the first stage's). */
  stages?: Record<string, { tokens: number[]; finishReason: string }>;
  /** An encoder-decoder's language, given or chosen by the model (a code of its lang_to_id). */
  language?: string;
}

export interface PipelineInfo {
  device: 'webgpu' | 'wasm';
  sessions: string[];
  /** pipeline.stages: the stages, in run order (empty for a pipeline of one stage). */
  stages: string[];
  /** The file each session runs, and its variant. */
  files: Record<string, string>;
  dtypes: Record<string, Dtype>;
  /** onnxruntime-web's wasm threads (more than one needs a cross-origin isolated page). */
  threads: number;
  /** The generation settings a request gets unless it gives its own (the folder's config). */
  defaults: Record<string, unknown>;
  eos: number[];
  tokenizer: boolean;
  max_length: number | null;
  model_type: string | null;
  load_ms: number;
  /** generation.loop: "autoregressive", "single_pass" or "denoising". */
  loop: string;
  /** An encoder-decoder's session that reads the prompt's text (T5, BART, Marian): the decoder writes an
   * answer to the prompt, not its continuation. null for the others. */
  text_encoder: string | null;
  /** The named outputs and their kinds. */
  outputs: Record<string, string>;
}

/** An error ortpipe reports; `name` is ConfigError (the model folder), GenerationError (the request), ... */
export class OrtpipeError extends Error {
  constructor(error: { name: string; message: string });
}

/** The settings of every turn of a chat; they default to the model's genai_config.json. */
export type ChatOptions = Omit<GenerateOptions, 'prompt' | 'promptIds' | 'messages' | 'images' | 'mask' | 'maxNewTokens'>;

export class Pipeline {
  readonly info: PipelineInfo;
  generate(options: GenerateOptions): Promise<GenerateResult>;
  stream(options: GenerateOptions): AsyncGenerator<Chunk, GenerateResult, void>;
  /**
   * A multi-turn chat over one KV cache, rendered with tokenizer_config.json's chat_template: each
   * turn runs only its own new tokens. `maxLength` bounds the whole conversation.
   */
  chat(options?: ChatOptions): Promise<Chat>;
  /** Speech for a text from a text-to-speech folder. */
  speak(text: string, options?: GenerateOptions): Promise<Audio>;
  /** Sentence embeddings, float32 [texts, dim] (a sentence-transformers folder); `pooling` and `normalize`
   * instead of the folder's. */
  embed(texts: string | string[], options?: {
    batchSize?: number; pooling?: 'mean' | 'cls' | 'max' | 'lasttoken'; normalize?: boolean;
    onProgress?: (progress: Progress) => void;
  }): Promise<{ data: Float32Array; dims: number[] }>;
  /** Stop the running generation (or chat turn) and any queued behind it. */
  interrupt(): void;
  dispose(): void;
}

/** A conversation; its turns queue with the pipeline's other generations. */
export class Chat {
  /** The reply to a user turn. */
  say(content: string, options?: { maxNewTokens?: number }): Promise<GenerateResult>;
  /** The reply to a user turn, token by token. */
  stream(content: string, options?: { maxNewTokens?: number }): AsyncGenerator<Chunk, GenerateResult, void>;
  /** Drop the last turn (the user's message and the reply); resolves to the conversation's token ids after it. */
  rewind(): Promise<number[]>;
  /** Forget the conversation; the pipeline stays. */
  dispose(): void;
}

/** Load a model folder (genai_config.json v1 or v2, or an Optimum / transformers.js export). */
export function load(modelUrl: string | URL, options?: LoadOptions): Promise<Pipeline>;

/** Whether this browser offers a WebGPU adapter. */
export function webgpuAvailable(): Promise<boolean>;
