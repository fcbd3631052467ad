"""OpenAI's Conversations API, and the Responses API's `conversation` parameter.

- `store`: the server's conversations, in memory, bounded as the response store is;
- `requests`: the request bodies (`ConversationCreateRequest`, `ConversationUpdateRequest`,
  `ConversationItemsRequest`) and the items' check;
- `routes`: `/v1/conversations` and `/v1/conversations/{id}/items`, as functions of the store
  returning OpenAI's objects;
- `turn`: a response in a conversation (`POST /v1/responses` with `conversation`): the items it
  continues, and what it appends once it has ended.
"""
