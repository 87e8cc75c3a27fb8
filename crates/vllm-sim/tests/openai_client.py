"""A real OpenAI client against an OpenAI-compatible URL: chat and completions, streaming and not.

Usage: python openai_client.py BASE_URL MODEL   (BASE_URL without /v1). Exits non-zero on any
mismatch; prints one line per check.
"""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
extra = {"ignore_eos": True}

chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, extra_body=extra)
assert chat.object == "chat.completion", chat
assert chat.choices[0].message.role == "assistant"
assert len(chat.choices[0].message.content) == 24, chat.choices[0].message.content
assert chat.choices[0].finish_reason == "length"
assert chat.usage.completion_tokens == 6
assert chat.usage.prompt_tokens_details is not None
print("chat ok", chat.usage)

stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=6, stream=True,
    stream_options={"include_usage": True}, extra_body=extra,
)
pieces, finish, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            pieces.append(choice.delta.content)
        if choice.finish_reason:
            finish = choice.finish_reason
text = "".join(pieces)
assert text == chat.choices[0].message.content, (text, chat.choices[0].message.content)
assert finish == "length" and usage is not None and usage.completion_tokens == 6
# The second identical prompt found its full blocks cached.
assert usage.prompt_tokens_details.cached_tokens > 0, usage
print("chat stream ok", usage)

done = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=4, extra_body=extra)
assert done.object == "text_completion" and len(done.choices[0].text) == 16
print("completion ok", done.usage)

stream = client.completions.create(
    model=model, prompt="The quick brown fox", max_tokens=4, stream=True,
    stream_options={"include_usage": True}, extra_body=extra,
)
chunks = list(stream)
text = "".join(c.choices[0].text for c in chunks if c.choices)
assert text == done.choices[0].text, (text, done.choices[0].text)
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
print("completion stream ok")

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    raise SystemExit("expected a 404")
except openai.NotFoundError as e:
    print("404 ok", e.status_code)

models = client.models.list()
assert [m.id for m in models.data] == [model], models
print("models ok")
