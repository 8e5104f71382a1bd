"""One module per command; each defines `command` (a click command) and imports heavy packages lazily."""
