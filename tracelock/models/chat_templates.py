"""Jinja chat templates of LLaDA-8B-Instruct and Dream-v0-Instruct-7B, rewritten from their documented semantics.

Both are used verbatim by the tiny checkpoints (`tokenizer_config.json["chat_template"]`) so prompt rendering in
tests follows the same rules as the released models (docs/design.md, "Models").
"""

# Llama-3 style. The released template ignores add_generation_prompt and always opens the assistant turn, and only
# the content is trimmed (the `trim` filter binds tighter than `+`).
LLADA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{ bos_token }}{%- endif -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)

# Qwen2.5 style, without the tool-call branch: the tiny checkpoints are never prompted with tools, and the no-tools
# output of this template equals the released one. A leading system message replaces the default one.
DREAM_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

CHAT_TEMPLATES = {"llada": LLADA_CHAT_TEMPLATE, "dream": DREAM_CHAT_TEMPLATE}
