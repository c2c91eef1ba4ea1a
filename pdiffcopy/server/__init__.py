"""The server: the Flask app and its views, body reader, OpenAPI, the gunicorn runner."""
