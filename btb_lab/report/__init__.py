"""Reports of stored runs: jinja2 rendering (`render`), plots (`plots`), the log (`log`)."""
