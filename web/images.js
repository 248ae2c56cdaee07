// Images for a generation, decoded in the worker: what the core's preprocessing takes, uint8 RGB
// [height, width, 3] (py/ortpipe/preprocess/request.py), as CPython's Pillow decoding gives it.
//
// A source is a URL (absolute: ortpipe.js resolves it against the page), a Blob (a File), an
// ImageBitmap or an ImageData. Files are decoded with no colour-space conversion and no alpha
// premultiplication, turned upright by their EXIF orientation, so an opaque PNG gives Pillow's
// bytes exactly. Transparent pixels are laid over white, as CPython does; a canvas keeps them
// premultiplied, so a half-transparent pixel may differ from Pillow's by one level.

const BITMAP_OPTIONS = { colorSpaceConversion: 'none', premultiplyAlpha: 'none', imageOrientation: 'from-image' };

/** An error in the request: the page sees it as a GenerationError. */
function requestError(message) {
  const error = new Error(message);
  error.name = 'GenerationError';
  return error;
}

/**
 * Decode every source to {rgb: Uint8Array, width, height}; an error names the image and the problem.
 * @param {Array<string|Blob|ImageBitmap|ImageData>} sources
 * @param {string} [label] what an error calls the one source (inpainting's "the mask"), else "image i of n"
 */
export async function decodeImages(sources, label) {
  checkSources(sources);
  const decoded = [];
  for (const [i, source] of sources.entries()) {
    const name = `${label ?? `image ${i + 1} of ${sources.length}`} (${describe(source)})`;
    try {
      decoded.push(rgb(await pixels(source)));
    } catch (error) {
      throw requestError(`${name}: ${error.message}`);
    }
  }
  return decoded;
}

/** Refuse `sources` that are not an array of images (before anything is fetched or decoded). */
export function checkSources(sources) {
  if (!Array.isArray(sources)) {
    const found = typeof sources === 'string' ? JSON.stringify(sources) : describe(sources);
    throw requestError(`images must be an array (URLs, Blobs, ImageBitmaps or ImageData), not ${found}`);
  }
}

/** The source's RGBA pixels, unpremultiplied: an ImageData. */
async function pixels(source) {
  if (source instanceof ImageData) return source;
  let bitmap = source;
  if (typeof source === 'string') bitmap = await bitmapOf(await fetchBlob(source));
  else if (source instanceof Blob) bitmap = await bitmapOf(source);
  else if (!(source instanceof ImageBitmap)) throw new Error('not a URL, Blob, ImageBitmap or ImageData');
  const { width, height } = bitmap;
  if (!width || !height) throw new Error('it has no pixels (closed, or 0 wide or high)');
  const context = new OffscreenCanvas(width, height).getContext('2d', { willReadFrequently: true });
  context.drawImage(bitmap, 0, 0);
  if (bitmap !== source) bitmap.close();
  return context.getImageData(0, 0, width, height);
}

async function fetchBlob(url) {
  let response;
  try {
    response = await fetch(url);
  } catch (error) {
    throw new Error(`cannot fetch it (${error.message})`);
  }
  if (!response.ok) throw new Error(`cannot fetch it (HTTP ${response.status})`);
  return response.blob();
}

async function bitmapOf(blob) {
  try {
    return await createImageBitmap(blob, BITMAP_OPTIONS);
  } catch (error) {
    throw new Error(`the browser cannot decode it as an image: ${error.message}`);
  }
}

/** RGBA -> {rgb, width, height}, transparent pixels over white. */
function rgb({ data, width, height }) {
  const out = new Uint8Array(width * height * 3);
  for (let p = 0, q = 0; p < data.length; p += 4, q += 3) {
    const alpha = data[p + 3];
    for (let c = 0; c < 3; c++) {
      out[q + c] = alpha === 255 ? data[p + c] : Math.round((data[p + c] * alpha + 255 * (255 - alpha)) / 255);
    }
  }
  return { rgb: out, width, height };
}

function describe(source) {
  if (typeof source === 'string') return source.startsWith('data:') ? `${source.slice(0, 32)}...` : source;
  if (source instanceof Blob) {
    return `${source.name ? `file ${source.name}` : 'Blob'} ${source.type || 'of no type'}, ${source.size} bytes`;
  }
  if (source instanceof ImageData || source instanceof ImageBitmap) {
    return `${source.constructor.name} ${source.width}x${source.height}`;
  }
  return source === null ? 'null' : typeof source;
}
