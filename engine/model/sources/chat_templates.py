"""Chat templates for GGUF files that carry none, by GGUF architecture.

The Gemma 3 270M GGUF of the catalog (made from the pretrained google/gemma-3-270m) has no
`tokenizer.chat_template`. This one writes Gemma's documented turn format,
`<start_of_turn>user|model\\n...<end_of_turn>\\n`: Gemma has no system role, so a leading system
message opens the first turn, followed by a blank line. Gemma 3 defines no tool-call format, so
neither does this template (tools passed to it are ignored).
"""

from __future__ import annotations

GEMMA3_CHAT_TEMPLATE = """\
{#- pdserve's Gemma 3 turn format (engine/model/sources/chat_templates.py) -#}
{%- macro text(content) -%}
    {%- if content is string -%}{{ content }}
    {%- else -%}{%- for part in content if part.type == "text" -%}{{ part.text }}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- set system = "" %}
{%- set rest = messages %}
{%- if messages and messages[0].role == "system" %}
    {%- set system = text(messages[0].content) | trim + "\\n\\n" %}
    {%- set rest = messages[1:] %}
{%- endif %}
{%- if system and not rest %}
    {{- "<start_of_turn>user\\n" + system | trim + "<end_of_turn>\\n" }}
{%- endif %}
{%- for message in rest %}
    {%- if message.role not in ("user", "assistant") %}
        {{- raise_exception("Gemma 3 chats have user and assistant messages after an optional system "
                            + "message, not '" + message.role + "'") }}
    {%- endif %}
    {%- set role = "model" if message.role == "assistant" else "user" %}
    {{- "<start_of_turn>" + role + "\\n" + (system if loop.first else "")
        + text(message.content) | trim + "<end_of_turn>\\n" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<start_of_turn>model\\n" }}
{%- endif %}
"""

# GGUF `general.architecture` -> (chat template when the file has none, more end-of-generation
# tokens than the file's one eos: Gemma's chat turns end with <end_of_turn>).
FALLBACK_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
EXTRA_EOS_TOKENS = {"gemma3": ("<end_of_turn>",)}
