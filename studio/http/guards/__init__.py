"""What stands before every route: host and origin checks, the API token, body limits, model paths."""
