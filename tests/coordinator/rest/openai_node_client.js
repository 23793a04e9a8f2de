// OpenAI's official Node client (tools/node_modules/openai) against a running Conveyor:
// chat, a chat stream, completions, a completions stream and the scoring idiom, each compared
// with what it must equal. Run by tests/coordinator/rest/test_openai_node_client.cc:
//
//   node openai_node_client.js BASE_URL MODEL GOLDEN_PROMPT_FILE
//
// BASE_URL: http://127.0.0.1:PORT (the server's chat template must be the built-in chatml);
// GOLDEN_PROMPT_FILE: the golden rendering of the conversation below (chatml.system_user.gen).
// Prints one "ok: ..." line per check and exits 0, or prints "FAIL: ..." and exits 1.
"use strict";
const fs = require("fs");
const path = require("path");
const assert = require("assert/strict");
const OpenAI = require(path.join(__dirname, "../../../tools/node_modules/openai")).default;

const [baseUrl, model, goldenFile] = process.argv.slice(2);
const client = new OpenAI({ baseURL: baseUrl + "/v1", apiKey: "not-needed", maxRetries: 0, timeout: 60000 });
// tests/data/chat_templates/conversations/system_user.json
const messages = JSON.parse(fs.readFileSync(path.join(__dirname, "../../data/chat_templates/conversations/system_user.json")));
const sampling = { model, max_tokens: 12, temperature: 0.8, seed: 20261125, ignore_eos: true };

async function postJson(route, body) {
  const r = await fetch(baseUrl + route, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const answer = await r.text();
  assert.equal(r.status, 200, `${route}: ${answer}`);
  return JSON.parse(answer);
}

async function main() {
  // The prompt the server renders is the golden file's text, token for token.
  const rendered = await postJson("/tokenize", { model, messages });
  const text = (await postJson("/detokenize", { model, tokens: rendered.tokens })).prompt;
  assert.equal(text, fs.readFileSync(goldenFile, "utf8"));
  console.log(`ok: the conversation renders as the golden chatml prompt (${rendered.count} tokens)`);

  const chat = await client.chat.completions.create({ ...sampling, messages });
  assert.equal(chat.object, "chat.completion");
  assert.equal(chat.choices.length, 1);
  assert.equal(chat.choices[0].message.role, "assistant");
  assert.equal(chat.choices[0].finish_reason, "length");
  assert.equal(chat.usage.completion_tokens, 12);
  assert.equal(chat.usage.prompt_tokens, rendered.count);
  const answer = chat.choices[0].message.content;
  assert.ok(answer.length > 0);
  console.log(`ok: chat answers ${JSON.stringify(answer)}`);

  const completion = await client.completions.create({ ...sampling, prompt: rendered.tokens });
  assert.equal(completion.choices[0].text, answer);
  console.log("ok: completions on the rendered prompt with the same seed give the same text");

  const stream = await client.chat.completions.create({ ...sampling, messages, stream: true, stream_options: { include_usage: true } });
  let streamed = "", role = null, finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      if (c.delta.content) streamed += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(role, "assistant");
  assert.equal(streamed, answer);
  assert.equal(finish, "length");
  // Counts equal; cached_tokens may not (the prefix cache holds the prompt by now).
  for (const k of ["prompt_tokens", "completion_tokens", "total_tokens"]) assert.equal(usage[k], chat.usage[k], k);
  console.log("ok: the chat stream gives the same text, its role, finish_reason and usage");

  const cstream = await client.completions.create({ ...sampling, prompt: rendered.tokens, stream: true });
  let ctext = "";
  for await (const chunk of cstream) ctext += chunk.choices[0].text;
  assert.equal(ctext, answer);
  console.log("ok: the completions stream gives the same text");

  const withLogprobs = await client.chat.completions.create({ ...sampling, messages, logprobs: true, top_logprobs: 2 });
  const content = withLogprobs.choices[0].logprobs.content;
  assert.equal(content.length, 12);
  assert.equal(Buffer.from(content.flatMap((t) => t.bytes)).toString("utf8"), answer);
  assert.ok(content.every((t) => t.top_logprobs.length === 2 && t.logprob <= 0));
  console.log("ok: chat logprobs.content spells the answer, two alternatives a token");

  // lm-evaluation-harness's loglikelihood request: the prompt scored, nothing generated.
  const scored = await client.completions.create({ model, prompt: rendered.tokens, echo: true, max_tokens: 0, logprobs: 1, temperature: 0 });
  const lp = scored.choices[0].logprobs;
  assert.equal(scored.choices[0].text, text);
  assert.equal(scored.usage.completion_tokens, 0);
  assert.equal(lp.token_logprobs.length, rendered.count);
  assert.equal(lp.token_logprobs[0], null);
  for (let i = 1; i < rendered.count; ++i) {
    assert.ok(Number.isFinite(lp.token_logprobs[i]) && lp.token_logprobs[i] <= 0, `token ${i}`);
    const best = Math.max(...Object.values(lp.top_logprobs[i]));
    assert.ok(best >= lp.token_logprobs[i] - 1e-6, `top_logprobs of token ${i}`);
  }
  console.log(`ok: the scoring idiom (echo, max_tokens 0, logprobs 1) scores the ${rendered.count} prompt tokens`);

  try {
    await client.chat.completions.create({ model, messages, top_logprobs: 2 }, { headers: { "X-Request-Id": "node-bad-1" } });
    assert.fail("a bad request was accepted");
  } catch (err) {
    assert.ok(err instanceof OpenAI.APIError, String(err));
    assert.equal(err.status, 400);
    assert.equal(err.param, "top_logprobs");
    assert.equal(err.requestID, "node-bad-1");
  }
  console.log("ok: a bad request is an APIError with its param and the client's request id");
}

main().catch((err) => {
  console.log(`FAIL: ${err && err.stack ? err.stack : err}`);
  process.exit(1);
});
