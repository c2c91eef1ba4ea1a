"""The command line: options, the token, what SOURCE and TARGET mean, reports, progress, benchmark."""
