"""The gateway's HTTP front: Starlette on uvicorn, a thin adapter over kvmesh.gateway.request_path.

One module per API, the pieces they share beside them:

    server.py             HttpFront: the socket, uvicorn, the routes, start and stop, /health
    models.py             GET /v1/models and /v1/models/{id}
    openai_call.py        POST /v1/chat/completions and /v1/completions, one call object
    chat_completions.py   what only chat completions reads: messages, tools, chat's logprobs
    completions.py        what only completions reads: the prompt, echo, best_of, its logprobs
    openai_request.py     the fields both share (sampling, n, stream) and OpenAIRequest
    grammar.py            structured output: response_format, structured_outputs, guided_*
    openai_answer.py      OpenAI's answer objects: whole, chunk by chunk, tool calls, usage
    openai_stream.py      an answer as OpenAI's event stream
    logprobs.py           OpenAI's logprobs objects
    body.py, fields.py    the body read (bounded, JSON) and its fields read (typed, BadField)
    errors.py             HTTP statuses and error objects
    sse.py, streaming.py  server-sent events: their framing, and sending them as they come
                          (a client's disconnect cancels the work awaited for it)

The agents' APIs (OpenAI Responses, Anthropic Messages) land beside chat_completions.py.
"""
