"""OpenAI's Responses API (`/v1/responses`), served on the chat path: request.py (the body),
convert.py (to the chat request it runs as), output.py (items and events), store.py (the
bounded store behind `store` and `previous_response_id`), routes.py (the endpoints)."""
