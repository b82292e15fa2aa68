"""Stream tokens as they are generated, with the chat encoding."""
import sys

from dsv4 import load, stream_generate
from dsv4.generation import chat_prompt

model, tokenizer = load(sys.argv[1] if len(sys.argv) > 1 else None)
prompt = chat_prompt("Tell me a short story.")
for response in stream_generate(model, tokenizer, prompt, max_tokens=60, temp=0.7, seed=1):
    print(response.text, end="", flush=True)
print(f"\n[{response.generation_tokens} tokens, {response.generation_tps:.1f} tok/s]")
