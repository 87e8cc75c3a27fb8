"""Writes the model directory the real-vLLM fleet serves: a tiny Llama (random weights, served
with --load-format dummy) with a real tokenizer and a ChatML chat template.

The tokenizer is Mistral-7B v0.1's SentencePiece model, shipped inside the mistral_common
package (a vLLM requirement), converted to tokenizer.json by transformers. Nothing is downloaded.

Usage: python scripts/vllm-model.py OUT_DIR   (with the python of scripts/vllm-venv.sh)
"""

import json
import os
import shutil
import sys
import tempfile

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# ChatML, with tools listed in the system turn and text parts joined.
CHAT_TEMPLATE = """{%- macro text(content) -%}
{%- if content is string %}{{ content }}
{%- elif content %}{% for part in content %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{ text(messages[0]['content']) + '\n\n' }}{% endif %}
{{- '# Tools\n' }}
{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message['role'] == 'system') %}
{{- '<|im_start|>' + message['role'] + '\n' }}
{%- if message['name'] %}{{ message['name'] + ': ' }}{% endif %}
{{- text(message['content']) }}
{%- if message['tool_calls'] %}{% for call in message['tool_calls'] %}{{ '\n<tool_call>' }}{{ call['function'] | tojson }}{{ '</tool_call>' }}{% endfor %}{% endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""


def main(out: str) -> None:
    import mistral_common
    from transformers import LlamaTokenizer

    source = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        shutil.copy(source, os.path.join(work, "tokenizer.model"))
        tokenizer = LlamaTokenizer.from_pretrained(work)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if not os.path.exists(os.path.join(out, name)):
            sys.exit(f"vllm-model: {name} was not written to {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm-model.py OUT_DIR")
    main(sys.argv[1])
