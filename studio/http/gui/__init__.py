"""The studio GUI's API: models, chat, Hub search, pulls, the page."""
