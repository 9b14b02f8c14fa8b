"""Product assets shipped in the wheel: code-pair/, the trained demo pair (see its README.md)."""
