// A helper worker of web/worker.js: it fetches and unpacks what Python starts from, on a thread of
// its own, while the worker's thread starts onnxruntime-web and creates the model's sessions.
//
// Message in: {snapshot: URL, zip: URL}. Messages out, one each, their buffers transferred:
// {snapshot: ArrayBuffer} (the memory snapshot, gunzipped when the server sent it gzipped) and
// {files: [[path, Uint8Array], ...]} (the zip's files, inflated), or {error: message, of: 'snapshot' or 'zip'}.

self.onmessage = ({ data }) => {
  send('snapshot', () => snapshot(data.snapshot), (buffer) => ({ snapshot: buffer }), (buffer) => [buffer]);
  send('zip', () => unzip(data.zip), (files) => ({ files }), (files) => files.map(([, bytes]) => bytes.buffer));
};

function send(of, work, message, transfer) {
  work().then(
    (value) => self.postMessage(message(value), transfer(value)),
    (error) => self.postMessage({ error: String(error?.message ?? error), of }),
  );
}

async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${response.url}: HTTP ${response.status}; rebuild the bundle (python -m build.web)`);
  return new Uint8Array(await response.arrayBuffer());
}

/** The snapshot's bytes: gzipped in the bundle, unless the server already undid the gzip. */
async function snapshot(url) {
  const bytes = await fetchBytes(url);
  if (bytes[0] !== 0x1f || bytes[1] !== 0x8b) return bytes.buffer;
  return inflate(bytes, 'gzip');
}

async function inflate(bytes, format) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream(format));
  return new Response(stream).arrayBuffer();
}

// Zip records (PKWARE's APPNOTE): end of central directory, central directory entry, local header.
const END = 0x06054b50;
const ENTRY = 0x02014b50;
const LOCAL = 0x04034b50;

/** The files of the zip at `url`: [[path, bytes]], directories left out. A name that would leave
 * the folder it is unpacked into (absolute, or with a ".." part) is an error. */
async function unzip(url) {
  const bytes = await fetchBytes(url);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let end = bytes.length - 22; // the end record is 22 bytes and a comment of up to 65535
  while (end >= 0 && view.getUint32(end, true) !== END) end -= 1;
  if (end < 0 || bytes.length - end > 22 + 0xffff) throw new Error(`${url}: not a zip file`);
  const count = view.getUint16(end + 10, true);
  const names = new TextDecoder();
  const reads = [];
  for (let at = view.getUint32(end + 16, true), i = 0; i < count; i++) {
    if (view.getUint32(at, true) !== ENTRY) throw new Error(`${url}: a damaged central directory`);
    const method = view.getUint16(at + 10, true);
    const size = view.getUint32(at + 20, true);
    const nameLength = view.getUint16(at + 28, true);
    const skip = nameLength + view.getUint16(at + 30, true) + view.getUint16(at + 32, true);
    const local = view.getUint32(at + 42, true);
    const name = names.decode(bytes.subarray(at + 46, at + 46 + nameLength));
    at += 46 + skip;
    if (name.endsWith('/')) continue;
    if (name.startsWith('/') || name.split('/').includes('..')) throw new Error(`${url}: the entry ${name} leaves its folder`);
    if (view.getUint32(local, true) !== LOCAL) throw new Error(`${url}: a damaged entry ${name}`);
    const start = local + 30 + view.getUint16(local + 26, true) + view.getUint16(local + 28, true);
    const data = bytes.subarray(start, start + size);
    if (method === 0) reads.push(Promise.resolve([name, data.slice()]));
    else if (method === 8) reads.push(inflate(data, 'deflate-raw').then((buffer) => [name, new Uint8Array(buffer)]));
    else throw new Error(`${url}: the entry ${name} is compressed with method ${method} (stored or deflated only)`);
  }
  return Promise.all(reads);
}
