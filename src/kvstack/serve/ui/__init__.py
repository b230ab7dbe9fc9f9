"""The web view: the page, KV-state and prefix snapshots as Server-Sent Events."""
