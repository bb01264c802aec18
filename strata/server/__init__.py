"""`strata serve`: an OpenAI-compatible HTTP front end over an engine running in its own process."""
