"""The OpenAI Responses API: `POST /v1/responses` (whole or streamed), its WebSocket mode on the
same path, and `POST /v1/responses/input_tokens`.

- `requests`: the request bodies (`ResponsesRequest`, its `InputItem`s, `InputTokensRequest`);
- `conversation`: `instructions` and `input` items as chat-template messages;
- `prompt`: a request's prompt as the engine takes it (tools planned), and its token count;
- `run`: admitting a request (`start_response`), the response object, the whole response;
- `reply_tokens`: which of the reply's tokens wrote its text, its reasoning or its calls;
- `stream`: the event sequence of a streamed response, for SSE and the WebSocket;
- `socket`: the WebSocket mode: `response.create` messages in, events out, on one connection.

Validation and admission errors are raised (as `APIError`) before the first event. A client that
goes away aborts the generation at the next step boundary.
"""
