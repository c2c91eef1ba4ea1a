"""The HTTP client: connections, retries, one-line errors; RemoteFile, RemoteTree."""
