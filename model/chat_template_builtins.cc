// The chat templates Conveyor ships (model/chat_template.h, builtin_chat_template): its own
// templates in the formats of well-known model families. tests/data/chat_templates/NAME.jinja
// holds the same text (tests/model/test_chat_template.cc checks that they agree), where the
// golden tests render them.
#include "model/chat_template.h"

namespace conveyor {

namespace {

struct Builtin {
  const char* name;
  const char* text;
};

// clang-format off
const Builtin kBuiltins[] = {
    {"chatml", R"tmpl({#- ChatML: every turn is <|im_start|>ROLE, a newline, the text, <|im_end|>, a newline. -#}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
)tmpl"},
    {"llama2", R"tmpl({#- Llama 2 style: a system text goes inside the first [INST] between <<SYS>> markers; turns
    must alternate user, assistant, user, ... -#}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = '' %}
    {%- set turns = messages %}
{%- endif %}
{%- for turn in turns %}
    {%- if (turn['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('this template needs turns that alternate user, assistant, user, ... (after an optional system message)') }}
    {%- endif %}
    {%- if turn['role'] == 'user' %}
        {%- if loop.first and system_text %}
            {%- set text = '<<SYS>>\n' ~ system_text ~ '\n<</SYS>>\n\n' ~ turn['content'] | trim %}
        {%- else %}
            {%- set text = turn['content'] | trim %}
        {%- endif %}
        {{- bos_token ~ '[INST] ' ~ text ~ ' [/INST]' }}
    {%- else %}
        {{- ' ' ~ turn['content'] | trim ~ ' ' ~ eos_token }}
    {%- endif %}
{%- endfor %}
)tmpl"},
    {"llama3", R"tmpl({#- Llama 3 style: a header per turn, the text, then <|eot_id|>. -#}
{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\n\n' ~ message.content | trim ~ '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
)tmpl"},
    {"mistral", R"tmpl({#- Mistral style: [INST] around user turns, the assistant's text closed by the eos token; a
    system message is folded into the last user turn. -#}
{%- set ns = namespace(system='', turns=messages) %}
{%- if messages and messages[0].role == 'system' %}
    {%- set ns.system = messages[0].content %}
    {%- set ns.turns = messages[1:] %}
{%- endif %}
{{- bos_token }}
{%- for m in ns.turns %}
    {%- if m.role == 'user' %}
        {%- if loop.last and ns.system %}
            {{- '[INST] ' + ns.system + '\n\n' + m.content + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + m.content + '[/INST]' }}
        {%- endif %}
    {%- elif m.role == 'assistant' %}
        {{- ' ' + m.content + eos_token }}
    {%- else %}
        {{- raise_exception('after an optional system message this template takes user and assistant turns only, not ' ~ m.role) }}
    {%- endif %}
{%- endfor %}
)tmpl"},
    {"zephyr", R"tmpl({# Zephyr style, written with plain tags: trim_blocks and lstrip_blocks keep the tags' lines out. #}
{% for message in messages %}
<|{{ message.role }}|>
{{ message.content }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
)tmpl"},
    {"gemma", R"tmpl({#- Gemma style: turns between <start_of_turn> and <end_of_turn>, the assistant called "model";
    no system role: its text opens the first turn. -#}
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_prefix = messages[0]['content'] | trim + '\n\n' -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set first_prefix = '' -%}
    {%- set rest = messages -%}
{%- endif -%}
{%- for message in rest -%}
    {%- if message['role'] not in ['user', 'assistant'] -%}
        {{ raise_exception('unsupported role ' + message['role'] + ' (user and assistant only, after an optional system message)') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
)tmpl"},
};
// clang-format on

}  // namespace

std::optional<std::string_view> builtin_chat_template(std::string_view name) {
  for (const Builtin& b : kBuiltins)
    if (name == b.name) return std::string_view(b.text);
  return std::nullopt;
}

std::vector<std::string> builtin_chat_template_names() {
  std::vector<std::string> out;
  for (const Builtin& b : kBuiltins) out.emplace_back(b.name);
  return out;
}

}  // namespace conveyor
