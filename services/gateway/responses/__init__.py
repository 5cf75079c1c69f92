"""The Responses API (POST /v1/responses; GET and DELETE /v1/responses/{id}) as a
translation onto the chat path, not a second pipeline:

protocol.py   the request, its items and parts validated; what is not supported refused by name
convert.py    the request (and the conversation it continues) as a chat request; a Response
events.py     the output's items built as the text comes, and the stream of events
store.py      stored responses and their conversations, bounded by bytes and age
"""
