"""The HTTP surface: OpenAI routes and bodies, ops routes, errors, auth and limits."""
