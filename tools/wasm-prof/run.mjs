// Runs a wasm32-wasip1 command module (e.g. examples/pick_loop.rs built for wasm) under Node's
// WASI, which compiles it with V8 as Envoy does. Any arguments after the .wasm path are passed
// to the module. Profile it with `node --cpu-prof --cpu-prof-dir=DIR tools/wasm-prof/run.mjs …`
// (a build that keeps its name section, e.g. `--profile bench`, shows Rust function names).
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import { argv, exit } from "node:process";

if (argv.length < 3) {
  console.error("usage: node run.mjs MODULE.wasm [ARGS...]");
  exit(2);
}
const wasi = new WASI({ version: "preview1", args: argv.slice(2), env: {}, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(argv[2]));
// The library links the proxy-wasm ABI's host functions (module "env"); the loop never calls
// them, so each is a stub that fails loudly if it ever is.
const env = {};
for (const imp of WebAssembly.Module.imports(module)) {
  if (imp.module === "env" && imp.kind === "function") {
    env[imp.name] = () => {
      throw new Error(`host call ${imp.name} is not available outside Envoy`);
    };
  }
}
const instance = await WebAssembly.instantiate(module, { ...wasi.getImportObject(), env });
// The library also exports `_initialize` (the proxy-wasm reactor's entry), which Node's WASI
// refuses beside `_start`; hand it only what a command needs.
const { memory, _start } = instance.exports;
exit(wasi.start({ exports: { memory, _start } }));
