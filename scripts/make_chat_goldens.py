#!/usr/bin/env python3
"""Renders every chat template x conversation x add_generation_prompt in
tests/data/chat_templates/ into golden files, as HuggingFace transformers renders them, for
the C++ template engine's conformance test (tests/model/test_chat_template_golden.cc).

    python3 scripts/make_chat_goldens.py [--renderer transformers|jinja2|auto] [--check]

Templates: tests/data/chat_templates/*.jinja. Conversations: .../conversations/*.json (a
list of {"role", "content"} messages). Each case writes
.../golden/TEMPLATE.CONVERSATION.(gen|plain).txt, the rendered text byte for byte, or, when
the template refuses the conversation (raise_exception), ....error.txt with its message.
The special tokens are bos_token "<s>" and eos_token "</s>" for every case.

Renderers:
- transformers (the reference): tokenizer.apply_chat_template(messages, chat_template=TEXT,
  tokenize=False, add_generation_prompt=..., bos_token=..., eos_token=...) on the demo model's
  GPT-2 tokenizer (models/brown-gpt2; no network). Run it where transformers is installed
  (the GPU machine) to confirm the files: with --check it compares instead of writing and
  exits 1 on any difference.
- jinja2: what transformers does inside apply_chat_template, rebuilt on plain jinja2 (an
  ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loopcontrols; its own
  tojson and raise_exception; messages, tools=None, documents=None and the special tokens as
  variables). For machines without transformers (Debian: apt-get install python3-jinja2).
- auto (the default): transformers when importable, else jinja2.
"""
import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "tests", "data", "chat_templates")
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


class TemplateRaised(Exception):
    pass


def jinja2_renderer():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception

    def render(template, messages, add_generation_prompt):
        try:
            return env.from_string(template).render(messages=messages, tools=None, documents=None,
                                                    add_generation_prompt=add_generation_prompt, **SPECIAL)
        except jinja2.exceptions.TemplateError as e:
            if type(e) is not jinja2.exceptions.TemplateError:  # a syntax or undefined error: ours to fix
                raise
            raise TemplateRaised(str(e))

    return "jinja2 " + jinja2.__version__, render


def transformers_renderer():
    import jinja2
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "models", "brown-gpt2"))

    def render(template, messages, add_generation_prompt):
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **SPECIAL)
        except jinja2.exceptions.TemplateError as e:
            if type(e) is not jinja2.exceptions.TemplateError:
                raise
            raise TemplateRaised(str(e))

    return "transformers " + transformers.__version__, render


def choose(name):
    if name == "jinja2":
        return jinja2_renderer()
    if name == "transformers":
        return transformers_renderer()
    try:
        return transformers_renderer()
    except ImportError:
        return jinja2_renderer()


def cases():
    templates = sorted(f[:-6] for f in os.listdir(DATA) if f.endswith(".jinja"))
    conversations = sorted(f[:-5] for f in os.listdir(os.path.join(DATA, "conversations")) if f.endswith(".json"))
    for t in templates:
        with open(os.path.join(DATA, t + ".jinja"), encoding="utf-8") as f:
            template = f.read()
        for c in conversations:
            with open(os.path.join(DATA, "conversations", c + ".json"), encoding="utf-8") as f:
                messages = json.load(f)
            for gen in (False, True):
                yield f"{t}.{c}.{'gen' if gen else 'plain'}", template, messages, gen


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--renderer", choices=["auto", "transformers", "jinja2"], default="auto")
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = ap.parse_args()
    try:
        which, render = choose(args.renderer)
    except ImportError as e:
        print(f"make_chat_goldens.py: the {args.renderer} renderer needs a module that is missing: {e}", file=sys.stderr)
        return 2
    out_dir = os.path.join(DATA, "golden")
    os.makedirs(out_dir, exist_ok=True)
    expected = {}
    for name, template, messages, gen in cases():
        try:
            expected[name + ".txt"] = render(template, messages, gen)
        except TemplateRaised as e:
            expected[name + ".error.txt"] = str(e)
    if args.check:
        bad = []
        for name, text in sorted(expected.items()):
            path = os.path.join(out_dir, name)
            if not os.path.exists(path) or open(path, encoding="utf-8", newline="").read() != text:
                bad.append(name)
        stale = sorted(set(os.listdir(out_dir)) - set(expected))
        for name in bad:
            print(f"differs or missing: {name}")
        for name in stale:
            print(f"not made by {which}: {name}")
        print(f"{which}: {len(expected) - len(bad)} of {len(expected)} golden files agree")
        return 1 if bad or stale else 0
    for old in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, old))
    for name, text in expected.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    print(f"{which}: wrote {len(expected)} golden files to {os.path.relpath(out_dir, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
