"""Print a sha256 of the builtin corpus's documents, in order (tests/test_data.py runs it in a
second process to show the corpus is the same everywhere)."""

import hashlib

from utils.data.sources import iter_documents, resolve_sources

h = hashlib.sha256()
for doc in iter_documents(resolve_sources("builtin")):
    h.update(doc.encode() + b"\0")
print(h.hexdigest())
