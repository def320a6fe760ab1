"""`python -m cflow.models`: print the architecture table of docs/MODELS.md from the registry."""

from cflow.models import docs_table

print(docs_table(), end="")
