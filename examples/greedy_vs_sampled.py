"""The same prompt greedy and sampled: greedy is deterministic, sampling follows the seed."""
import sys

from dsv4 import generate, load

model, tokenizer = load(sys.argv[1] if len(sys.argv) > 1 else None)
prompt = "Once upon a time"
print("greedy:      ", repr(generate(model, tokenizer, prompt, max_tokens=30)))
for seed in (1, 2):
    text = generate(model, tokenizer, prompt, max_tokens=30, temp=0.8, top_p=0.95, seed=seed)
    print(f"sampled s={seed}:", repr(text))
