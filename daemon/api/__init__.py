"""The request and answer shapes of the HTTP APIs, without the HTTP.

Owns: OpenAI's completions and chat completions (chat.py: parsing a request into an engine
request, answers, chunks, logprobs, tokenize / detokenize / apply-template), Anthropic's
Messages API (messages.py) and OpenAI's Responses API (responses.py) as translations to
and from chat completions, tool calls per chat-template family (tools.py: the formats, the
grammars that constrain a required call, the streaming parser) and reasoning
(reasoning.py: `<think>` blocks to reasoning_content). Pure functions over dicts and
strings; the routes that call them are service/app.py. May import engine/ (the request it
builds); never service/, workers/ or aiohttp.
"""
