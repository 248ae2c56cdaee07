// Make the memory snapshot the browser worker starts Python from (run by build/web.py):
//
//   node build/python_snapshot.mjs PYODIDE_DIR ORTPIPE_ZIP OUT
//
// Boots the Pyodide of PYODIDE_DIR (the bundle's copy, so the snapshot matches the wasm the page
// loads), unpacks ortpipe's zip, imports ortpipe's browser target and writes the interpreter's
// memory, gzipped, to OUT. Restoring it skips the interpreter's start and those imports (seconds),
// leaving the compile of pyodide.asm.wasm and the restore itself. `_makeSnapshot` and
// `makeMemorySnapshot` are private to Pyodide's loader: package.json pins Pyodide's exact version.
//
// What the snapshot cannot hold, the worker redoes after restoring: the files (Pyodide's file
// system lives in JS, so ortpipe's zip is unpacked again) and the seed of Python's `random`
// module (which would otherwise be the build's, on every page load).

import { readFileSync, writeFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { gzipSync } from 'node:zlib';

// Imported into the snapshot: the browser target and, through it, the core and the stdlib it uses.
const PRELOAD = 'import ortpipe.targets.pyodide';

async function main([pyodideDir, zipPath, out]) {
  if (!out) throw new Error('usage: node build/python_snapshot.mjs PYODIDE_DIR ORTPIPE_ZIP OUT');
  const indexURL = resolve(pyodideDir) + '/'; // under node: a path, not a file: URL
  const { loadPyodide } = await import(pathToFileURL(indexURL + 'pyodide.mjs').href);
  const python = await loadPyodide({ indexURL, _makeSnapshot: true, stdout: () => {}, stderr: () => {} });
  const sitePackages = python.runPython("import sysconfig; sysconfig.get_path('purelib')");
  python.unpackArchive(new Uint8Array(readFileSync(zipPath)), 'zip', { extractDir: sitePackages });
  python.runPython(PRELOAD);
  const snapshot = python.makeMemorySnapshot();
  writeFileSync(out, gzipSync(snapshot, { level: 6 }));
}

main(process.argv.slice(2)).catch((error) => {
  console.error(`python_snapshot: ${error?.stack ?? error}`);
  process.exit(1);
});
