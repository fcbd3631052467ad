"""The Anthropic Messages API: `POST /v1/messages` (streaming and not) and
`POST /v1/messages/count_tokens`, in Anthropic's request, response, event and error shapes.

- `requests`: the request bodies; `objects`: the responses, stream events and errors;
- `conversation`: `system` and `messages` as the chat template takes them (prefill, tool_use and
  tool_result blocks, image blocks for the multimodal path included); `input_blocks`: what each
  content block says (a call, a tool result's text and images, a document's text, an image);
- `tools`: `tools` and `tool_choice` on the OpenAI routes' tool machinery (`http/tooling.py`);
- `messages`: preparing and admitting a request, the final message, token counts;
- `blocks`: an answer's content blocks (text, thinking, tool_use), whole and as stream events;
- `stream`: the SSE event sequence; `errors`: the server's errors in Anthropic's shape;
- `request_ids`: the `request-id` of every answer to an Anthropic client;
- `models`: `GET /v1/models` in Anthropic's shape, for a request with `anthropic-version`.

`x-api-key`, `anthropic-version` and `anthropic-beta` headers are accepted and not required.
"""
