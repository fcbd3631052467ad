"""The OpenAI Responses API: `POST /v1/responses` (whole or streamed, or in the background), its
WebSocket mode on the same path, `POST /v1/responses/input_tokens`, the stored responses: `GET`
and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, and the background ones'
`POST /v1/responses/{id}/cancel`.

- `requests`: the request bodies (`ResponsesRequest`, its `InputItem`s, `InputTokensRequest`);
- `conversation`: `instructions` and `input` items as chat-template messages;
- `prompt`: a request's prompt as the engine takes it (the conversation it continues resolved,
  tools planned, truncated to the context if asked), and its token count;
- `run`: admitting a request (`start_response`), the response object, the whole response;
- `reply_tokens`: which of the reply's tokens wrote its text, its reasoning or its calls;
- `stream`: the event sequence of a streamed response, for SSE and the WebSocket;
- `socket`: the WebSocket mode: `response.create` messages in, events out, on one connection;
- `socket_lanes`: its lanes (`stream_id`), served concurrently, each in order, and their bounds;
- `store`: responses kept for `previous_response_id` (the server's bounded store, a WebSocket
  connection's most recent response of each lane);
- `items`: input items as a stored response keeps them, and the stored responses' routes;
- `background`: responses run in the server's own nursery (`background: true`), retrieved
  while they run, their event streams followed again, cancelled.

A request with `conversation` continues one of the Conversations API's conversations
(`http/conversations/`: its items before `input`, the response's appended once it ends).

Validation and admission errors are raised (as `APIError`) before the first event. A client that
goes away aborts the generation at the next step boundary, unless it runs in the background.
"""
