"""The OpenAI request features the router implements: the request models, tools and
tool-call parsing, structured outputs, chat options and what it refuses."""
