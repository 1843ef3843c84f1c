"""What one request may ask for, at every network edge alike: the router's OpenAI models
(services/router/api/openai_models.py) and the workers' gRPC edge (services/worker/edge_checks.py)
refuse the same values, so a caller that reaches a worker directly gets no more than one that
goes through the router."""

MAX_STOP = 16  # stop strings, stop_token_ids, bad words (a bad word: up to 2 token sequences)
MAX_LIST_FIELD = 1024  # logit_bias entries, allowed_token_ids
MAX_BAD_WORD_TOKENS = 200  # one bad word's characters (router) or tokens (worker)
MAX_CACHE_SALT = 1024  # characters
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 2.0
MAX_TOP_K = 100_000
