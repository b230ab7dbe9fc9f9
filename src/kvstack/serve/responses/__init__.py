"""The OpenAI Responses API (``/v1/responses``) on the chat path: request bodies, the
handler and its streaming events, conversation prompts, the bounded store of responses
and the pins that keep a stored turn's KV for the next one.
"""
