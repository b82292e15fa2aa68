"""The HTTP server: `python -m dsv4.server` (dsv4/server.py) runs it.

    app.py                 Starlette routes, request bodies, SSE, client disconnects
    openai_chat.py         /v1/chat/completions, /v1/completions
    openai_responses.py    /v1/responses (+ stored responses for previous_response_id)
    anthropic_messages.py  /v1/messages, /v1/messages/count_tokens
    options.py             parameters every dialect checks the same way (sampling, stops, limits)
    output.py              one generation seen from a handler: parsed deltas, stops, usage
    scheduler.py           the worker thread: admission, chunked prefill, batched decode
    engine.py              what the scheduler asks of a model (ModelEngine for a dsv4 model)
    prefix_cache.py        caches by token prefix: an LRU in memory bounded in bytes
    disk_cache.py          the prefix cache's tier on disk, kept across restarts
    replay.py              the token ids a model produced, put back where a client echoes them
    structured.py          grammar-constrained sampling for response formats (llguidance)
    errors.py              RequestError

The encoder and the output parser are dsv4.encoding, shared by every dialect and the chat.
"""
