"""Load a model and generate a completion (greedy), with the stats line."""
import sys

from dsv4 import generate, load

model, tokenizer = load(sys.argv[1] if len(sys.argv) > 1 else None)  # None: the bundled demo
generate(model, tokenizer, "The meaning of life is", max_tokens=40, verbose=True)
