"""The router's HTTP surface: the app's routes, its edge (body limits, read timeouts),
the hot path, API keys and the response writers."""
